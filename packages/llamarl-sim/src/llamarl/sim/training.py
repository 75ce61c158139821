"""Training time from FLOPs at a stated utilisation.

A training step runs forward and backward over every token of the batch, prompts included: 3 forward
passes' worth of FLOPs (6 x params per token plus attention). The stated MFU covers the rest: the
optimizer step, FSDP's gathers, recomputation and imperfect overlap.
"""

from __future__ import annotations

from collections.abc import Sequence

from llamarl.sim.hardware import Efficiency, GpuSpec
from llamarl.sim.models import ModelSpec


def train_flops(model: ModelSpec, prompt_tokens: int, output_lengths: Sequence[int]) -> float:
    """FLOPs of one optimizer step over these sequences (forward and backward).

    A sequence of t tokens costs 3 forward passes of t tokens attending to t / 2 on average:
    3 t (2 M + 2 c t) with M the matmul parameters and c = 2 x layers x heads x head_dim.
    """
    tokens = [prompt_tokens + length for length in output_lengths]
    c = 2 * model.layers * model.heads * model.head_dim
    return 3 * (2 * model.matmul_params * sum(tokens) + c * sum(t * t for t in tokens))


def train_s(
    model: ModelSpec,
    prompt_tokens: int,
    output_lengths: Sequence[int],
    *,
    gpus: int,
    gpu: GpuSpec,
    eff: Efficiency,
) -> float:
    """Seconds of one optimizer step on `gpus` devices in bf16 at `eff.train_mfu`."""
    return train_flops(model, prompt_tokens, output_lengths) / (gpus * gpu.peak_flops("bf16") * eff.train_mfu)
