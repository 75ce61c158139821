"""llamarl.algo: AIPO and the policy-gradient family as pure tensor functions (torch only).

No state, no distributed code: every loss returns `(loss, metrics)` and divides by counts of the global
batch passed in by the caller, so micro-batches and data-parallel ranks sum to the full-batch loss.
See docs/algorithms.md for the formulas, their papers, and how to add a loss.
"""

from llamarl.algo.advantages import (
    group_advantages,
    group_mean_advantages,
    group_mean_std_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
)
from llamarl.algo.kl import KL_ESTIMATORS, kl_k1, kl_k2, kl_k3, kl_penalty_loss
from llamarl.algo.logprobs import linear_token_logprobs, token_logprobs
from llamarl.algo.masking import (
    expand_to_tokens,
    group_mean,
    masked_mean,
    masked_sum,
    sequence_mean,
    token_sum_over,
)
from llamarl.algo.mismatch import MISMATCH_MODES, mismatch_weights, with_mismatch_correction
from llamarl.algo.policy_losses import (
    aipo_loss,
    aipo_sequence_loss,
    cispo_loss,
    dapo_loss,
    dr_grpo_loss,
    grpo_loss,
    gspo_loss,
    k3_mismatch_kl,
    policy_gradient_loss,
    ppo_clip_loss,
)
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
    "KL_ESTIMATORS",
    "MISMATCH_MODES",
    "POLICY_LOSS_NAMES",
    "AdvantageEstimator",
    "PolicyLoss",
    "aipo_loss",
    "aipo_sequence_loss",
    "cispo_loss",
    "dapo_loss",
    "dr_grpo_loss",
    "expand_to_tokens",
    "get_advantage_estimator",
    "get_policy_loss",
    "group_advantages",
    "group_mean",
    "group_mean_advantages",
    "group_mean_std_advantages",
    "grpo_loss",
    "gspo_loss",
    "k3_mismatch_kl",
    "kl_k1",
    "kl_k2",
    "kl_k3",
    "kl_penalty_loss",
    "linear_token_logprobs",
    "masked_mean",
    "masked_sum",
    "mismatch_weights",
    "policy_gradient_loss",
    "ppo_clip_loss",
    "reinforce_pp_baseline_advantages",
    "rloo_advantages",
    "sequence_mean",
    "token_logprobs",
    "token_sum_over",
    "with_mismatch_correction",
]
