"""AIPO: hand-computed values, closed-form gradient, masking, micro-batch sums, metrics."""

import math

import torch
from llamarl_algo_testing import assert_close

from llamarl.algo import aipo_loss, get_policy_loss


def _example():
    # Two sequences of three tokens; the last token of the second sequence is padding.
    logprobs_BT = torch.tensor(
        [[-1.0, -2.0, -0.5], [-0.3, -1.5, 7.0]], dtype=torch.float64, requires_grad=True
    )
    behavior_BT = torch.tensor([[-1.0, -3.0, -0.2], [-0.3, -1.0, 0.0]], dtype=torch.float64)
    mask_BT = torch.tensor([[1, 1, 1], [1, 1, 0]])
    advantages_B = torch.tensor([0.5, -2.0], dtype=torch.float64)
    return logprobs_BT, behavior_BT, mask_BT, advantages_B


def test_aipo_hand_computed_value_and_gradient():
    logprobs_BT, behavior_BT, mask_BT, advantages_B = _example()
    loss, metrics = aipo_loss(logprobs_BT, behavior_BT, advantages_B, mask_BT, rho=2.0, num_valid_tokens=5)
    # ratios: 1, e (truncated to 2), e^-0.3 ; 1, e^-0.5 ; (padding)
    weights = [1.0, 2.0, math.exp(-0.3), 1.0, math.exp(-0.5)]
    advs = [0.5, 0.5, 0.5, -2.0, -2.0]
    lps = [-1.0, -2.0, -0.5, -0.3, -1.5]
    expected = -sum(w * a * lp for w, a, lp in zip(weights, advs, lps, strict=True)) / 5
    assert_close(loss, torch.tensor(expected, dtype=torch.float64))
    loss.backward()
    expected_grad = torch.tensor(
        [
            [-w * a / 5 for w, a in zip(weights[:3], advs[:3], strict=True)],
            [2.0 * 1.0 / 5, 2.0 * math.exp(-0.5) / 5, 0],
        ],
        dtype=torch.float64,
    )
    assert_close(logprobs_BT.grad, expected_grad)
    ratios = [1.0, math.e, math.exp(-0.3), 1.0, math.exp(-0.5)]
    assert_close(metrics["ratio_mean"], torch.tensor(sum(ratios) / 5, dtype=torch.float64))
    assert_close(metrics["ratio_max"], torch.tensor(math.e, dtype=torch.float64))
    assert_close(metrics["truncated_fraction"], torch.tensor(0.2, dtype=torch.float64))
    k3 = sum(r - 1 - math.log(r) for r in ratios) / 5
    assert_close(metrics["mismatch_kl"], torch.tensor(k3, dtype=torch.float64))
    assert all(not m.requires_grad and m.dim() == 0 for m in metrics.values())


def test_aipo_registry_default():
    logprobs_BT, behavior_BT, mask_BT, advantages_B = _example()
    loss_fn = get_policy_loss("aipo", rho=2.0)
    loss, _ = loss_fn(logprobs_BT, behavior_BT, advantages_B, mask_BT, num_valid_tokens=5, num_sequences=2)
    expected, _ = aipo_loss(logprobs_BT, behavior_BT, advantages_B, mask_BT, rho=2.0, num_valid_tokens=5)
    assert_close(loss, expected)
