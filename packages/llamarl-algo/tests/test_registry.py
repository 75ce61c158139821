"""The registry's error messages, and the hyper-parameter defaults that the docs state."""

import inspect
import re

import pytest
import torch
from llamarl_algo_testing import assert_close

from llamarl.algo import (
    ADVANTAGE_NAMES,
    MISMATCH_MODES,
    POLICY_LOSS_NAMES,
    aipo_loss,
    aipo_sequence_loss,
    cispo_loss,
    dapo_loss,
    dr_grpo_loss,
    get_advantage_estimator,
    get_policy_loss,
    group_mean_std_advantages,
    grpo_loss,
    gspo_loss,
    kl_penalty_loss,
    mismatch_weights,
    ppo_clip_loss,
    reinforce_pp_baseline_advantages,
    token_logprobs,
    with_mismatch_correction,
)
from llamarl.algo.policy_losses import policy_gradient_loss


def test_unknown_names_list_every_valid_one():
    with pytest.raises(
        ValueError, match=re.escape(f"unknown policy loss 'ppo'; valid names: {', '.join(POLICY_LOSS_NAMES)}")
    ):
        get_policy_loss("ppo")
    with pytest.raises(
        ValueError,
        match=re.escape(f"unknown advantage estimator 'nope'; valid names: {', '.join(ADVANTAGE_NAMES)}"),
    ):
        get_advantage_estimator("nope")
    modes = re.escape(f"unknown mismatch correction 'bogus'; valid names: {', '.join(MISMATCH_MODES)}")
    with pytest.raises(ValueError, match=modes):
        get_policy_loss("aipo", mismatch_is="bogus")
    with pytest.raises(ValueError, match=modes):
        mismatch_weights(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), mode="bogus")


def test_unknown_hyper_parameters_are_all_named_with_what_the_function_takes():
    with pytest.raises(
        ValueError,
        match=re.escape("policy loss 'ppo_clip' has no hyper-parameter foo, rho; it takes: ['clip_eps']"),
    ):
        get_policy_loss("ppo_clip", rho=2.0, foo=1)
    with pytest.raises(
        ValueError, match=re.escape("advantage estimator 'rloo' has no hyper-parameter eps; it takes: []")
    ):
        get_advantage_estimator("rloo", eps=1.0)


# The defaults stated in docs/algorithms.md and the docstrings (the papers' values where there is one). A
# changed default silently changes every run that does not set it, so it has to change here as well.
DOCUMENTED_DEFAULTS = {
    aipo_loss: {"rho": 4.0},
    aipo_sequence_loss: {"rho": 4.0},
    ppo_clip_loss: {"clip_eps": 0.2},
    grpo_loss: {"clip_eps": 0.2},
    dapo_loss: {"clip_low": 0.2, "clip_high": 0.28},
    dr_grpo_loss: {"clip_eps": 0.2, "max_response_length": None},
    gspo_loss: {"clip_low": 3e-4, "clip_high": 4e-4},
    cispo_loss: {"clip_low": 1.0, "clip_high": 0.28},
    group_mean_std_advantages: {"eps": 1e-6},
    reinforce_pp_baseline_advantages: {"eps": 1e-6},
    get_policy_loss: {"name": "aipo", "mismatch_is": None, "mismatch_cap": 2.0},
    get_advantage_estimator: {"name": "group_mean"},
    with_mismatch_correction: {"mode": "token_truncate", "cap": 2.0},
    mismatch_weights: {"mode": "token_truncate", "cap": 2.0},
    kl_penalty_loss: {"estimator": "k3", "coef": 1.0},
    token_logprobs: {"temperature": 1.0, "chunk_size": 512},
}


@pytest.mark.parametrize("fn", DOCUMENTED_DEFAULTS, ids=lambda fn: fn.__name__)
def test_hyper_parameter_defaults_are_the_documented_ones(fn):
    parameters = inspect.signature(fn).parameters
    assert {name: parameters[name].default for name in DOCUMENTED_DEFAULTS[fn]} == DOCUMENTED_DEFAULTS[fn]


