"""Generator/trainer mismatch correction: weights by hand, and how it composes with the losses."""

import math

import pytest
import torch
from llamarl_algo_testing import assert_close

from llamarl.algo import (
    MISMATCH_MODES,
    aipo_loss,
    get_policy_loss,
    mismatch_weights,
    ppo_clip_loss,
    with_mismatch_correction,
)
from llamarl.algo.policy_losses import policy_gradient_loss

# Two sequences; trainer-vs-generator ratios r chosen by hand; the last token of sequence 1 is padding.
R_BT = torch.tensor([[0.5, 3.0, 1.0], [1.5, 1.2, 100.0]], dtype=torch.float64)
MASK_BT = torch.tensor([[1, 1, 1], [1, 1, 0]])
TRAINER_OLD_BT = torch.tensor([[-1.0, -0.5, -2.0], [-0.1, -0.7, -3.0]], dtype=torch.float64)
BEHAVIOR_BT = TRAINER_OLD_BT - R_BT.log()


@pytest.mark.parametrize(
    ("mode", "expected", "corrected"),
    [
        ("token_truncate", [[0.5, 2.0, 1.0], [1.5, 1.2, 1.0]], 1 / 5),
        ("token_mask", [[0.5, 0.0, 1.0], [1.5, 1.2, 1.0]], 1 / 5),
        ("sequence_truncate", [1.5, 1.8], 0.0),
        ("sequence_mask", [1.5, 1.8], 0.0),
    ],
)
def test_weights_hand_computed(mode, expected, corrected):
    weights, metrics = mismatch_weights(TRAINER_OLD_BT, BEHAVIOR_BT, MASK_BT, mode=mode, cap=2.0)
    # Padding gets ratio 1 (its log-ratio is zeroed), so it never decides anything.
    assert_close(weights, torch.tensor(expected, dtype=torch.float64))
    assert_close(metrics["mismatch_corrected_fraction"], torch.tensor(corrected, dtype=torch.float64))
    valid = [0.5, 3.0, 1.0, 1.5, 1.2]
    k3 = sum(r - 1 - math.log(r) for r in valid) / 5
    assert_close(metrics["mismatch_kl"], torch.tensor(k3, dtype=torch.float64))


@pytest.mark.parametrize(
    ("mode", "expected"), [("sequence_truncate", [1.0, 1.0]), ("sequence_mask", [0.0, 0.0])]
)
def test_sequence_weights_over_the_cap(mode, expected):
    weights, metrics = mismatch_weights(TRAINER_OLD_BT, BEHAVIOR_BT, MASK_BT, mode=mode, cap=1.0)
    assert_close(weights, torch.tensor(expected, dtype=torch.float64))
    assert_close(metrics["mismatch_corrected_fraction"], torch.tensor(1.0, dtype=torch.float64))


def test_token_truncation_on_reinforce_is_aipo():
    # The trainer's current log-probs (detached) are pi_old: the corrected plain policy gradient is
    # then exactly AIPO with rho = cap.
    logprobs_BT = TRAINER_OLD_BT.clone().requires_grad_()
    advantages_B = torch.tensor([1.0, -0.5], dtype=torch.float64)
    corrected = with_mismatch_correction(policy_gradient_loss, mode="token_truncate", cap=2.0)
    loss, metrics = corrected(
        logprobs_BT, BEHAVIOR_BT, advantages_B, MASK_BT, num_valid_tokens=5, num_sequences=2
    )
    (grad,) = torch.autograd.grad(loss, logprobs_BT)
    aipo, _ = aipo_loss(logprobs_BT, BEHAVIOR_BT, advantages_B, MASK_BT, rho=2.0, num_valid_tokens=5)
    (aipo_grad,) = torch.autograd.grad(aipo, logprobs_BT)
    assert_close(loss, aipo)
    assert_close(grad, aipo_grad)
    assert {"policy_kl", "mismatch_kl", "mismatch_weight_mean", "mismatch_weight_max"} <= set(metrics)


def test_matching_log_probs_leave_the_loss_unchanged():
    logprobs_BT = (TRAINER_OLD_BT + 0.05).requires_grad_()
    advantages_B = torch.tensor([1.0, -0.5], dtype=torch.float64)
    loss_fn = get_policy_loss("ppo_clip", mismatch_is="token_mask", mismatch_cap=2.0)
    counts = {"num_valid_tokens": 5, "num_sequences": 2}
    loss, _ = loss_fn(logprobs_BT, logprobs_BT.detach(), advantages_B, MASK_BT, **counts)
    plain, _ = ppo_clip_loss(logprobs_BT, logprobs_BT.detach(), advantages_B, MASK_BT, **counts)
    assert_close(loss, plain)


def test_correction_weights_each_token_of_the_inner_loss():
    logprobs_BT = TRAINER_OLD_BT.clone().requires_grad_()
    advantages_B = torch.tensor([1.0, -0.5], dtype=torch.float64)
    counts = {"num_valid_tokens": 5, "num_sequences": 2}
    loss_fn = get_policy_loss("ppo_clip", mismatch_is="token_truncate", mismatch_cap=2.0)
    loss, _ = loss_fn(logprobs_BT, BEHAVIOR_BT, advantages_B, MASK_BT, **counts)
    (grad_BT,) = torch.autograd.grad(loss, logprobs_BT)
    # pi_old is the current policy, so the inner ratio is 1 (inside the clip range): each token's term
    # is -w * A * ratio with w = min(pi / mu, 2), a constant.
    weights_BT = torch.tensor([[0.5, 2.0, 1.0], [1.5, 1.2, 1.0]], dtype=torch.float64)
    expected = -(weights_BT * advantages_B[:, None] * MASK_BT).sum() / 5
    assert_close(loss, expected)
    assert_close(grad_BT, -(weights_BT * advantages_B[:, None] * MASK_BT) / 5)


