"""Masked reductions."""

import pytest
import torch
from llamarl_algo_testing import assert_close

from llamarl.algo import (
    expand_to_tokens,
    group_mean,
    masked_mean,
    masked_sum,
    sequence_mean,
    token_sum_over,
)


def test_masked_reductions_hand_computed_and_nan_on_padding_does_not_leak():
    values_BT = torch.tensor([[1.0, 2.0, torch.nan], [4.0, torch.inf, -torch.inf]])
    mask_BT = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert masked_sum(values_BT, mask_BT).item() == 7.0
    assert masked_mean(values_BT, mask_BT).item() == pytest.approx(7 / 3)
    assert_close(sequence_mean(values_BT, mask_BT), torch.tensor([1.5, 4.0]))
    assert token_sum_over(values_BT, mask_BT, 7).item() == pytest.approx(1.0)
    # An empty mask gives 0, not nan.
    assert masked_mean(values_BT, torch.zeros_like(mask_BT)).item() == 0.0
    with pytest.raises(ValueError):
        token_sum_over(values_BT, mask_BT, 0)


def test_group_mean_and_expand():
    assert_close(group_mean(torch.tensor([1.0, 3.0, 0.0, 2.0]), 2), torch.tensor([2.0, 2.0, 1.0, 1.0]))
    like_BT = torch.zeros(2, 3)
    assert_close(expand_to_tokens(torch.tensor([1.0, 2.0]), like_BT), torch.tensor([[1.0] * 3, [2.0] * 3]))
    with pytest.raises(ValueError):
        expand_to_tokens(torch.ones(3), like_BT)
