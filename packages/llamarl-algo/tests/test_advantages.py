"""Advantage estimators: hand-computed values."""

import math

import pytest
import torch
from llamarl_algo_testing import assert_close

from llamarl.algo import (
    ADVANTAGE_NAMES,
    get_advantage_estimator,
    group_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
)


def test_group_mean_hand_computed():
    rewards_B = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0])
    advantages_B = group_advantages(rewards_B, 3)
    assert_close(advantages_B, torch.tensor([2 / 3, -1 / 3, -1 / 3, 0.0, 0.0, 0.0]))


def test_group_mean_std_hand_computed():
    rewards_B = torch.tensor([1.0, 0.0, 3.0, 3.0])
    advantages_B = group_advantages(rewards_B, 2, normalize_std=True, eps=0.0 + 1e-12)
    assert_close(advantages_B, torch.tensor([1.0, -1.0, 0.0, 0.0]))


def test_registry_defaults_and_errors():
    rewards_B = torch.tensor([1.0, 0.0])
    assert_close(get_advantage_estimator()(rewards_B, 2), torch.tensor([0.5, -0.5]))
    with pytest.raises(ValueError, match="group_mean"):
        get_advantage_estimator("nope")
    with pytest.raises(ValueError, match="not a whole number"):
        group_advantages(torch.ones(5), 2)


def test_rloo_hand_computed():
    rewards_B = torch.tensor([1.0, 0.0, 0.0, 2.0, 2.0, 5.0])
    advantages_B = rloo_advantages(rewards_B, 3)
    # r_i minus the mean of the two others.
    assert_close(advantages_B, torch.tensor([1.0, -0.5, -0.5, -1.5, -1.5, 3.0]))
    with pytest.raises(ValueError, match="at least 2"):
        rloo_advantages(rewards_B, 1)


def test_reinforce_pp_baseline_hand_computed():
    rewards_B = torch.tensor([1.0, 0.0, 3.0, 3.0], dtype=torch.float64)
    advantages_B = reinforce_pp_baseline_advantages(rewards_B, 2, eps=0.0)
    # Group-centred: [0.5, -0.5, 0, 0]; batch mean 0, batch std sqrt(0.125).
    expected = torch.tensor([0.5, -0.5, 0.0, 0.0], dtype=torch.float64) / math.sqrt(0.125)
    assert_close(advantages_B, expected)


def test_every_registered_estimator_runs_by_name():
    rewards_B = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0])
    assert ADVANTAGE_NAMES[0] == "group_mean"
    for name in ADVANTAGE_NAMES:
        advantages_B = get_advantage_estimator(name)(rewards_B, 3)
        assert advantages_B.shape == (6,) and torch.isfinite(advantages_B).all()
        # Every estimator here is zero-mean within a group of equal rewards.
        assert_close(get_advantage_estimator(name)(torch.ones(6), 3), torch.zeros(6))
    with pytest.raises(ValueError, match="eps"):
        get_advantage_estimator("rloo", eps=1.0)
    assert_close(
        get_advantage_estimator("group_mean_std", eps=1.0)(rewards_B[:2], 2), torch.tensor([1 / 3, -1 / 3])
    )


@pytest.mark.parametrize("name", ["group_mean", "group_mean_std", "rloo", "reinforce_pp_baseline"])
def test_equal_float32_rewards_give_exactly_zero(name):
    # The float32 mean of 8 x 0.1 is 0.1 + 7.5e-9; divided by that group's std (7.5e-9) + 1e-6, GRPO
    # gave every sample an advantage of 0.0074 (and 0.49 for 6 x 10.1), a push with no signal behind it.
    rewards_B = torch.cat([torch.full((8,), 0.1), torch.full((8,), 10.1), torch.arange(8.0)])
    advantages_B = get_advantage_estimator(name)(rewards_B, 8)
    assert advantages_B.dtype == torch.float32
    assert (advantages_B[:16] == 0).all(), advantages_B
    assert (advantages_B[16:] != 0).all()


@pytest.mark.parametrize(
    ("dtype", "expected_dtype"),
    [
        (torch.int64, torch.float32),
        (torch.bool, torch.float32),
        (torch.bfloat16, torch.float32),
        (torch.float64, torch.float64),
    ],
)
def test_integer_and_low_precision_rewards_give_float32_advantages(dtype, expected_dtype):
    # Rule rewards often arrive as 0/1 integers or booleans: the mean needs a float.
    rewards_B = torch.tensor([1, 0, 0, 1, 1, 1]).to(dtype)
    advantages_B = group_advantages(rewards_B, 3)
    assert advantages_B.dtype == expected_dtype
    assert_close(advantages_B, torch.tensor([2 / 3, -1 / 3, -1 / 3, 0.0, 0.0, 0.0], dtype=expected_dtype))


def test_rloo_with_two_samples_is_the_difference_of_their_rewards():
    advantages_B = rloo_advantages(torch.tensor([1.0, 0.0, 0.5, 2.0]), 2)
    assert_close(advantages_B, torch.tensor([1.0, -1.0, -1.5, 1.5]))


def test_reinforce_pp_baseline_adds_eps_to_the_batch_std():
    rewards_B = torch.tensor([1.0, 0.0, 3.0, 3.0], dtype=torch.float64)
    advantages_B = reinforce_pp_baseline_advantages(rewards_B, 2, eps=1.0)
    expected = torch.tensor([0.5, -0.5, 0.0, 0.0], dtype=torch.float64) / (math.sqrt(0.125) + 1.0)
    assert_close(advantages_B, expected)
