"""The tensors of a HF safetensors checkpoint folder, read from the files' headers alone: what an engine
that serves the folder expects each weight sync to deliver (names, shapes, dtypes), without loading it
and without the `safetensors` package.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = ["TensorSpec", "checkpoint_tensor_specs", "resolve_model_dir"]

# safetensors dtype codes -> torch dtypes (the ones torch can hold).
_SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


@dataclass(frozen=True, kw_only=True)
class TensorSpec:
    """Shape and dtype of one checkpoint tensor."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def _safetensors_header(path: Path) -> dict[str, Any]:
    # Format: 8-byte little-endian header length, then that many bytes of JSON. Reading only the header
    # keeps this cheap for multi-GB shards and needs no `safetensors` package.
    with path.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(length))


def checkpoint_tensor_specs(model_dir: str | os.PathLike[str]) -> dict[str, TensorSpec]:
    """Names, shapes and dtypes of every tensor in a HF safetensors checkpoint folder, in file order.

    Uses `model.safetensors.index.json` when present (sharded checkpoints), else every `*.safetensors`
    file in the folder. Raises FileNotFoundError when the folder has no safetensors checkpoint.
    """
    folder = Path(model_dir)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        paths = [folder / name for name in files]
    else:
        paths = sorted(folder.glob("*.safetensors"))
    if not paths:
        raise FileNotFoundError(f"no safetensors checkpoint in {folder}")
    specs: dict[str, TensorSpec] = {}
    for path in paths:
        for name, entry in _safetensors_header(path).items():
            if name == "__metadata__":
                continue
            dtype = _SAFETENSORS_DTYPES.get(entry["dtype"])
            if dtype is None:
                raise ValueError(f"{path}: tensor {name!r} has dtype {entry['dtype']}, unsupported by torch")
            specs[name] = TensorSpec(shape=tuple(entry["shape"]), dtype=dtype)
    return specs


def resolve_model_dir(model: str, revision: str | None = None) -> Path:
    """The local folder of the model an engine serves: `model` itself when it is a folder, else the
    HF hub cache's snapshot of it (never downloads: the engine already fetched it at start)."""
    if os.path.isdir(model):
        return Path(model)
    from huggingface_hub import snapshot_download  # vLLM depends on it; only needed for hub ids

    return Path(snapshot_download(model, revision=revision, local_files_only=True))
