"""The trainer's refusal of a non-finite update: a step whose advantages, loss or gradient hold a NaN or
an inf is not applied.

Whatever its cause (a reward function that returned NaN, a behaviour log-prob of -inf, an overflow in
backward), one such update taken by AdamW makes every weight NaN for good (its moments keep the NaN).
So the trainer checks, in this order, the advantages, the loss and the global gradient norm, and skips
the optimizer update of a step where one of them is not finite (`PolicyTrainer.train_step`).

Under FSDP2 the decision must be the same on every trainer rank (one rank stepping while another does
not would leave shards of different versions), so it reads only values reduced over the ranks: counts
of non-finite advantages and losses that ride on the step's metric all-reduce (`Finiteness`), and the
global gradient norm. The description it gives names the first offending tensor on this rank.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Finiteness:
    """Whether a step's advantages and loss are finite, on this rank and on every trainer rank."""

    advantages_here: bool
    advantages_everywhere: bool
    loss_here: bool
    loss_everywhere: bool


def nonfinite_cause(
    finiteness: Finiteness, grad_norm: float, named_parameters: Iterable[tuple[str, torch.nn.Parameter]]
) -> str | None:
    """None when the step may be applied; else a short description of its first non-finite tensor on
    this rank: "advantages", "loss", "grad of <parameter name>", or, when this rank's own are finite,
    "advantages on another trainer rank", "loss on another trainer rank" or "grad norm (...)".

    `grad_norm` is the global gradient norm before clipping (the same on every rank): it is not finite
    when any gradient element is not, on any rank. `named_parameters` are the trained module's, whose
    `.grad` (this rank's shard under FSDP2) is searched only when the norm is not finite.
    """
    if not finiteness.advantages_everywhere:
        return "advantages" if not finiteness.advantages_here else "advantages on another trainer rank"
    if not finiteness.loss_everywhere:
        return "loss" if not finiteness.loss_here else "loss on another trainer rank"
    if math.isfinite(grad_norm):
        return None
    name = first_nonfinite_grad(named_parameters)
    if name is None:  # another rank's shard, or finite gradients whose norm overflowed
        return "grad norm (every gradient element on this rank is finite)"
    return f"grad of {name}"


def first_nonfinite_grad(named_parameters: Iterable[tuple[str, torch.nn.Parameter]]) -> str | None:
    """The name of the first parameter whose gradient holds a NaN or an inf on this rank, or None.

    Reads an FSDP2 DTensor gradient's local shard only: a rank-local answer, no collective.
    """
    for name, param in named_parameters:
        grad = param.grad
        if grad is None:
            continue
        local = grad.to_local() if hasattr(grad, "to_local") else grad
        if not bool(torch.isfinite(local).all()):
            return name
    return None
