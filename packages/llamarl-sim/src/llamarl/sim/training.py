"""Training time from FLOPs at a stated utilisation.

A training step runs forward and backward over every token of the batch, prompts included: 3 forward
passes' worth of FLOPs (6 x params per token plus attention). The stated MFU covers the rest: the
optimizer step, FSDP's gathers, recomputation and imperfect overlap. A trainer that recomputes the
behaviour log-probs before its update (PPO's "old log-probs", verl's synchronous mode) runs one more
forward pass. A MoE model multiplies each token by its chosen experts only, and pays the expert
all-to-all on top (`llamarl.sim.moe`).
"""

from __future__ import annotations

from collections.abc import Sequence

from llamarl.sim import moe
from llamarl.sim.hardware import Efficiency, GpuSpec
from llamarl.sim.models import ModelSpec

TRAIN_FORWARD_PASSES = 3  # forward + backward (twice the forward)


def train_flops(
    model: ModelSpec,
    prompt_tokens: int,
    output_lengths: Sequence[int],
    forward_passes: float = TRAIN_FORWARD_PASSES,
) -> float:
    """FLOPs of one optimizer step over these sequences (forward and backward).

    A sequence of t tokens costs 3 forward passes of t tokens attending to t / 2 on average:
    3 t (2 M + 2 c t) with M the matmul parameters a token meets and c = 2 x layers x heads x head_dim
    (4 passes when the old log-probs are recomputed first).
    """
    tokens = [prompt_tokens + length for length in output_lengths]
    c = 2 * model.layers * model.heads * model.head_dim
    return forward_passes * (2 * model.active_matmul_params * sum(tokens) + c * sum(t * t for t in tokens))


def train_s(
    model: ModelSpec,
    prompt_tokens: int,
    output_lengths: Sequence[int],
    *,
    gpus: int,
    gpu: GpuSpec,
    eff: Efficiency,
    recompute_logprobs: bool = False,
) -> float:
    """Seconds of one optimizer step on `gpus` devices in bf16 at `eff.train_mfu` (one more forward
    pass when `recompute_logprobs`), plus a MoE model's expert all-to-alls."""
    passes = TRAIN_FORWARD_PASSES + (1 if recompute_logprobs else 0)
    flops = train_flops(model, prompt_tokens, output_lengths, passes)
    tokens = sum(prompt_tokens + length for length in output_lengths)
    exchange = moe.train_all_to_all_s(model, tokens, gpus, gpu, eff) * passes / TRAIN_FORWARD_PASSES
    return flops / (gpus * gpu.peak_flops("bf16") * eff.train_mfu) + exchange
