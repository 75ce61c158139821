"""The `vllm` generator, whose engine runs in a child process in the vLLM environment.

The rank's side: `generator.py` (`VLLMGenerator`), `rollouts.py` (the engine's replies as rollouts and
turns), `engine_args.py` (the engine's flags), `client.py` (starting and calling the engine process),
`env.py` (where the vLLM environment is). Both sides: `protocol.py` (every request, its reply, which
ones a running generate answers). The engine's side: `server.py` (the process), `engine.py` (the
requests), `engine_sampling.py`, `engine_weights.py`. Nothing is imported here: the engine's side runs
where only vLLM's torch is installed."""
