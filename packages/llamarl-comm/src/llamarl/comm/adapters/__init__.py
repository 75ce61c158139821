"""Engine adapters for llamarl.comm.

Each adapter lives in its own module and imports its engine lazily, so that `llamarl-comm` keeps torch as
its only dependency: `llamarl.comm.adapters.vllm` imports without vLLM installed, and only touches vLLM
objects handed to it (the worker it is mixed into, or the `LLM` a driver passes in).
"""