def test_unknown_mode_and_bad_cap():
    with pytest.raises(ValueError, match="sequence_mask"):
        with_mismatch_correction(policy_gradient_loss, mode="bogus")
    with pytest.raises(ValueError, match="cap"):
        mismatch_weights(TRAINER_OLD_BT, BEHAVIOR_BT, MASK_BT, cap=0.0)
    with pytest.raises(ValueError, match="cap"):
        get_policy_loss("aipo", mismatch_is="token_mask", mismatch_cap=-1.0)


# Weights of R_BT at cap 1.6, per token (sequence modes broadcast theirs): products 1.5 and 1.8.
WEIGHTS_AT_1_6 = {
    "token_truncate": [[0.5, 1.6, 1.0], [1.5, 1.2, 0.0]],
    "token_mask": [[0.5, 0.0, 1.0], [1.5, 1.2, 0.0]],
    "sequence_truncate": [[1.5] * 3, [1.6] * 3],
    "sequence_mask": [[1.5] * 3, [0.0] * 3],
}


@pytest.mark.parametrize("mode", list(WEIGHTS_AT_1_6))
@pytest.mark.parametrize("token_advantages", [False, True])
def test_each_mode_weights_the_inner_loss_by_its_own_weights(mode, token_advantages):
    # The plain policy gradient wrapped: loss = -(1/N) sum_t w_t A_t log pi(y_t), in closed form.
    logprobs_BT = TRAINER_OLD_BT.clone().requires_grad_()
    advantages = (
        torch.tensor([[1.0, 2.0, 3.0], [-1.0, -2.0, 99.0]], dtype=torch.float64)
        if token_advantages
        else torch.tensor([1.0, -0.5], dtype=torch.float64)
    )
    corrected = with_mismatch_correction(policy_gradient_loss, mode=mode, cap=1.6)
    loss, _ = corrected(logprobs_BT, BEHAVIOR_BT, advantages, MASK_BT, num_valid_tokens=5, num_sequences=2)
    (grad_BT,) = torch.autograd.grad(loss, logprobs_BT)
    weights_BT = torch.tensor(WEIGHTS_AT_1_6[mode], dtype=torch.float64)
    advantages_BT = advantages if token_advantages else advantages[:, None].expand(2, 3)
    terms_BT = weights_BT * advantages_BT * MASK_BT
    assert_close(loss, -(terms_BT * TRAINER_OLD_BT).sum() / 5)
    assert_close(grad_BT, -terms_BT / 5)


def test_a_ratio_exactly_at_the_cap_is_kept():
    # token_mask keeps r_t <= cap: on-policy tokens at cap 1 keep their weight 1, none counts as corrected.
    for mode in MISMATCH_MODES:
        weights, metrics = mismatch_weights(TRAINER_OLD_BT, TRAINER_OLD_BT, MASK_BT, mode=mode, cap=1.0)
        assert (weights == 1).all(), mode
        assert metrics["mismatch_corrected_fraction"].item() == 0.0, mode


def test_the_wrapper_checks_its_cap_when_built():
    # A bad cap fails when the loss is built (start-up), not at the first step.
    for cap in (0.0, -1.0):
        with pytest.raises(ValueError, match=f"cap must be positive, got {cap}"):
            with_mismatch_correction(policy_gradient_loss, cap=cap)
    with_mismatch_correction(policy_gradient_loss, cap=1.0)


@pytest.mark.parametrize("mode", ["sequence_truncate", "sequence_mask"])
def test_sequence_metrics_count_only_sequences_with_tokens(mode):
    mask_BT = torch.tensor([[1, 1, 1], [0, 0, 0]])  # the second sequence is all padding
    weights, metrics = mismatch_weights(TRAINER_OLD_BT, BEHAVIOR_BT, mask_BT, mode=mode, cap=2.0)
    assert_close(weights, torch.tensor([1.5, 1.0], dtype=torch.float64))
    assert_close(metrics["mismatch_weight_mean"], torch.tensor(1.5, dtype=torch.float64))


def test_log_ratios_are_clamped_per_token_and_per_sequence():
    # Ten tokens of log-ratio -3 make a sequence log-ratio of -30, clamped to -20 (LOG_RATIO_LIMIT); ten
    # of +30 are clamped to +20 each, and their sum again to +20: the weight stays e^20 with no cap.
    trainer_old_BT = torch.zeros(2, 10, dtype=torch.float64)
    behavior_BT = torch.stack([torch.full((10,), 3.0), torch.full((10,), -30.0)]).double()
    mask_BT = torch.ones(2, 10)
    weights, metrics = mismatch_weights(
        trainer_old_BT, behavior_BT, mask_BT, mode="sequence_truncate", cap=math.inf
    )
    assert_close(
        weights, torch.tensor([math.exp(-20), math.exp(20)], dtype=torch.float64), rtol=1e-12, atol=0
    )
    k3 = [math.exp(-3) - 1 + 3, math.exp(20) - 1 - 20]
    assert_close(metrics["mismatch_kl"], torch.tensor(sum(k3) / 2, dtype=torch.float64))
    # Token level: a token with log-ratio -30 counts as -20 in mismatch_kl.
    _, metrics = mismatch_weights(
        torch.zeros(1, 2, dtype=torch.float64),
        torch.tensor([[30.0, 0.0]], dtype=torch.float64),
        torch.ones(1, 2),
    )
    assert_close(metrics["mismatch_kl"], torch.tensor((math.exp(-20) - 1 + 20) / 2, dtype=torch.float64))
