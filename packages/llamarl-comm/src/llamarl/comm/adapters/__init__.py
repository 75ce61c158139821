"""Engine adapters for llamarl.comm.

Each adapter imports its engine lazily, so that `llamarl-comm` keeps torch as its only dependency:

- `staged`: pull before pause for any engine (receive a sync into staging on a thread while the engine
  serves; the engine pauses only to swap it in);
- `checkpoint`: what an engine serving a HF safetensors folder expects a sync to deliver;
- `vllm` (the plugin and offline drivers), `vllm_engine` (the worker's backend: the one module that
  imports vLLM), `vllm_worker` (its work, without vLLM), `vllm_trainer` (the trainer side, for any
  PyTorch trainer, and an HTTP client of `vllm serve`): llamarl.comm as vLLM's `llamarl`
  weight-transfer backend.
"""
