"""Learning-rate schedules: a linear warmup, then constant, linear or cosine decay to zero."""

from __future__ import annotations

import math

LR_SCHEDULES = ("constant", "linear", "cosine")


def lr_factor(step: int, *, schedule: str, warmup_steps: int, total_steps: int) -> float:
    """The multiplier of the base learning rate for optimizer step `step` (0-based).

    Warmup ramps linearly over `warmup_steps` steps: step 0 uses 1 / (warmup_steps + 1) of the rate, so
    the first update is already non-zero. After it, "constant" stays at 1, "linear" and "cosine" decay
    from 1 at the end of warmup to 0 at `total_steps` (and stay at 0 after it).
    """
    if schedule not in LR_SCHEDULES:
        raise ValueError(f"unknown lr schedule {schedule!r}; known: {', '.join(LR_SCHEDULES)}")
    if warmup_steps < 0 or total_steps < 1:
        raise ValueError(f"need warmup_steps >= 0 and total_steps >= 1, got {warmup_steps}, {total_steps}")
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    if schedule == "constant":
        return 1.0
    decay_steps = max(total_steps - warmup_steps, 1)
    progress = min((step - warmup_steps) / decay_steps, 1.0)
    if schedule == "linear":
        return 1.0 - progress
    return 0.5 * (1.0 + math.cos(math.pi * progress))
