"""The `vllm` generator: `generator.py` (the rank's side), `client.py` (starting and calling the engine
process), `server.py` (the engine process, run in the vLLM environment), `env.py` (where that
environment is). Nothing is imported here: the server runs where only vLLM's torch is installed."""
