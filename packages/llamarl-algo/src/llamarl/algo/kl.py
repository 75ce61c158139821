"""KL estimators against a reference policy, from log-probs of tokens sampled by the policy.

Shape legend:
    B: sequences in the batch, T: tokens per sequence.

With tokens y ~ pi and log r = log pi_ref(y) - log pi(y) (Schulman, "Approximating KL divergence",
2020), each estimator's expectation under pi relates to KL(pi || pi_ref):

    k1 = -log r                unbiased, high variance, can be negative
    k2 = (log r)^2 / 2         biased (exact to second order), low variance, >= 0
    k3 = r - 1 - log r         unbiased, low variance, >= 0 (GRPO's KL penalty)
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from llamarl.algo.masking import LOG_RATIO_LIMIT, masked_mean, token_sum_over


def _log_ratio(logprobs_BT: Tensor, ref_logprobs_BT: Tensor) -> Tensor:
    return (ref_logprobs_BT.detach() - logprobs_BT).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)


def kl_k1(logprobs_BT: Tensor, ref_logprobs_BT: Tensor) -> Tensor:
    """k1 = log pi - log pi_ref per token. [B, T] -> [B, T], differentiable in `logprobs_BT`."""
    return -_log_ratio(logprobs_BT, ref_logprobs_BT)


def kl_k2(logprobs_BT: Tensor, ref_logprobs_BT: Tensor) -> Tensor:
    """k2 = (log pi - log pi_ref)^2 / 2 per token. [B, T] -> [B, T]."""
    return 0.5 * _log_ratio(logprobs_BT, ref_logprobs_BT).square()


def kl_k3(logprobs_BT: Tensor, ref_logprobs_BT: Tensor) -> Tensor:
    """k3 = pi_ref / pi - 1 - log(pi_ref / pi) per token. [B, T] -> [B, T]."""
    log_ratio_BT = _log_ratio(logprobs_BT, ref_logprobs_BT)
    return torch.expm1(log_ratio_BT) - log_ratio_BT


KL_ESTIMATORS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}
"""Estimator name -> per-token function."""


def kl_penalty_loss(
    logprobs_BT: Tensor,
    ref_logprobs_BT: Tensor,
    mask_BT: Tensor,
    *,
    estimator: str = "k3",
    coef: float = 1.0,
    num_valid_tokens: int,
) -> tuple[Tensor, dict[str, Tensor]]:
    """coef * sum_{valid t} k(t) / num_valid_tokens: a KL penalty to add to a policy loss.

    Args:
        logprobs_BT: the policy's log-probs, with gradient.
        ref_logprobs_BT: the reference policy's log-probs of the same tokens.
        mask_BT: valid tokens.
        estimator: "k1", "k2" or "k3".
        coef: the penalty's weight (GRPO's beta).
        num_valid_tokens: valid tokens in the global batch.

    Returns:
        (loss, metrics) with metrics `kl_<estimator>` (the unweighted mean over this call's tokens).
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {estimator!r}; valid names: {', '.join(KL_ESTIMATORS)}")
    # Masked positions are replaced before any arithmetic: garbage there (inf, nan) would otherwise
    # reach the gradient as 0 * inf = nan.
    valid_BT = mask_BT.bool()
    logprobs_BT = torch.where(valid_BT, logprobs_BT, torch.zeros_like(logprobs_BT))
    ref_logprobs_BT = torch.where(valid_BT, ref_logprobs_BT, torch.zeros_like(logprobs_BT))
    kl_BT = KL_ESTIMATORS[estimator](logprobs_BT, ref_logprobs_BT)
    loss = coef * token_sum_over(kl_BT, mask_BT, num_valid_tokens)
    return loss, {f"kl_{estimator}": masked_mean(kl_BT.detach(), mask_BT)}
