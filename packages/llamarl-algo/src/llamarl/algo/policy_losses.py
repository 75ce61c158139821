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

import torch
from llamarl.algo.masking import expand_to_tokens, masked_max, masked_mean, token_sum_over
from torch import Tensor

LOG_RATIO_LIMIT = 20.0
"""|log ratio| is clamped to this before exp: exp(20) ~ 5e8 keeps the ratio finite in float32 even for
log-probs of -1e4; a token that far off-policy is truncated or clipped anyway."""


def _log_ratio(logprobs_BT: Tensor, behavior_logprobs_BT: Tensor, mask_BT: Tensor) -> Tensor:
    """log(pi / mu) per token, clamped for finiteness, 0 on masked tokens (padding may hold garbage)."""
    log_ratio_BT = (logprobs_BT - behavior_logprobs_BT.detach()).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    return torch.where(mask_BT.bool(), log_ratio_BT, torch.zeros_like(log_ratio_BT))


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
    ratio_BT = _log_ratio(logprobs_BT.detach(), behavior_logprobs_BT, mask_BT).exp()
    weight_BT = ratio_BT.clamp(max=rho)
    advantages_BT = expand_to_tokens(advantages, logprobs_BT).detach()
    loss = -token_sum_over(weight_BT * advantages_BT * logprobs_BT, mask_BT, num_valid_tokens)
    metrics = _ratio_metrics(ratio_BT, mask_BT, ratio_BT > rho)
    metrics["mismatch_kl"] = k3_mismatch_kl(logprobs_BT, behavior_logprobs_BT, mask_BT)
    return loss, metrics