def test_every_registered_loss_has_its_defaults_documented_here():
    # A loss added to the registry needs its row above (and in docs/algorithms.md).
    documented = {fn.__name__ for fn in DOCUMENTED_DEFAULTS} | {policy_gradient_loss.__name__}
    assert {get_policy_loss(name).func.__name__ for name in POLICY_LOSS_NAMES} <= documented


# Each registered loss's hyper-parameters as docs/algorithms.md gives their defaults.
DOCUMENTED_LOSS_DEFAULTS = {
    "aipo": {"rho": 4.0},
    "aipo_seq": {"rho": 4.0},
    "reinforce": {},
    "ppo_clip": {"clip_eps": 0.2},
    "grpo": {"clip_eps": 0.2},
    "dapo": {"clip_low": 0.2, "clip_high": 0.28},
    "dr_grpo": {"clip_eps": 0.2, "max_response_length": None},
    "gspo": {"clip_low": 3e-4, "clip_high": 4e-4},
    "cispo": {"clip_low": 1.0, "clip_high": 0.28},
}


def _probe_batch():
    """One-token sequences whose ratios straddle every documented clip and truncation bound (GSPO's
    1 +- 3e-4 included), each once with advantage +1 and once with -1."""
    ratios = [1e-3, 0.3, 0.5, 0.75, 0.85, 0.9995, 0.9999, 1.0, 1.0002, 1.0006, 1.1, 1.25, 1.3, 1.5, 2.5, 4.5]
    ratios_B1 = torch.tensor(ratios * 2, dtype=torch.float64)[:, None]
    logprobs_B1 = torch.linspace(-3.0, -0.1, len(ratios) * 2, dtype=torch.float64)[:, None]
    advantages_B = torch.tensor([1.0] * len(ratios) + [-1.0] * len(ratios), dtype=torch.float64)
    mask_B1 = torch.ones_like(logprobs_B1)
    counts = {"num_valid_tokens": len(ratios) * 2, "num_sequences": len(ratios) * 2}
    return (logprobs_B1.requires_grad_(), logprobs_B1 - ratios_B1.log(), advantages_B, mask_B1), counts


@pytest.mark.parametrize("name", POLICY_LOSS_NAMES)
def test_each_loss_runs_with_its_documented_defaults(name):
    # The signature test above reads the defaults; this one checks that they are what a call without
    # hyper-parameters uses, on a batch where any other value would change the loss.
    batch, counts = _probe_batch()
    documented = DOCUMENTED_LOSS_DEFAULTS[name]
    loss, _ = get_policy_loss(name)(*batch, **counts)
    assert_close(loss, get_policy_loss(name, **documented)(*batch, **counts)[0])
    for key, value in documented.items():
        if value is not None:
            halved, _ = get_policy_loss(name, **{**documented, key: value / 2})(*batch, **counts)
            assert not torch.isclose(halved, loss), (
                f"the probe batch cannot tell {key}={value / 2} from {value}"
            )


@pytest.mark.parametrize("mode", MISMATCH_MODES)
def test_the_mismatch_cap_defaults_to_2(mode):
    batch, counts = _probe_batch()
    loss, _ = get_policy_loss("reinforce", mismatch_is=mode)(*batch, **counts)
    assert_close(loss, get_policy_loss("reinforce", mismatch_is=mode, mismatch_cap=2.0)(*batch, **counts)[0])
    wrapped, _ = with_mismatch_correction(policy_gradient_loss, mode=mode)(*batch, **counts)
    assert_close(wrapped, loss)
    logprobs_B1, behavior_B1, _, mask_B1 = batch
    weights, _ = mismatch_weights(logprobs_B1.detach(), behavior_B1, mask_B1, mode=mode)
    assert_close(weights, mismatch_weights(logprobs_B1.detach(), behavior_B1, mask_B1, mode=mode, cap=2.0)[0])
    assert not torch.isclose(
        loss, get_policy_loss("reinforce", mismatch_is=mode, mismatch_cap=3.0)(*batch, **counts)[0]
    )
