"""Advantage estimators: hand-computed values."""

import pytest
import torch

from llamarl.algo import get_advantage_estimator, group_advantages


def test_group_mean_hand_computed():
    rewards_B = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0])
    advantages_B = group_advantages(rewards_B, 3)
    torch.testing.assert_close(advantages_B, torch.tensor([2 / 3, -1 / 3, -1 / 3, 0.0, 0.0, 0.0]))


def test_group_mean_std_hand_computed():
    rewards_B = torch.tensor([1.0, 0.0, 3.0, 3.0])
    advantages_B = group_advantages(rewards_B, 2, normalize_std=True, eps=0.0 + 1e-12)
    torch.testing.assert_close(advantages_B, torch.tensor([1.0, -1.0, 0.0, 0.0]))


def test_registry_defaults_and_errors():
    rewards_B = torch.tensor([1.0, 0.0])
    torch.testing.assert_close(get_advantage_estimator()(rewards_B, 2), torch.tensor([0.5, -0.5]))
    with pytest.raises(ValueError, match="group_mean"):
        get_advantage_estimator("nope")
    with pytest.raises(ValueError, match="not a whole number"):
        group_advantages(torch.ones(5), 2)
