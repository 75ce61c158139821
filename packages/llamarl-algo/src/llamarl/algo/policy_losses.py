"""Policy losses: AIPO and the clipped-surrogate family, one small function each.

Shape legend:
    B: sequences in the batch, T: tokens per sequence.

Every loss has the same call signature (the `PolicyLoss` protocol in `llamarl.algo.registry`):

    loss_fn(logprobs_BT, behavior_logprobs_BT, advantages, mask_BT, *, num_valid_tokens, num_sequences,
            **hyper_parameters) -> (loss, metrics)

- `logprobs_BT`: log pi_theta of the sampled tokens, computed by the trainer, with gradient.
- `behavior_logprobs_BT`: log-probs of the same tokens under the policy the ratio is taken against:
  the generator's log-probs mu (AIPO), or the "old" policy of the clipped losses. No gradient.
- `advantages`: [B] (one per sequence, broadcast over its tokens) or [B, T].
- `mask_BT`: 1 on the tokens that count (response tokens), 0 elsewhere.
- `num_valid_tokens`, `num_sequences`: counts of the GLOBAL batch (all micro-batches, all data-parallel
  ranks). Each loss divides by the one it needs, so the losses of the micro-batches and of the ranks sum
  to exactly the full-batch loss. Sequence-normalised losses assume a sequence is never split between
  micro-batches.
- `metrics`: detached scalar tensors, local to the call (means over this micro-batch).

The losses are to be minimised. Importance weights and clip decisions never carry gradient except
through the ratio where the paper differentiates it (PPO, GRPO, DAPO, GSPO).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from llamarl.algo.masking import (
    LOG_RATIO_LIMIT,
    expand_to_tokens,
    masked_max,
    masked_mean,
    masked_sum,
    sequence_mean,
    token_sum_over,
)


def _log_ratio(logprobs_BT: Tensor, behavior_logprobs_BT: Tensor, mask_BT: Tensor) -> Tensor:
    """log(pi / mu) per token, clamped for finiteness, 0 on masked tokens (padding may hold garbage)."""
    log_ratio_BT = (logprobs_BT - behavior_logprobs_BT.detach()).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    return torch.where(mask_BT.bool(), log_ratio_BT, torch.zeros_like(log_ratio_BT))


def _token_advantages(advantages: Tensor, mask_BT: Tensor) -> Tensor:
    """Advantages as [B, T], detached, 0 on masked tokens: an inf or nan left on padding would otherwise
    turn the zero gradient of a masked token into nan (0 * inf)."""
    advantages_BT = expand_to_tokens(advantages.detach(), mask_BT)
    return torch.where(mask_BT.bool(), advantages_BT, torch.zeros_like(advantages_BT))


def _weighted_logprob_loss(
    weight: Tensor | None, advantages: Tensor, logprobs_BT: Tensor, mask_BT: Tensor, num_valid_tokens: int
) -> Tensor:
    """-sum_{valid t} w_t * A_t * log pi(y_t) / num_valid_tokens: the importance-weighted policy gradient
    of AIPO, CISPO and (with `weight` None, w = 1) plain REINFORCE. `weight` ([B, T] or [B, 1]) must
    carry no gradient; `advantages` is [B] or [B, T]."""
    advantages_BT = _token_advantages(advantages, mask_BT)
    weighted_BT = advantages_BT if weight is None else weight * advantages_BT
    return -token_sum_over(weighted_BT * logprobs_BT, mask_BT, num_valid_tokens)


def k3_mismatch_kl(logprobs_BT: Tensor, behavior_logprobs_BT: Tensor, mask_BT: Tensor) -> Tensor:
    """k3 estimate of KL(mu || pi) from tokens sampled by mu, averaged over the valid tokens (detached).

    With r = pi / mu: k3 = r - 1 - log r, which is >= 0 per token and unbiased under mu.
    """
    log_ratio_BT = _log_ratio(logprobs_BT.detach(), behavior_logprobs_BT, mask_BT)
    return masked_mean(torch.expm1(log_ratio_BT) - log_ratio_BT, mask_BT)


def _ratio_metrics(ratio_BT: Tensor, mask_BT: Tensor, truncated_BT: Tensor) -> dict[str, Tensor]:
    ratio_BT = ratio_BT.detach()
    return {
        "ratio_mean": masked_mean(ratio_BT, mask_BT),
        "ratio_max": masked_max(ratio_BT, mask_BT),
        "truncated_fraction": masked_mean(truncated_BT.to(ratio_BT.dtype), mask_BT),
    }


def aipo_loss(
    logprobs_BT: Tensor,
    behavior_logprobs_BT: Tensor,
    advantages: Tensor,
    mask_BT: Tensor,
    *,
    rho: float = 4.0,
    num_valid_tokens: int,
    num_sequences: int | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """AIPO (LlamaRL, 2025), token level: per token the gradient is  w_t * A * grad log pi(y_t)  with
    w_t = min(pi(y_t) / mu(y_t), rho), truncated from above only and detached.

    loss = -sum_{valid t} w_t * A_t * log pi(y_t) / num_valid_tokens

    Args:
        logprobs_BT: trainer log-probs, with gradient.
        behavior_logprobs_BT: generator (behaviour policy mu) log-probs of the same tokens.
        advantages: [B] or [B, T].
        mask_BT: valid tokens.
        rho: truncation threshold of the importance weight (the paper uses 2 to 10); inf disables it.
        num_valid_tokens: valid tokens in the global batch.
        num_sequences: unused (accepted for the uniform `PolicyLoss` signature).

    Returns:
        (loss, metrics) with metrics ratio_mean, ratio_max, truncated_fraction, mismatch_kl.
    """
    del num_sequences
    if rho <= 0:
        raise ValueError(f"rho must be positive, got {rho}")
    ratio_BT = _log_ratio(logprobs_BT.detach(), behavior_logprobs_BT, mask_BT).exp()
    weight_BT = ratio_BT.clamp(max=rho)
    loss = _weighted_logprob_loss(weight_BT, advantages, logprobs_BT, mask_BT, num_valid_tokens)
    metrics = _ratio_metrics(ratio_BT, mask_BT, ratio_BT > rho)
    metrics["mismatch_kl"] = k3_mismatch_kl(logprobs_BT, behavior_logprobs_BT, mask_BT)
    return loss, metrics


def aipo_sequence_loss(
    logprobs_BT: Tensor,
    behavior_logprobs_BT: Tensor,
    advantages: Tensor,
    mask_BT: Tensor,
    *,
    rho: float = 4.0,
    num_valid_tokens: int,
    num_sequences: int | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """AIPO with one importance weight per sequence: the product of the token ratios, truncated.

    w_i = min(prod_t pi(y_it) / mu(y_it), rho), detached;  loss = -sum_i w_i sum_t A_it log pi(y_it)
    / num_valid_tokens. The sequence ratio is the unbiased weight for a sequence-level reward but has
    a far larger spread than the token ratios, so expect a larger truncated fraction than token AIPO.

    Args:
        logprobs_BT, behavior_logprobs_BT, advantages ([B] or [B, T]), mask_BT: as in `aipo_loss`.
        rho: truncation threshold of the sequence weight; inf disables it.
        num_valid_tokens: valid tokens in the global batch.
        num_sequences: unused (uniform signature).

    Returns:
        (loss, metrics): ratio_mean, ratio_max, truncated_fraction (over sequences), mismatch_kl.
    """
    del num_sequences
    log_ratio_BT = _log_ratio(logprobs_BT.detach(), behavior_logprobs_BT, mask_BT)
    # Summed in log space and truncated there: the product itself overflows for long sequences.
    log_seq_ratio_B = log_ratio_BT.sum(-1)
    if rho <= 0:
        raise ValueError(f"rho must be positive, got {rho}")
    weight_B = log_seq_ratio_B.clamp(max=math.log(rho)).exp()
    loss = _weighted_logprob_loss(weight_B[:, None], advantages, logprobs_BT, mask_BT, num_valid_tokens)
    has_tokens_B = mask_BT.bool().any(-1)
    seq_ratio_B = log_seq_ratio_B.clamp(max=LOG_RATIO_LIMIT).exp()
    metrics = _ratio_metrics(seq_ratio_B, has_tokens_B, log_seq_ratio_B > math.log(rho))
    metrics["mismatch_kl"] = k3_mismatch_kl(logprobs_BT, behavior_logprobs_BT, mask_BT)
    return loss, metrics


def policy_gradient_loss(
    logprobs_BT: Tensor,
    behavior_logprobs_BT: Tensor,
    advantages: Tensor,
    mask_BT: Tensor,
    *,
    num_valid_tokens: int,
    num_sequences: int | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Plain on-policy policy gradient (REINFORCE with the advantage as baseline-corrected return).

    loss = -sum_{valid t} A_t log pi(y_t) / num_valid_tokens; the behaviour log-probs are ignored for the
    loss (no importance correction) and only reported through mismatch_kl.
    """
    del num_sequences
    loss = _weighted_logprob_loss(None, advantages, logprobs_BT, mask_BT, num_valid_tokens)
    return loss, {"mismatch_kl": k3_mismatch_kl(logprobs_BT, behavior_logprobs_BT, mask_BT)}


