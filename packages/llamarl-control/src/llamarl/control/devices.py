"""Which device each rank computes on, and in which precision."""

from __future__ import annotations

import os

import torch


def rank_device(name: str) -> torch.device:
    """This rank's device for `ranks.device` ("auto": CUDA when present): on CUDA, the GPU of its local
    rank."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    return torch.device("cpu")


def bf16_is_fast(device: torch.device) -> bool:
    """Whether `device` computes bf16 matrix products natively: CUDA GPUs with bf16 (Ampere and later),
    CPUs with AVX512-BF16 or AMX (there a bf16 product of a trainer's shapes ran 2.4x the float32 one);
    elsewhere bf16 is emulated, slower than float32."""
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        # Private probes of torch.cpu (present since torch 2.3); a torch without them reports no support.
        probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
        return any(getattr(torch.cpu, probe, lambda: False)() for probe in probes)
    return False


def resolve_precision(precision: str, device: torch.device) -> str:
    """A `precision` setting ("auto", "bf16", "fp32") as a dtype name for `device`: auto is bfloat16 where
    `bf16_is_fast`, else float32."""
    if precision == "auto":
        return "bfloat16" if bf16_is_fast(device) else "float32"
    return {"bf16": "bfloat16", "fp32": "float32"}[precision]


def generation_dtype(precision: str, device: torch.device) -> str:
    """The generators' weights and compute (`generator.precision` resolved for their device)."""
    return resolve_precision(precision, device)


def trainer_compute_dtype(precision: str, device: torch.device) -> str | None:
    """The trainer's forward and backward dtype (`trainer.precision` resolved); None for float32. The
    parameters, gradients and AdamW state stay float32 (master weights) either way."""
    dtype = resolve_precision(precision, device)
    return None if dtype == "float32" else dtype


def weight_wire_dtype(generation: str) -> torch.dtype | None:
    """The dtype weights travel in: bf16 to bf16 generators (cast from the float32 master weights on the
    trainer: half the bytes), else as the trainer holds them."""
    return torch.bfloat16 if generation == "bfloat16" else None
