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


def test_masked_sum_keeps_an_integer_dtype():
    # Counting valid tokens with masked_sum(mask, mask) stays an exact integer.
    mask_BT = torch.tensor([[1, 1, 0], [1, 0, 0]])
    total = masked_sum(torch.tensor([[1, 2, 3], [4, 5, 6]]), mask_BT)
    assert total.dtype == torch.int64 and total.item() == 7
    assert_close(masked_sum(mask_BT, mask_BT, dim=-1), torch.tensor([2, 1]))


def test_token_sum_over_accepts_a_single_valid_token_and_rejects_no_token():
    values_BT = torch.tensor([[3.0, 5.0]])
    assert token_sum_over(values_BT, torch.tensor([[0, 1]]), 1).item() == 5.0
    for bad in (0, -2):
        with pytest.raises(ValueError, match=f"the denominator must be positive, got {bad}"):
            token_sum_over(values_BT, torch.tensor([[0, 1]]), bad)


def test_groups_of_one_and_bad_group_sizes():
    values_B = torch.tensor([1.0, 3.0, 0.0])
    assert_close(group_mean(values_B, 1), values_B)
    for bad in (0, -1, 2):
        with pytest.raises(ValueError, match=f"batch of 3 is not a whole number of groups of {bad}"):
            group_mean(values_B, bad)


def test_expand_to_tokens_names_both_shapes_when_they_do_not_match():
    with pytest.raises(ValueError, match=r"values of shape \(2, 2\) do not match tokens \(2, 3\)"):
        expand_to_tokens(torch.ones(2, 2), torch.zeros(2, 3))
    # Three axes are neither [B] nor [B, T], even where the second one has T's length.
    with pytest.raises(ValueError, match=r"values of shape \(2, 3, 4\) do not match tokens \(2, 3\)"):
        expand_to_tokens(torch.ones(2, 3, 4), torch.zeros(2, 3))