def _clipped_objective(
    ratio_BT: Tensor, advantages_BT: Tensor, clip_low: float, clip_high: float
) -> tuple[Tensor, Tensor]:
    """Per token min(r A, clip(r, 1 - clip_low, 1 + clip_high) A) and where the clipped branch is taken
    (there the token carries no gradient)."""
    unclipped_BT = ratio_BT * advantages_BT
    clipped_BT = ratio_BT.clamp(1.0 - clip_low, 1.0 + clip_high) * advantages_BT
    return torch.minimum(unclipped_BT, clipped_BT), clipped_BT < unclipped_BT


def _clip_metrics(
    ratio_BT: Tensor, mask_BT: Tensor, clipped_BT: Tensor, logprobs_BT: Tensor, old_logprobs_BT: Tensor
) -> dict[str, Tensor]:
    metrics = _ratio_metrics(ratio_BT, mask_BT, clipped_BT)
    metrics["clipped_fraction"] = metrics.pop("truncated_fraction")
    metrics["mismatch_kl"] = k3_mismatch_kl(logprobs_BT, old_logprobs_BT, mask_BT)
    return metrics


def _token_clipped_terms(
    logprobs_BT: Tensor,
    old_logprobs_BT: Tensor,
    advantages: Tensor,
    mask_BT: Tensor,
    clip_low: float,
    clip_high: float,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Token-level clipped surrogate per token (to be maximised) and its metrics."""
    ratio_BT = _log_ratio(logprobs_BT, old_logprobs_BT, mask_BT).exp()
    advantages_BT = _token_advantages(advantages, mask_BT)
    objective_BT, clipped_BT = _clipped_objective(ratio_BT, advantages_BT, clip_low, clip_high)
    return objective_BT, _clip_metrics(ratio_BT, mask_BT, clipped_BT, logprobs_BT, old_logprobs_BT)


def ppo_clip_loss(
    logprobs_BT: Tensor,
    behavior_logprobs_BT: Tensor,
    advantages: Tensor,
    mask_BT: Tensor,
    *,
    clip_eps: float = 0.2,
    num_valid_tokens: int,
    num_sequences: int | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO-clip (Schulman et al., 2017), symmetric clip, token-level mean.

    r_t = pi(y_t) / pi_old(y_t);  loss = -sum_{valid t} min(r_t A_t, clip(r_t, 1 - eps, 1 + eps) A_t)
    / num_valid_tokens. `behavior_logprobs_BT` are the old log-probs. Advantages are per sequence ([B])
    or per token ([B, T]). DAPO's loss with a symmetric clip range.
    """
    return dapo_loss(
        logprobs_BT,
        behavior_logprobs_BT,
        advantages,
        mask_BT,
        clip_low=clip_eps,
        clip_high=clip_eps,
        num_valid_tokens=num_valid_tokens,
        num_sequences=num_sequences,
    )


def grpo_loss(
    logprobs_BT: Tensor,
    behavior_logprobs_BT: Tensor,
    advantages: Tensor,
    mask_BT: Tensor,
    *,
    clip_eps: float = 0.2,
    num_valid_tokens: int | None = None,
    num_sequences: int,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GRPO (Shao et al., DeepSeekMath, 2024): the PPO-clip surrogate averaged over each sequence's
    tokens, then over the sequences.

    loss = -(1 / num_sequences) sum_i (1 / |y_i|) sum_t min(r_it A_i, clip(r_it, 1 - eps, 1 + eps) A_i)

    Pair it with the "group_mean_std" advantage. Its KL penalty against a reference policy is a separate
    term (`kl_penalty_loss` with the "k3" estimator), added by the trainer when it has a reference.
    """
    del num_valid_tokens
    objective_BT, metrics = _token_clipped_terms(
        logprobs_BT, behavior_logprobs_BT, advantages, mask_BT, clip_eps, clip_eps
    )
    return -sequence_mean(objective_BT, mask_BT).sum() / num_sequences, metrics


def dapo_loss(
    logprobs_BT: Tensor,
    behavior_logprobs_BT: Tensor,
    advantages: Tensor,
    mask_BT: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    num_valid_tokens: int,
    num_sequences: int | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """DAPO (Yu et al., 2025): decoupled clip range ("clip-higher") and a token-level mean.

    loss = -sum_{valid t} min(r_t A_t, clip(r_t, 1 - clip_low, 1 + clip_high) A_t) / num_valid_tokens

    DAPO's dynamic sampling (dropping groups whose rewards are all equal) and overlong reward shaping
    act on the data, not on the loss, and live with the caller.
    """
    del num_sequences
    objective_BT, metrics = _token_clipped_terms(
        logprobs_BT, behavior_logprobs_BT, advantages, mask_BT, clip_low, clip_high
    )
    return -token_sum_over(objective_BT, mask_BT, num_valid_tokens), metrics


def dr_grpo_loss(
    logprobs_BT: Tensor,
    behavior_logprobs_BT: Tensor,
    advantages: Tensor,
    mask_BT: Tensor,
    *,
    clip_eps: float = 0.2,
    max_response_length: int | None = None,
    num_valid_tokens: int | None = None,
    num_sequences: int,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Dr.GRPO (Liu et al., "Understanding R1-Zero-Like Training", 2025): GRPO without the per-sequence
    length normalisation (and, on the advantage side, without the std normalisation: use "group_mean").

    loss = -sum_i sum_t min(r_it A_i, clip(r_it, 1 - eps, 1 + eps) A_i) / (num_sequences * L)

    L is a constant: `max_response_length` (the generation budget, the paper's choice) when given.
    When None, L is the global batch's mean response length, num_valid_tokens / num_sequences: still
    one constant for every sequence of the step (no per-sequence length bias), robust to micro-batches
    trimmed to different padded lengths; the loss is then the token mean over the global batch.
    """
    objective_BT, metrics = _token_clipped_terms(
        logprobs_BT, behavior_logprobs_BT, advantages, mask_BT, clip_eps, clip_eps
    )
    if max_response_length is None:
        if num_valid_tokens is None:
            raise ValueError("dr_grpo needs max_response_length or num_valid_tokens")
        denominator = num_valid_tokens
    else:
        denominator = num_sequences * max_response_length
    return -masked_sum(objective_BT, mask_BT) / denominator, metrics


def gspo_loss(
    logprobs_BT: Tensor,
    behavior_logprobs_BT: Tensor,
    advantages: Tensor,
    mask_BT: Tensor,
    *,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    num_valid_tokens: int | None = None,
    num_sequences: int,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO (Zheng et al., "Group Sequence Policy Optimization", 2025): one length-normalised ratio per
    sequence, s_i = (prod_t pi(y_it) / pi_old(y_it))^(1 / |y_i|), clipped per sequence.

    loss = -(1 / num_sequences) sum_i min(s_i A_i, clip(s_i, 1 - clip_low, 1 + clip_high) A_i)

    Written in the paper's GSPO-token form, s_it = sg(s_i) * pi(y_it) / sg(pi(y_it)), averaged over each
    sequence's tokens: for [B] advantages it has exactly GSPO's value and gradient, and it also accepts
    [B, T] advantages (e.g. after a token-level importance correction). Default clip ranges are the
    paper's (ratios are sequence geometric means, hence so small).
    """
    del num_valid_tokens
    log_ratio_BT = _log_ratio(logprobs_BT, behavior_logprobs_BT, mask_BT)
    log_seq_ratio_B = sequence_mean(log_ratio_BT, mask_BT)
    # Value: s_i on every token; gradient: s_i * grad log pi(y_it) (the sg(...) pieces).
    token_log_ratio_BT = log_seq_ratio_B.detach()[:, None] + logprobs_BT - logprobs_BT.detach()
    token_log_ratio_BT = torch.where(mask_BT.bool(), token_log_ratio_BT, torch.zeros_like(token_log_ratio_BT))
    ratio_BT = token_log_ratio_BT.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT).exp()
    advantages_BT = _token_advantages(advantages, mask_BT)
    objective_BT, clipped_BT = _clipped_objective(ratio_BT, advantages_BT, clip_low, clip_high)
    loss = -sequence_mean(objective_BT, mask_BT).sum() / num_sequences
    has_tokens_B = mask_BT.bool().any(-1)
    seq_ratio_B = log_seq_ratio_B.detach().exp()
    metrics = {
        "ratio_mean": masked_mean(seq_ratio_B, has_tokens_B),
        "ratio_max": masked_max(seq_ratio_B, has_tokens_B),
        "clipped_fraction": masked_mean(clipped_BT.to(seq_ratio_B.dtype), mask_BT),
        "mismatch_kl": k3_mismatch_kl(logprobs_BT, behavior_logprobs_BT, mask_BT),
    }
    return loss, metrics


def cispo_loss(
    logprobs_BT: Tensor,
    behavior_logprobs_BT: Tensor,
    advantages: Tensor,
    mask_BT: Tensor,
    *,
    clip_low: float = 1.0,
    clip_high: float = 0.28,
    num_valid_tokens: int,
    num_sequences: int | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO (MiniMax-M1, 2025): clip the importance weight, detach it, and keep every token's gradient.

    loss = -sum_{valid t} sg(clip(r_t, 1 - clip_low, 1 + clip_high)) A_t log pi(y_t) / num_valid_tokens

    The paper sets no lower bound and tunes only the upper one: clip_low = 1 (a lower bound of 0) is
    that. AIPO is the same estimator with only the upper bound, rho = 1 + clip_high.
    """
    del num_sequences
    ratio_BT = _log_ratio(logprobs_BT.detach(), behavior_logprobs_BT, mask_BT).exp()
    weight_BT = ratio_BT.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = _weighted_logprob_loss(weight_BT, advantages, logprobs_BT, mask_BT, num_valid_tokens)
    return loss, _clip_metrics(ratio_BT, mask_BT, weight_BT != ratio_BT, logprobs_BT, behavior_logprobs_BT)
