"""Sampling: the `hf` generator in the rank (`hf.py`; how it draws tokens and records their log-probs,
`hf_sampling.py`; its in-place KV cache and CPU-packed linears) and the `vllm` generator, whose engine
runs in a child process (`vllm/`). Both implement `llamarl.exec.types.Generator`. Nothing is imported
here: the vLLM engine's process imports this package's `vllm` modules in an environment of its own."""
