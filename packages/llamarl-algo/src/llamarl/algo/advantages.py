"""Advantage estimators.

Shape legend:
    B: sequences in the batch (num_prompts * group_size), G: group size,
    P: prompts (B // G).

The samples of one prompt are contiguous in the batch: sequences [0, G) answer prompt 0, and so on.
Every estimator here has the signature `(rewards_B, group_size) -> advantages_B` (extra
hyper-parameters keyword-only, with defaults) so that the registry can bind them by name.
"""

from __future__ import annotations

import torch
from torch import Tensor

from llamarl.algo.masking import group_view

DEFAULT_EPS = 1e-6


def group_advantages(
    rewards_B: Tensor, group_size: int, *, normalize_std: bool = False, eps: float = DEFAULT_EPS
) -> Tensor:
    """Reward minus the mean reward of its prompt's group, optionally divided by the group's std.

    Args:
        rewards_B: one scalar reward per sequence.
        group_size: samples per prompt (contiguous).
        normalize_std: divide by the group's standard deviation + `eps` (GRPO); False is the
            group-mean baseline of AIPO and Dr.GRPO.
        eps: keeps a group whose samples all got the same reward at advantage 0 instead of nan.

    Returns:
        advantages_B, float32 (float64 for float64 rewards).
    """
    rewards_PG = group_view(rewards_B.to(torch.promote_types(rewards_B.dtype, torch.float32)), group_size)
    mean_P1 = rewards_PG.mean(-1, keepdim=True)
    # One correction pass: the plain mean of G equal rewards can round a unit in the last place away
    # from them (8 x 0.1 in float32), and the std normalisation below (std ~ 1 ulp, eps 1e-6) would
    # turn that into advantages of order 1 for a group that carries no signal. The residuals r - mean
    # of such a group are exact and equal, so mean + their mean is exactly r and the advantages are 0.
    mean_P1 = mean_P1 + (rewards_PG - mean_P1).mean(-1, keepdim=True)
    advantages_PG = rewards_PG - mean_P1
    if normalize_std:
        # The population std (correction=0) is defined for a group of one sample as well.
        advantages_PG = advantages_PG / (rewards_PG.std(-1, correction=0, keepdim=True) + eps)
    return advantages_PG.reshape(-1)


def group_mean_advantages(rewards_B: Tensor, group_size: int) -> Tensor:
    """A_i = r_i - mean_{j in group(i)} r_j (AIPO's baseline, Dr.GRPO). [B] -> [B]."""
    return group_advantages(rewards_B, group_size)


def group_mean_std_advantages(rewards_B: Tensor, group_size: int, *, eps: float = DEFAULT_EPS) -> Tensor:
    """A_i = (r_i - mean_group) / (std_group + eps) (GRPO). [B] -> [B]."""
    return group_advantages(rewards_B, group_size, normalize_std=True, eps=eps)


def rloo_advantages(rewards_B: Tensor, group_size: int) -> Tensor:
    """RLOO (Ahmadian et al., 2024; Kool et al., 2019): the baseline of a sample is the mean reward of
    the OTHER samples of its prompt, A_i = r_i - mean_{j != i} r_j = G / (G - 1) (r_i - mean_group).
    [B] -> [B]; needs group_size >= 2."""
    if group_size < 2:
        raise ValueError(f"RLOO needs at least 2 samples per prompt, got group_size={group_size}")
    return group_advantages(rewards_B, group_size) * (group_size / (group_size - 1))


def reinforce_pp_baseline_advantages(
    rewards_B: Tensor, group_size: int, *, eps: float = DEFAULT_EPS
) -> Tensor:
    """REINFORCE++-baseline (Hu et al., "REINFORCE++", 2025): subtract the group mean, then normalise by
    the mean and std of the whole batch (not of each group), which is more robust for small groups.
    [B] -> [B]. "The batch" is the tensor passed in: call it on the global batch's rewards."""
    centered_B = group_advantages(rewards_B, group_size)
    # The batch mean of group-centred advantages is 0 by construction (each group's sum is 0), so it is
    # not subtracted: that would only add its rounding error to the groups whose advantages are exactly 0.
    return centered_B / (centered_B.std(correction=0) + eps)
