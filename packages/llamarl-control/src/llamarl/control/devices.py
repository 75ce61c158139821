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


def generation_dtype(device: torch.device) -> str:
    """The generators' weights and compute: bf16 where the hardware runs it fast; fp32 on the CPU, where
    bf16 matmuls are slow on most parts."""
    return "bfloat16" if device.type == "cuda" else "float32"


def trainer_compute_dtype(device: torch.device) -> str | None:
    """The trainer's compute dtype under FSDP2 mixed precision (fp32 master weights and optimizer state):
    bf16 on CUDA; None (fp32 throughout) on the CPU."""
    return "bfloat16" if device.type == "cuda" else None


def weight_wire_dtype(device: torch.device) -> torch.dtype | None:
    """The dtype weights travel in: the generators' (bf16 on CUDA, from fp32 master weights), else as held."""
    return torch.bfloat16 if generation_dtype(device) == "bfloat16" else None
