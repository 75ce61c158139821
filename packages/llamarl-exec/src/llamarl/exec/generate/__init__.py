"""Sampling: the `hf` generator in the rank (`hf.py`, with its in-place KV cache and CPU-packed linears)
and the `vllm` generator, whose engine runs in a child process (`vllm/`). Both implement
`llamarl.exec.types.Generator`. Nothing is imported here: the vLLM engine's process imports
`llamarl.exec.generate.vllm.server` in an environment of its own."""
