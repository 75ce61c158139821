"""Importance correction for the mismatch between the generator's and the trainer's log-probs.

Shape legend:
    B: sequences in the batch, T: tokens per sequence.

The generator (e.g. vLLM, fp8, its own kernels) and the trainer (bf16 FSDP) give the same weights
different log-probs for the same tokens, and in async mode the generator may also run an older
`policy_version`. Call mu the generator's log-probs (`behavior_logprobs_BT`) and pi_old the trainer's
log-probs of the policy the loss treats as "old". The correction multiplies each token's (or each
sequence's) contribution by an importance weight w ~ pi_old / mu, truncated or masked:

    token_truncate     w_t = min(r_t, cap)                  r_t = pi_old(y_t) / mu(y_t)
    token_mask         w_t = r_t * 1[r_t <= cap]            (tokens whose ratio is too large are dropped)
    sequence_truncate  w_i = min(prod_t r_it, cap)
    sequence_mask      w_i = prod_t r_it * 1[prod_t r_it <= cap]

How it composes with any loss: every registered loss is positively homogeneous in the advantage (each
token's term is A times something that depends on A only through its sign), so weighting a token by
w >= 0 is exactly multiplying its advantage by w. The wrapper below does that, then calls the loss with
pi_old as its "old" log-probs. Weights are detached.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from llamarl.algo.masking import LOG_RATIO_LIMIT, expand_to_tokens, masked_max, masked_mean


def _token_log_ratio(
    trainer_old_logprobs_BT: Tensor, behavior_logprobs_BT: Tensor, mask_BT: Tensor
) -> Tensor:
    log_ratio_BT = (
        (trainer_old_logprobs_BT - behavior_logprobs_BT).detach().clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    )
    return torch.where(mask_BT.bool(), log_ratio_BT, torch.zeros_like(log_ratio_BT))


def token_truncate_weights(log_ratio_BT: Tensor, cap: float) -> tuple[Tensor, Tensor]:
    """w_t = min(r_t, cap) from log r_t: returns (weights_BT, corrected_BT: where truncation acted)."""
    ratio_BT = log_ratio_BT.exp()
    return ratio_BT.clamp(max=cap), ratio_BT > cap


def token_mask_weights(log_ratio_BT: Tensor, cap: float) -> tuple[Tensor, Tensor]:
    """w_t = r_t if r_t <= cap else 0: returns (weights_BT, corrected_BT: the masked tokens)."""
    ratio_BT = log_ratio_BT.exp()
    masked_BT = ratio_BT > cap
    return torch.where(masked_BT, torch.zeros_like(ratio_BT), ratio_BT), masked_BT


def _sequence_log_ratio(log_ratio_BT: Tensor) -> Tensor:
    # Clamped in log space: the product of a long sequence's ratios overflows otherwise.
    return log_ratio_BT.sum(-1).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)


def sequence_truncate_weights(log_ratio_BT: Tensor, cap: float) -> tuple[Tensor, Tensor]:
    """w_i = min(prod_t r_it, cap): returns (weights_B, corrected_B)."""
    return token_truncate_weights(_sequence_log_ratio(log_ratio_BT), cap)


def sequence_mask_weights(log_ratio_BT: Tensor, cap: float) -> tuple[Tensor, Tensor]:
    """w_i = prod_t r_it if it is <= cap else 0: returns (weights_B, corrected_B)."""
    return token_mask_weights(_sequence_log_ratio(log_ratio_BT), cap)


# mode -> (weight function, whether the weights are per sequence)
_MISMATCH_MODES: dict[str, tuple[Callable[[Tensor, float], tuple[Tensor, Tensor]], bool]] = {
    "token_truncate": (token_truncate_weights, False),
    "token_mask": (token_mask_weights, False),
    "sequence_truncate": (sequence_truncate_weights, True),
    "sequence_mask": (sequence_mask_weights, True),
}
MISMATCH_MODES: tuple[str, ...] = tuple(_MISMATCH_MODES)
"""Accepted values of `mode` (and of `get_policy_loss(..., mismatch_is=...)`)."""


def mismatch_weights(
    trainer_old_logprobs_BT: Tensor,
    behavior_logprobs_BT: Tensor,
    mask_BT: Tensor,
    *,
    mode: str = "token_truncate",
    cap: float = 2.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Detached importance weights pi_old / mu, truncated or masked at `cap`.

    Args:
        trainer_old_logprobs_BT: the trainer's log-probs of the sampled tokens (pi_old).
        behavior_logprobs_BT: the generator's log-probs of the same tokens (mu).
        mask_BT: valid tokens.
        mode: one of `MISMATCH_MODES`.
        cap: the truncation / masking threshold (> 0).

    Returns:
        (weights, metrics): weights_BT for token modes, weights_B for sequence modes; metrics
        mismatch_kl (k3 estimate of KL(mu || pi_old) over valid tokens), mismatch_weight_mean,
        mismatch_weight_max, mismatch_corrected_fraction (tokens or sequences truncated / masked).
    """
    if mode not in _MISMATCH_MODES:
        raise ValueError(f"unknown mismatch correction {mode!r}; valid names: {', '.join(_MISMATCH_MODES)}")
    if cap <= 0:
        raise ValueError(f"cap must be positive, got {cap}")
    weight_fn, per_sequence = _MISMATCH_MODES[mode]
    log_ratio_BT = _token_log_ratio(trainer_old_logprobs_BT, behavior_logprobs_BT, mask_BT)
    weights, corrected = weight_fn(log_ratio_BT, cap)
    counted = mask_BT.bool().any(-1) if per_sequence else mask_BT
    metrics = {
        "mismatch_kl": masked_mean(torch.expm1(log_ratio_BT) - log_ratio_BT, mask_BT),
        "mismatch_weight_mean": masked_mean(weights, counted),
        "mismatch_weight_max": masked_max(weights, counted),
        "mismatch_corrected_fraction": masked_mean(corrected.to(weights.dtype), counted),
    }
    return weights, metrics


