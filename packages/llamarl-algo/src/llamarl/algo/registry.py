"""Policy losses and advantage estimators by name, for the trainer and the apps (`--loss`, `--advantage`).

Shape legend:
    B: sequences in the batch, T: tokens per sequence.

A registry entry is a plain function; `get_*` binds its hyper-parameters with `functools.partial`
after checking their names, so a typo fails at start-up rather than at the first step.
To add a loss: write the function in `policy_losses.py` with the `PolicyLoss` signature, add one line
to `_POLICY_LOSSES`, test it in `tests/` (the generic tests pick it up from `POLICY_LOSS_NAMES`).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Protocol

from torch import Tensor

from llamarl.algo import advantages, policy_losses
from llamarl.algo.mismatch import with_mismatch_correction


class PolicyLoss(Protocol):
    """The uniform call every registered policy loss supports (hyper-parameters already bound)."""

    def __call__(
        self,
        logprobs_BT: Tensor,
        behavior_logprobs_BT: Tensor,
        advantages: Tensor,
        mask_BT: Tensor,
        *,
        num_valid_tokens: int,
        num_sequences: int,
    ) -> tuple[Tensor, dict[str, Tensor]]: ...


class AdvantageEstimator(Protocol):
    """`(rewards_B, group_size) -> advantages_B`, hyper-parameters already bound."""

    def __call__(self, rewards_B: Tensor, group_size: int) -> Tensor: ...


_POLICY_LOSSES: dict[str, Callable[..., tuple[Tensor, dict[str, Tensor]]]] = {
    "aipo": policy_losses.aipo_loss,
    "aipo_seq": policy_losses.aipo_sequence_loss,
    "reinforce": policy_losses.policy_gradient_loss,
    "ppo_clip": policy_losses.ppo_clip_loss,
    "grpo": policy_losses.grpo_loss,
    "dapo": policy_losses.dapo_loss,
    "dr_grpo": policy_losses.dr_grpo_loss,
    "gspo": policy_losses.gspo_loss,
    "cispo": policy_losses.cispo_loss,
}

_ADVANTAGES: dict[str, Callable[..., Tensor]] = {
    "group_mean": advantages.group_mean_advantages,
    "group_mean_std": advantages.group_mean_std_advantages,
    "rloo": advantages.rloo_advantages,
    "reinforce_pp_baseline": advantages.reinforce_pp_baseline_advantages,
}

POLICY_LOSS_NAMES: tuple[str, ...] = tuple(_POLICY_LOSSES)
"""Names accepted by `get_policy_loss`; the first is the default."""
ADVANTAGE_NAMES: tuple[str, ...] = tuple(_ADVANTAGES)
"""Names accepted by `get_advantage_estimator`; the first is the default."""
DEFAULT_POLICY_LOSS = "aipo"
DEFAULT_ADVANTAGE = "group_mean"

# Arguments of the uniform call, which hyper-parameters may not bind.
_CALL_ARGUMENTS = frozenset(
    {"logprobs_BT", "behavior_logprobs_BT", "advantages", "mask_BT", "num_valid_tokens", "num_sequences"}
)


def _bind(kind: str, table: dict[str, Callable], name: str, hparams: dict, reserved: frozenset[str]):
    if name not in table:
        raise ValueError(f"unknown {kind} {name!r}; valid names: {', '.join(table)}")
    fn = table[name]
    keyword_only = {
        p.name for p in inspect.signature(fn).parameters.values() if p.kind is inspect.Parameter.KEYWORD_ONLY
    }
    tunable = sorted(keyword_only - reserved)
    unknown = sorted(set(hparams) - set(tunable))
    if unknown:
        raise ValueError(f"{kind} {name!r} has no hyper-parameter {', '.join(unknown)}; it takes: {tunable}")
    return functools.partial(fn, **hparams)


def get_policy_loss(
    name: str = DEFAULT_POLICY_LOSS,
    *,
    mismatch_is: str | None = None,
    mismatch_cap: float = 2.0,
    **hparams,
) -> PolicyLoss:
    """The policy loss registered as `name`, with `hparams` bound (e.g. `get_policy_loss("aipo", rho=2.0)`).

    Args:
        name: one of `POLICY_LOSS_NAMES`.
        mismatch_is: None, or one of `llamarl.algo.mismatch.MISMATCH_MODES` ("token_truncate",
            "token_mask", "sequence_truncate", "sequence_mask") to correct the generator/trainer
            log-prob mismatch (see `with_mismatch_correction`); the returned loss then also accepts
            `trainer_old_logprobs_BT=`.
        mismatch_cap: the truncation / masking threshold of that correction.
        **hparams: the loss's keyword hyper-parameters (see its docstring).

    Raises:
        ValueError: unknown name (the message lists the valid names), unknown hyper-parameter or
            unknown mismatch mode.
    """
    loss_fn = _bind("policy loss", _POLICY_LOSSES, name, hparams, _CALL_ARGUMENTS)
    if mismatch_is is None:
        return loss_fn
    return with_mismatch_correction(loss_fn, mode=mismatch_is, cap=mismatch_cap)


def get_advantage_estimator(name: str = DEFAULT_ADVANTAGE, **hparams) -> AdvantageEstimator:
    """The advantage estimator registered as `name`, with `hparams` bound.

    Raises:
        ValueError: unknown name (the message lists the valid names) or unknown hyper-parameter.
    """
    return _bind("advantage estimator", _ADVANTAGES, name, hparams, frozenset())
