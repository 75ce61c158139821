"""The vLLM engine process's flags from a generator's settings (what `server.parse_args` reads): what its
`vllm.LLM` is built with, the CPU engine's KV cache sized for the run; and the special tokens of the
model folder it serves.
"""

from __future__ import annotations

import json
from pathlib import Path

from llamarl.comm.layouts import dtype_from_str
from llamarl.exec.config import GeneratorConfig


def server_args(
    *,
    model: str,
    dtype: str,
    engine: GeneratorConfig,
    device: str,
    num_threads: int,
    seed: int | None,
    sequences: int,
    max_new_tokens: int,
    in_flight_updates: bool,
) -> list[str]:
    """`server.py`'s flags for an engine serving `model` in `dtype` on `device` ("cuda..." or "cpu"),
    `sequences` at once of up to `max_new_tokens` new tokens each; `in_flight_updates`: weights may load
    while a generate runs (stream mode)."""
    cuda = device.startswith("cuda")
    args = [
        "--model", str(model),
        "--dtype", dtype,
        "--max-num-seqs", str(sequences),
        "--num-threads", str(num_threads),
        "--seed", str(seed or 0),
        "--device", "cuda" if cuda else "cpu",
        "--gpu-memory-utilization", str(engine.gpu_memory_utilization),
    ]  # fmt: skip
    if engine.max_model_len is not None:
        args += ["--max-model-len", str(engine.max_model_len)]
    if not cuda:  # on CUDA the KV cache takes what gpu_memory_utilization leaves
        args += ["--kv-cache-bytes", str(cpu_kv_cache_bytes(model, dtype, engine, sequences, max_new_tokens))]
    if cuda and engine.cuda_graphs:
        args.append("--cuda-graphs")
    # Tokens of a step scheduled ahead would be stamped with the version of weights loaded after it.
    if cuda and engine.async_scheduling and not in_flight_updates:
        args.append("--async-scheduling")
    return args


def cpu_kv_cache_bytes(
    model: str, dtype: str, engine: GeneratorConfig, sequences: int, max_new_tokens: int
) -> int:
    """The CPU engine's KV cache: engine.kv_cache_gib, or sized for this run (`kv_cache_bytes`)."""
    if engine.kv_cache_gib is not None:
        return int(engine.kv_cache_gib * 2**30)
    config = json.loads((Path(model) / "config.json").read_text())
    sized = kv_cache_bytes(
        config.get("text_config", config),  # a vision-language model's is its text model's
        dtype=dtype,
        sequences=sequences,
        new_tokens=max_new_tokens,
        max_model_len=engine.max_model_len,
    )
    return FALLBACK_KV_CACHE_BYTES if sized is None else sized


# Tokens a prompt may take (chat template, earlier turns) when the KV cache is sized for a run. A run whose
# sequences need more still runs: vLLM then preempts sequences and recomputes them later.
PROMPT_TOKENS_ALLOWANCE = 1024
# A config that does not give the attention's shapes (the sizes a KV cache is made of): 1 GiB.
FALLBACK_KV_CACHE_BYTES = 1 << 30


def kv_cache_bytes(
    model_config: dict, *, dtype: str, sequences: int, new_tokens: int, max_model_len: int | None
) -> int | None:
    """Bytes of KV cache for `sequences` sequences of PROMPT_TOKENS_ALLOWANCE + `new_tokens` tokens, and
    at least for one of the engine's longest (`max_model_len`, else the model's: vLLM refuses to start
    otherwise), with 10% over for vLLM's rounding to whole blocks. `model_config`: the model folder's
    config.json; a token takes keys and values of every layer's KV heads, in `dtype` (a torch dtype's
    name). None when the config lacks the layer count or the head count."""
    if not {"num_hidden_layers", "num_attention_heads"} <= model_config.keys():
        return None
    heads = model_config["num_attention_heads"]
    kv_heads = model_config.get("num_key_value_heads") or heads
    head_dim = model_config.get("head_dim") or model_config.get("hidden_size", 0) // heads
    if not head_dim:
        return None
    per_token = 2 * model_config["num_hidden_layers"] * kv_heads * head_dim * dtype_from_str(dtype).itemsize
    longest = max_model_len or model_config.get("max_position_embeddings", 0)
    tokens = max(sequences * (PROMPT_TOKENS_ALLOWANCE + new_tokens), longest)
    return int(tokens * per_token * 1.1)


def special_tokens(model_dir: Path) -> tuple[list[int], int]:
    """(eos ids, pad id) from the folder's generation_config.json / config.json, as HFGenerator picks them."""
    if not model_dir.is_dir():
        raise ValueError(f"the vllm generator serves a local model folder; {model_dir} is not one")
    paths = (model_dir / "generation_config.json", model_dir / "config.json")
    configs = [json.loads(p.read_text()) for p in paths if p.is_file()]
    eos = next((c["eos_token_id"] for c in configs if c.get("eos_token_id") is not None), None)
    if eos is None:
        raise ValueError(f"{model_dir}: the model defines no eos token")
    eos_ids = [eos] if isinstance(eos, int) else list(eos)
    pad = next((c["pad_token_id"] for c in configs if c.get("pad_token_id") is not None), None)
    return eos_ids, eos_ids[0] if pad is None else int(pad)
