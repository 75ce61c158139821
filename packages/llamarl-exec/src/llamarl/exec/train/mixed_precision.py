"""bf16 mixed precision for a trainer on one rank without FSDP2: a bf16 compute copy of float32 master
weights.

With a trainer group, FSDP2's `MixedPrecisionPolicy(param_dtype=bf16)` does this
(`llamarl.exec.train.parallel`).
On one rank without FSDP2 (the CPU default), `ComputeCopy` does the same thing by hand, as apex's O2
did: the optimizer holds the float32 master parameters (and so float32 AdamW state), forward and backward
run on a copy of the module cast to bf16 (every matrix product, activation and attention in bf16, as
under FSDP2), and each parameter's bf16 gradient is added into the master's float32 `.grad` as soon as
backward has produced it. Micro-batches therefore accumulate in float32, and the bf16 gradients of the
whole model never exist at once.

Measured here (SmolLM2-135M, 1024 tokens, forward + backward, 2 threads, CPU seconds on a loaded
machine): the bf16 copy 16-21 s, `torch.autocast("cpu", bf16)` on the float32 module 21-24 s (it casts
every weight per use and keeps norms and residuals in float32), FSDP2 on a one-rank gloo group 22-26 s,
float32 about 2x the bf16 copy.
"""

from __future__ import annotations

import copy

import torch


class ComputeCopy:
    """The module that computes, in `dtype`, for a float32 `master` module that the optimizer updates.

    Call `refresh()` after the master's weights changed (an optimizer step, a checkpoint load) and before
    the next forward pass: it copies them, rounded, into the compute copy.

    Attributes:
        module: the compute copy (same structure and names as `master`, parameters in `dtype`).
    """

    def __init__(self, master: torch.nn.Module, dtype: torch.dtype) -> None:
        self.master = master
        self.module = copy.deepcopy(master).to(dtype)
        pairs = list(zip(master.parameters(), self.module.parameters(), strict=True))
        # Trained parameters only: frozen ones (LoRA's base weights) never change after the copy.
        self._pairs = [(m, c) for m, c in pairs if m.requires_grad]
        # So the master need not keep a float32 copy of a frozen weight: it shares the compute copy's
        # (the one forward uses anyway). With LoRA that is the whole base model: 0.54 -> 0 GB of float32
        # for SmolLM2-135M, 32 -> 0 GB for an 8B model.
        for m, c in pairs:
            if not m.requires_grad:
                m.data = c.data
        for m, c in self._pairs:
            c.register_post_accumulate_grad_hook(_accumulate_into(m))

    @torch.no_grad()
    def refresh(self) -> None:
        """Copies the master's trained weights into the compute copy (rounded to its dtype)."""
        for m, c in self._pairs:
            c.copy_(m)


def _accumulate_into(master: torch.nn.Parameter):
    """A hook adding the compute parameter's gradient to `master.grad` in float32, then freeing it."""

    def hook(compute: torch.Tensor) -> None:
        if master.grad is None:
            master.grad = compute.grad.to(master.dtype)
        else:
            master.grad.add_(compute.grad)
        compute.grad = None

    return hook