def with_mismatch_correction(
    loss_fn: Callable[..., tuple[Tensor, dict[str, Tensor]]],
    *,
    mode: str = "token_truncate",
    cap: float = 2.0,
) -> Callable[..., tuple[Tensor, dict[str, Tensor]]]:
    """Wrap a policy loss so that it corrects the generator/trainer mismatch.

    The wrapped loss has the uniform `PolicyLoss` signature. pi_old is the current log-probs, detached:
    exactly the policy before the update, since the trainer takes one optimizer step per batch
    (LlamaRL's setting). It computes the weights pi_old / mu against `behavior_logprobs_BT` (mu), scales
    the advantages by them, and calls `loss_fn` with pi_old as the old log-probs, so the inner loss's
    ratio is 1 and the correction carries all the off-policyness.

    Metrics: the inner loss's, with its `mismatch_kl` renamed `policy_kl` (it measures pi vs pi_old),
    plus those of `mismatch_weights`.
    """
    if mode not in _MISMATCH_MODES:
        raise ValueError(f"unknown mismatch correction {mode!r}; valid names: {', '.join(_MISMATCH_MODES)}")
    if cap <= 0:
        raise ValueError(f"cap must be positive, got {cap}")

    def corrected_loss(
        logprobs_BT: Tensor,
        behavior_logprobs_BT: Tensor,
        advantages: Tensor,
        mask_BT: Tensor,
        *,
        num_valid_tokens: int,
        num_sequences: int,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        old_logprobs_BT = logprobs_BT.detach()
        weights, mismatch_metrics = mismatch_weights(
            old_logprobs_BT, behavior_logprobs_BT, mask_BT, mode=mode, cap=cap
        )
        if weights.dim() == 1 and advantages.dim() == 1:
            weighted_advantages = advantages.detach() * weights
        else:
            weights_BT = expand_to_tokens(weights, logprobs_BT)
            weighted_advantages = expand_to_tokens(advantages, logprobs_BT).detach() * weights_BT
        loss, metrics = loss_fn(
            logprobs_BT,
            old_logprobs_BT,
            weighted_advantages,
            mask_BT,
            num_valid_tokens=num_valid_tokens,
            num_sequences=num_sequences,
        )
        if "mismatch_kl" in metrics:
            metrics["policy_kl"] = metrics.pop("mismatch_kl")
        metrics.update(mismatch_metrics)
        return loss, metrics

    return corrected_loss
