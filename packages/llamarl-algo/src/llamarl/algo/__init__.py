"""llamarl.algo: AIPO and the policy-gradient family as pure tensor functions (torch only).

See docs/algorithms.md for the formulas and how to add a loss.
"""

from llamarl.algo.advantages import group_advantages, group_mean_advantages, group_mean_std_advantages
from llamarl.algo.logprobs import entropy_from_logits, token_logprobs
from llamarl.algo.masking import (
    expand_to_tokens,
    group_mean,
    masked_mean,
    masked_sum,
    sequence_mean,
    sequence_sum,
    token_sum_over,
)
from llamarl.algo.policy_losses import aipo_loss, k3_mismatch_kl
from llamarl.algo.registry import (
    ADVANTAGE_NAMES,
    DEFAULT_ADVANTAGE,
    DEFAULT_POLICY_LOSS,
    POLICY_LOSS_NAMES,
    AdvantageEstimator,
    PolicyLoss,
    get_advantage_estimator,
    get_policy_loss,
)

__all__ = [
    "ADVANTAGE_NAMES",
    "DEFAULT_ADVANTAGE",
    "DEFAULT_POLICY_LOSS",
    "POLICY_LOSS_NAMES",
    "AdvantageEstimator",
    "PolicyLoss",
    "aipo_loss",
    "entropy_from_logits",
    "expand_to_tokens",
    "get_advantage_estimator",
    "get_policy_loss",
    "group_advantages",
    "group_mean",
    "group_mean_advantages",
    "group_mean_std_advantages",
    "k3_mismatch_kl",
    "masked_mean",
    "masked_sum",
    "sequence_mean",
    "sequence_sum",
    "token_logprobs",
    "token_sum_over",
]
