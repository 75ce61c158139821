"""Critic loss for PPO with GAE.

Shape legend:
    B: sequences in the batch, T: tokens per sequence.
"""

from __future__ import annotations

import torch
from torch import Tensor

from llamarl.algo.masking import masked_mean, token_sum_over


def clipped_value_loss(
    values_BT: Tensor,
    old_values_BT: Tensor,
    returns_BT: Tensor,
    mask_BT: Tensor,
    *,
    clip_eps: float = 0.2,
    num_valid_tokens: int,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO's clipped value loss: the new value may not move more than `clip_eps` from the value it had
    when the rollout was scored, unless that makes the loss smaller.

        V_clip = V_old + clip(V - V_old, -eps, eps)
        loss = sum_{valid t} 0.5 max((V - R)^2, (V_clip - R)^2) / num_valid_tokens

    Args:
        values_BT: the critic's current values, with gradient.
        old_values_BT: the values used to compute the advantages (detached).
        returns_BT: regression targets from `gae_advantages`.
        mask_BT: valid tokens.
        clip_eps: clip range in value units; inf disables clipping.
        num_valid_tokens: valid tokens in the global batch.

    Returns:
        (loss, metrics): value_clipped_fraction, value_mean, value_error (mean squared error).
    """
    # Masked positions are replaced before any arithmetic: garbage there (inf, nan) would otherwise
    # reach the gradient as 0 * inf = nan.
    valid_BT = mask_BT.bool()
    values_BT = torch.where(valid_BT, values_BT, torch.zeros_like(values_BT))
    old_values_BT = torch.where(valid_BT, old_values_BT.detach(), torch.zeros_like(values_BT))
    returns_BT = torch.where(valid_BT, returns_BT.detach(), torch.zeros_like(values_BT))
    clipped_values_BT = old_values_BT + (values_BT - old_values_BT).clamp(-clip_eps, clip_eps)
    error_BT = (values_BT - returns_BT).square()
    clipped_error_BT = (clipped_values_BT - returns_BT).square()
    loss = token_sum_over(0.5 * torch.maximum(error_BT, clipped_error_BT), mask_BT, num_valid_tokens)
    metrics = {
        "value_clipped_fraction": masked_mean((clipped_error_BT > error_BT).to(error_BT.dtype), mask_BT),
        "value_mean": masked_mean(values_BT.detach(), mask_BT),
        "value_error": masked_mean(error_BT.detach(), mask_BT),
    }
    return loss, metrics
