"""Masked reductions at token, sequence and group level.

Shape legend:
    B: sequences in the batch (B = num_prompts * group_size when grouped), T: tokens per sequence,
    G: group size (samples per prompt), P: prompts (B // G).

`mask_BT` is 1 (or True) on tokens that count (the response tokens) and 0 on prompt and padding tokens.
Masked positions are zeroed with `torch.where`, not multiplied, so that a nan or inf sitting on a padded
position never leaks into a sum.
"""

from __future__ import annotations

import torch
from torch import Tensor

LOG_RATIO_LIMIT = 20.0
"""|log ratio| is clamped to this before exp: exp(20) ~ 5e8 keeps the ratio finite in float32 even for
log-probs of -1e4. A token that far off-policy is truncated or clipped anyway; where a clipped loss would
still differentiate its ratio (PPO with A < 0), the clamp stops that gradient, which is the safe side."""


def masked_sum(values: Tensor, mask: Tensor, dim: int | tuple[int, ...] | None = None) -> Tensor:
    """Sum of `values` where `mask` is set (shapes broadcast); over all elements when `dim` is None."""
    zeroed = torch.where(mask.bool(), values, torch.zeros((), dtype=values.dtype, device=values.device))
    return zeroed.sum() if dim is None else zeroed.sum(dim)


def masked_mean(values: Tensor, mask: Tensor, dim: int | tuple[int, ...] | None = None) -> Tensor:
    """Mean of `values` where `mask` is set; 0 where nothing is set (instead of nan).

    Use it for metrics and for per-micro-batch statistics. Losses instead divide by the global batch's
    counts passed in by the caller (see `token_sum_over`), so that micro-batches add up exactly.
    """
    count = mask.to(values.dtype).expand_as(values)
    count = count.sum() if dim is None else count.sum(dim)
    return masked_sum(values, mask, dim) / count.clamp(min=1)


def masked_max(values: Tensor, mask: Tensor) -> Tensor:
    """Maximum of `values` where `mask` is set; -inf if nothing is set."""
    return torch.where(
        mask.bool(), values, torch.full((), -torch.inf, dtype=values.dtype, device=values.device)
    ).max()


def token_sum_over(values_BT: Tensor, mask_BT: Tensor, denominator: int | float) -> Tensor:
    """Token-level mean with an external denominator: sum over valid tokens / `denominator`.

    With `denominator` = number of valid tokens in the global batch, the results of micro-batches and
    data-parallel ranks sum to the full-batch token mean.
    """
    if denominator <= 0:
        raise ValueError(f"the denominator must be positive, got {denominator}")
    return masked_sum(values_BT, mask_BT) / denominator


def sequence_mean(values_BT: Tensor, mask_BT: Tensor) -> Tensor:
    """Per-sequence mean over the valid tokens: [B, T] -> [B] (0 for a sequence with no valid token)."""
    return masked_mean(values_BT, mask_BT, dim=-1)


def group_view(values_B: Tensor, group_size: int) -> Tensor:
    """[B] -> [P, G]: the samples of one prompt are contiguous in the batch."""
    if group_size <= 0 or values_B.shape[0] % group_size != 0:
        raise ValueError(f"batch of {values_B.shape[0]} is not a whole number of groups of {group_size}")
    return values_B.reshape(-1, group_size)


def group_mean(values_B: Tensor, group_size: int) -> Tensor:
    """Mean over each prompt's group, broadcast back to its samples: [B] -> [B]."""
    values_PG = group_view(values_B, group_size)
    return values_PG.mean(-1, keepdim=True).expand_as(values_PG).reshape(-1)


def expand_to_tokens(values: Tensor, like_BT: Tensor) -> Tensor:
    """Per-sequence values [B] broadcast to [B, T]; token values [B, T] pass through unchanged."""
    if values.dim() == 1:
        values = values[:, None]
    if values.shape[0] != like_BT.shape[0] or values.shape[-1] not in (1, like_BT.shape[-1]):
        raise ValueError(f"values of shape {tuple(values.shape)} do not match tokens {tuple(like_BT.shape)}")
    return values.expand_as(like_BT)
