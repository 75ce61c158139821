"""Every registered policy loss: masking, micro-batch sums, extreme inputs, gradcheck, and the
hand-computed values and closed-form gradients of each loss, and the reductions between them."""

import math

import pytest
import torch
from llamarl_algo_testing import assert_close

from llamarl.algo import (
    POLICY_LOSS_NAMES,
    aipo_loss,
    aipo_sequence_loss,
    cispo_loss,
    dapo_loss,
    dr_grpo_loss,
    get_policy_loss,
    group_mean_advantages,
    grpo_loss,
    gspo_loss,
    policy_gradient_loss,
    ppo_clip_loss,
)
from llamarl.algo.mismatch import MISMATCH_MODES

# Every loss, alone and wrapped in every mismatch correction.
LOSS_VARIANTS = [(name, mode) for name in POLICY_LOSS_NAMES for mode in (None, *MISMATCH_MODES)]


def _call(name, mode, logprobs_BT, behavior_BT, advantages, mask_BT, **counts):
    loss_fn = get_policy_loss(name, mismatch_is=mode)
    return loss_fn(logprobs_BT, behavior_BT, advantages, mask_BT, **counts)


def _counts(mask_BT):
    return {"num_valid_tokens": int(mask_BT.sum()), "num_sequences": mask_BT.shape[0]}


@pytest.mark.parametrize(("name", "mode"), LOSS_VARIANTS)
def test_masked_tokens_contribute_nothing(name, mode, make_batch):
    logprobs_BT, behavior_BT, _, mask_BT = make_batch()
    advantages_BT = torch.randn(logprobs_BT.shape, dtype=torch.float64)
    padding_BT = ~mask_BT.bool()
    loss, metrics = _call(name, mode, logprobs_BT, behavior_BT, advantages_BT, mask_BT, **_counts(mask_BT))
    (grad,) = torch.autograd.grad(loss, logprobs_BT)
    # Garbage on the padding: -inf log-probs, nan behaviour log-probs, inf advantages.
    garbage_BT = torch.where(padding_BT, -torch.inf, logprobs_BT.detach()).requires_grad_()
    behavior2_BT = torch.where(padding_BT, torch.nan, behavior_BT)
    advantages2_BT = torch.where(padding_BT, torch.inf, advantages_BT)
    loss2, metrics2 = _call(name, mode, garbage_BT, behavior2_BT, advantages2_BT, mask_BT, **_counts(mask_BT))
    (grad2,) = torch.autograd.grad(loss2, garbage_BT)
    assert_close(loss2, loss)
    assert_close(grad2, grad)
    assert (grad2[padding_BT] == 0).all()
    for key, value in metrics.items():
        assert_close(metrics2[key], value, msg=key)


@pytest.mark.parametrize(("name", "mode"), LOSS_VARIANTS)
@pytest.mark.parametrize("token_advantages", [False, True])
def test_micro_batches_sum_to_full_batch(name, mode, token_advantages, make_batch):
    logprobs_BT, behavior_BT, advantages_B, mask_BT = make_batch(batch=6, spread=0.3)
    advantages = (
        advantages_B[:, None] * torch.rand(6, 5, dtype=torch.float64) if token_advantages else advantages_B
    )
    counts = _counts(mask_BT)
    full, _ = _call(name, mode, logprobs_BT, behavior_BT, advantages, mask_BT, **counts)
    (full_grad,) = torch.autograd.grad(full, logprobs_BT)
    parts = [
        _call(name, mode, logprobs_BT[s], behavior_BT[s], advantages[s], mask_BT[s], **counts)[0]
        for s in (slice(0, 1), slice(1, 4), slice(4, 6))
    ]
    total = sum(parts)
    (parts_grad,) = torch.autograd.grad(total, logprobs_BT)
    assert_close(total, full)
    assert_close(parts_grad, full_grad)


@pytest.mark.parametrize(("name", "mode"), LOSS_VARIANTS)
def test_micro_batches_trimmed_to_their_own_length_sum_to_full_batch(name, mode, make_batch):
    # A trainer cuts each micro-batch's all-padding columns: T differs between micro-batches.
    logprobs_BT, behavior_BT, advantages_B, mask_BT = make_batch(batch=6, spread=0.3)
    counts = _counts(mask_BT)
    full, _ = _call(name, mode, logprobs_BT, behavior_BT, advantages_B, mask_BT, **counts)
    total = 0
    for rows in (slice(0, 2), slice(2, 3), slice(3, 6)):
        length = int(mask_BT[rows].sum(-1).max())
        cut = (rows, slice(0, length))
        total = (
            total
            + _call(
                name, mode, logprobs_BT[cut], behavior_BT[cut], advantages_B[rows], mask_BT[cut], **counts
            )[0]
        )
    assert_close(total, full)


@pytest.mark.parametrize(("name", "mode"), LOSS_VARIANTS)
def test_extreme_logprobs_stay_finite(name, mode):
    # Log-probs of -1e4 against 0 and the reverse: ratios of exp(+-1e4), in float32 as a trainer has.
    logprobs_BT = torch.tensor([[-1e4, 0.0, -1e4], [0.0, -1e4, -3.0]], requires_grad=True)
    behavior_BT = torch.tensor([[0.0, -1e4, -1e4], [-1e4, 0.0, -1e-3]])
    mask_BT = torch.ones(2, 3)
    for advantages in (torch.tensor([1.0, -1.0]), torch.tensor([-2.0, 3.0])):
        loss, metrics = _call(name, mode, logprobs_BT, behavior_BT, advantages, mask_BT, **_counts(mask_BT))
        (grad,) = torch.autograd.grad(loss, logprobs_BT)
        assert torch.isfinite(loss) and torch.isfinite(grad).all()
        assert all(torch.isfinite(v) for v in metrics.values()), metrics


# Losses whose value is the objective itself, so autograd's gradient is the value's true derivative.
# AIPO, sequence AIPO and CISPO are surrogates instead: their weight depends on log pi but is detached
# by design, so their gradient is checked against the closed form below, not by finite differences.
DIFFERENTIABLE_LOSSES = ["reinforce", "ppo_clip", "grpo", "dapo", "dr_grpo", "gspo"]


@pytest.mark.parametrize("name", DIFFERENTIABLE_LOSSES)
def test_gradcheck_float64(name, make_batch):
    # (With a mismatch correction the weights come from the detached log-probs: not a function that
    # finite differences can check; tests/test_mismatch.py checks its gradient in closed form.)
    logprobs_BT, behavior_BT, advantages_B, mask_BT = make_batch(seed=3)
    counts = _counts(mask_BT)
    loss_fn = get_policy_loss(name)

    def loss_of(lp_BT):
        return loss_fn(lp_BT, behavior_BT, advantages_B, mask_BT, **counts)[0]

    assert torch.autograd.gradcheck(loss_of, (logprobs_BT,))


@pytest.mark.parametrize(("name", "mode"), LOSS_VARIANTS)
def test_metrics_are_detached_scalars(name, mode, batch):
    logprobs_BT, behavior_BT, advantages_B, mask_BT = batch
    _, metrics = _call(name, mode, logprobs_BT, behavior_BT, advantages_B, mask_BT, **_counts(mask_BT))
    assert "mismatch_kl" in metrics
    assert all(isinstance(v, torch.Tensor) and v.dim() == 0 and not v.requires_grad for v in metrics.values())


def test_registry_errors_and_defaults():
    with pytest.raises(ValueError, match=r"aipo.*ppo_clip"):
        get_policy_loss("ppo")
    with pytest.raises(ValueError, match="rho"):
        get_policy_loss("ppo_clip", rho=2.0)
    with pytest.raises(ValueError, match="num_valid_tokens"):
        get_policy_loss("aipo", num_valid_tokens=3)
    with pytest.raises(ValueError, match="token_truncate"):
        get_policy_loss("aipo", mismatch_is="bogus")
    assert POLICY_LOSS_NAMES[0] == "aipo"
    assert get_policy_loss().func is aipo_loss
    assert get_policy_loss().keywords == {}


# ---- hand-computed values and closed-form gradients ------------------------------------------------

# One sequence of 4 valid tokens + 1 padding, another of 2 valid tokens; ratios chosen by hand.
RATIOS = [[1.5, 0.5, 1.1, 0.9, 1.0], [2.0, 0.7, 1.0, 1.0, 1.0]]
MASK = [[1, 1, 1, 1, 0], [1, 1, 0, 0, 0]]


def _hand_batch():
    logprobs_BT = torch.tensor(
        [[-1.0, -2.0, -0.5, -0.25, -9.0], [-0.3, -1.5, -4.0, -4.0, -4.0]], dtype=torch.float64
    )
    behavior_BT = logprobs_BT - torch.tensor(RATIOS, dtype=torch.float64).log()
    return logprobs_BT.requires_grad_(), behavior_BT, torch.tensor(MASK)


def _loss_and_grad(fn, advantages, **kwargs):
    logprobs_BT, behavior_BT, mask_BT = _hand_batch()
    loss, metrics = fn(
        logprobs_BT, behavior_BT, advantages, mask_BT, num_valid_tokens=6, num_sequences=2, **kwargs
    )
    (grad,) = torch.autograd.grad(loss, logprobs_BT)
    return loss, grad, metrics


def _tokens(values):
    """Hand values listed per valid token -> [B, T] with 0 on padding."""
    out = torch.zeros(2, 5, dtype=torch.float64)
    out[0, :4] = torch.tensor(values[:4], dtype=torch.float64)
    out[1, :2] = torch.tensor(values[4:], dtype=torch.float64)
    return out


R = [1.5, 0.5, 1.1, 0.9, 2.0, 0.7]  # ratios of the valid tokens
LP = [-1.0, -2.0, -0.5, -0.25, -0.3, -1.5]
A_SEQ = [1.0, 1.0, 1.0, 1.0, -2.0, -2.0]
ADVANTAGES = torch.tensor([1.0, -2.0], dtype=torch.float64)


def test_ppo_clip_hand_computed():
    loss, grad, metrics = _loss_and_grad(ppo_clip_loss, ADVANTAGES, clip_eps=0.2)
    # A > 0 clips ratios above 1.2; A < 0 clips ratios below 0.8.
    clipped = [min(r * a, max(min(r, 1.2), 0.8) * a) for r, a in zip(R, A_SEQ, strict=True)]
    assert_close(loss, torch.tensor(-sum(clipped) / 6, dtype=torch.float64))
    # d/dlogpi of -r A / N where the unclipped branch is taken: token 0 (1.5 > 1.2, A>0) and token 5
    # (0.7 < 0.8, A<0) are clipped and get no gradient.
    live = [0, 1, 1, 1, 1, 0]
    expected = [-r * a / 6 * keep for r, a, keep in zip(R, A_SEQ, live, strict=True)]
    assert_close(grad, _tokens(expected))
    assert_close(metrics["clipped_fraction"], torch.tensor(2 / 6, dtype=torch.float64))


def test_dapo_hand_computed_asymmetric_clip():
    loss, grad, metrics = _loss_and_grad(dapo_loss, ADVANTAGES, clip_low=0.2, clip_high=0.6)
    # Upper bound 1.6 now lets token 0 (ratio 1.5, A > 0) through.
    clipped = [min(r * a, max(min(r, 1.6), 0.8) * a) for r, a in zip(R, A_SEQ, strict=True)]
    assert_close(loss, torch.tensor(-sum(clipped) / 6, dtype=torch.float64))
    live = [1, 1, 1, 1, 1, 0]
    assert_close(grad, _tokens([-r * a / 6 * k for r, a, k in zip(R, A_SEQ, live, strict=True)]))
    assert_close(metrics["clipped_fraction"], torch.tensor(1 / 6, dtype=torch.float64))


def test_grpo_hand_computed_sequence_mean():
    loss, grad, _ = _loss_and_grad(grpo_loss, ADVANTAGES, clip_eps=0.2)
    terms = [min(r * a, max(min(r, 1.2), 0.8) * a) for r, a in zip(R, A_SEQ, strict=True)]
    expected = -(sum(terms[:4]) / 4 + sum(terms[4:]) / 2) / 2
    assert_close(loss, torch.tensor(expected, dtype=torch.float64))
    live = [0, 1, 1, 1, 1, 0]
    lengths = [4, 4, 4, 4, 2, 2]
    want = [-r * a / (2 * n) * k for r, a, n, k in zip(R, A_SEQ, lengths, live, strict=True)]
    assert_close(grad, _tokens(want))


def test_dr_grpo_hand_computed_constant_length():
    loss, grad, _ = _loss_and_grad(dr_grpo_loss, ADVANTAGES, clip_eps=0.2, max_response_length=8)
    terms = [min(r * a, max(min(r, 1.2), 0.8) * a) for r, a in zip(R, A_SEQ, strict=True)]
    assert_close(loss, torch.tensor(-sum(terms) / (2 * 8), dtype=torch.float64))
    live = [0, 1, 1, 1, 1, 0]
    assert_close(grad, _tokens([-r * a / 16 * k for r, a, k in zip(R, A_SEQ, live, strict=True)]))


def test_cispo_hand_computed():
    loss, grad, metrics = _loss_and_grad(cispo_loss, ADVANTAGES, clip_low=0.2, clip_high=0.2)
    weights = [max(min(r, 1.2), 0.8) for r in R]
    expected = -sum(w * a * lp for w, a, lp in zip(weights, A_SEQ, LP, strict=True)) / 6
    assert_close(loss, torch.tensor(expected, dtype=torch.float64))
    # Every token keeps its gradient, scaled by the detached clipped weight.
    assert_close(grad, _tokens([-w * a / 6 for w, a in zip(weights, A_SEQ, strict=True)]))
    assert_close(metrics["clipped_fraction"], torch.tensor(4 / 6, dtype=torch.float64))


def test_gspo_hand_computed():
    loss, grad, metrics = _loss_and_grad(gspo_loss, ADVANTAGES, clip_low=0.1, clip_high=0.1)
    s0 = math.prod(R[:4]) ** (1 / 4)  # ~0.93: inside [0.9, 1.1]
    s1 = math.prod(R[4:]) ** (1 / 2)  # ~1.18: above 1.1, A < 0 -> not clipped (min picks s A)
    expected = (
        -(min(s0 * 1.0, max(min(s0, 1.1), 0.9) * 1.0) + min(s1 * -2.0, max(min(s1, 1.1), 0.9) * -2.0)) / 2
    )
    assert_close(loss, torch.tensor(expected, dtype=torch.float64))
    # grad of -s_i A_i / num_sequences w.r.t. log pi_it is -s_i A_i / (|y_i| num_sequences).
    want = [-s0 * 1.0 / 8] * 4 + [-s1 * -2.0 / 4] * 2
    assert_close(grad, _tokens(want))
    assert_close(metrics["ratio_max"], torch.tensor(s1, dtype=torch.float64))


def test_gspo_clipped_sequence_has_no_gradient():
    _, grad, metrics = _loss_and_grad(gspo_loss, torch.tensor([1.0, 2.0], dtype=torch.float64))
    # Defaults clip to [1 - 3e-4, 1 + 4e-4]: both sequences are outside; with A > 0 the second
    # (s ~ 1.18) is clipped, the first (s ~ 0.93, below the range) keeps its gradient.
    assert (grad[1] == 0).all() and (grad[0, :4] != 0).all()
    assert_close(metrics["clipped_fraction"], torch.tensor(2 / 6, dtype=torch.float64))


def test_aipo_sequence_hand_computed():
    loss, grad, metrics = _loss_and_grad(aipo_sequence_loss, ADVANTAGES, rho=1.2)
    w0 = min(math.prod(R[:4]), 1.2)  # ~0.74
    w1 = min(math.prod(R[4:]), 1.2)  # 1.4 -> 1.2
    weights = [w0] * 4 + [w1] * 2
    expected = -sum(w * a * lp for w, a, lp in zip(weights, A_SEQ, LP, strict=True)) / 6
    assert_close(loss, torch.tensor(expected, dtype=torch.float64))
    assert_close(grad, _tokens([-w * a / 6 for w, a in zip(weights, A_SEQ, strict=True)]))
    assert_close(metrics["truncated_fraction"], torch.tensor(0.5, dtype=torch.float64))


# ---- reductions that should coincide ---------------------------------------------------------------


def test_aipo_without_truncation_on_policy_is_reinforce_with_group_mean_baseline():
    gen = torch.Generator().manual_seed(5)
    logprobs_BT = (-torch.rand(6, 4, generator=gen, dtype=torch.float64)).requires_grad_()
    mask_BT = (torch.rand(6, 4, generator=gen) > 0.3).long()
    rewards_B = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 0.0], dtype=torch.float64)
    advantages_B = group_mean_advantages(rewards_B, 3)
    n = int(mask_BT.sum())
    aipo, _ = aipo_loss(
        logprobs_BT, logprobs_BT.detach(), advantages_B, mask_BT, rho=math.inf, num_valid_tokens=n
    )
    (aipo_grad,) = torch.autograd.grad(aipo, logprobs_BT)
    # REINFORCE with the group-mean baseline, written out: -(1/N) sum (r_i - mean_group r) log pi.
    baseline_B = rewards_B.view(2, 3).mean(-1).repeat_interleave(3)
    reinforce = -(((rewards_B - baseline_B)[:, None] * logprobs_BT) * mask_BT).sum() / n
    (reinforce_grad,) = torch.autograd.grad(reinforce, logprobs_BT)
    assert_close(aipo, reinforce)
    assert_close(aipo_grad, reinforce_grad)


def test_ppo_clip_at_ratio_one_is_the_plain_policy_gradient(batch):
    logprobs_BT, _, advantages_B, mask_BT = batch
    counts = _counts(mask_BT)
    ppo, _ = ppo_clip_loss(logprobs_BT, logprobs_BT.detach(), advantages_B, mask_BT, **counts)
    (ppo_grad,) = torch.autograd.grad(ppo, logprobs_BT)
    pg, _ = policy_gradient_loss(logprobs_BT, logprobs_BT.detach(), advantages_B, mask_BT, **counts)
    (pg_grad,) = torch.autograd.grad(pg, logprobs_BT)
    assert_close(ppo_grad, pg_grad)
    # The value is the surrogate at ratio 1: minus the token mean of the advantage.
    expected = -(advantages_B[:, None] * mask_BT).sum() / counts["num_valid_tokens"]
    assert_close(ppo, expected)


def test_dapo_with_symmetric_clip_is_ppo_clip(batch):
    logprobs_BT, behavior_BT, advantages_B, mask_BT = batch
    ppo, _ = ppo_clip_loss(logprobs_BT, behavior_BT, advantages_B, mask_BT, clip_eps=0.1, **_counts(mask_BT))
    dapo, _ = dapo_loss(
        logprobs_BT, behavior_BT, advantages_B, mask_BT, clip_low=0.1, clip_high=0.1, **_counts(mask_BT)
    )
    assert_close(dapo, ppo)


def test_cispo_with_upper_bound_only_is_aipo(batch):
    logprobs_BT, behavior_BT, advantages_B, mask_BT = batch
    cispo, _ = cispo_loss(
        logprobs_BT, behavior_BT, advantages_B, mask_BT, clip_low=1.0, clip_high=0.1, **_counts(mask_BT)
    )
    aipo, _ = aipo_loss(logprobs_BT, behavior_BT, advantages_B, mask_BT, rho=1.1, **_counts(mask_BT))
    assert_close(cispo, aipo)


def test_dr_grpo_equals_grpo_when_every_sequence_has_full_length(make_batch):
    logprobs_BT, behavior_BT, advantages_B, _ = make_batch()
    mask_BT = torch.ones(4, 5, dtype=torch.int64)
    grpo, _ = grpo_loss(logprobs_BT, behavior_BT, advantages_B, mask_BT, **_counts(mask_BT))
    dr_grpo, _ = dr_grpo_loss(logprobs_BT, behavior_BT, advantages_B, mask_BT, **_counts(mask_BT))
    assert_close(dr_grpo, grpo)


def test_gspo_on_single_token_sequences_is_grpo(make_batch):
    logprobs_BT, behavior_BT, advantages_B, _ = make_batch(tokens=1)
    mask_BT = torch.ones(4, 1, dtype=torch.int64)
    counts = _counts(mask_BT)
    gspo, _ = gspo_loss(
        logprobs_BT, behavior_BT, advantages_B, mask_BT, clip_low=0.1, clip_high=0.1, **counts
    )
    (gspo_grad,) = torch.autograd.grad(gspo, logprobs_BT)
    grpo, _ = grpo_loss(logprobs_BT, behavior_BT, advantages_B, mask_BT, clip_eps=0.1, **counts)
    (grpo_grad,) = torch.autograd.grad(grpo, logprobs_BT)
    assert_close(gspo, grpo)
    assert_close(gspo_grad, grpo_grad)


def test_aipo_sequence_on_single_token_sequences_is_aipo(make_batch):
    logprobs_BT, behavior_BT, advantages_B, _ = make_batch(tokens=1, spread=1.0)
    mask_BT = torch.ones(4, 1, dtype=torch.int64)
    seq, _ = aipo_sequence_loss(logprobs_BT, behavior_BT, advantages_B, mask_BT, rho=1.5, num_valid_tokens=4)
    tok, _ = aipo_loss(logprobs_BT, behavior_BT, advantages_B, mask_BT, rho=1.5, num_valid_tokens=4)
    assert_close(seq, tok)


# ---- hyper-parameter checks, boundaries, empty sequences, saturated metrics -----------------------


@pytest.mark.parametrize("loss_fn", [aipo_loss, aipo_sequence_loss])
def test_rho_must_be_positive_and_one_is_allowed(loss_fn, batch):
    logprobs_BT, behavior_BT, advantages_B, mask_BT = batch
    n = int(mask_BT.sum())
    for rho in (0.0, -1.0):
        with pytest.raises(ValueError, match=f"rho must be positive, got {rho}"):
            loss_fn(logprobs_BT, behavior_BT, advantages_B, mask_BT, rho=rho, num_valid_tokens=n)
    # rho = 1: no token (or sequence) is ever weighted up; on-policy this is the plain policy gradient.
    loss, metrics = loss_fn(
        logprobs_BT, logprobs_BT.detach(), advantages_B, mask_BT, rho=1.0, num_valid_tokens=n
    )
    plain, _ = policy_gradient_loss(
        logprobs_BT, logprobs_BT.detach(), advantages_B, mask_BT, num_valid_tokens=n
    )
    assert_close(loss, plain)
    # A weight exactly at the cap is not truncated: truncation changed nothing.
    assert metrics["truncated_fraction"].item() == 0.0


def _with_an_empty_sequence():
    # Sequence 0: ratios 2 and 0.5 (sequence ratio 1); sequence 1: all padding; sequence 2: ratio 1.5.
    logprobs_BT = torch.tensor([[-1.0, -2.0], [-3.0, -3.0], [-0.5, -7.0]], dtype=torch.float64)
    ratios_BT = torch.tensor([[2.0, 0.5], [1.0, 1.0], [1.5, 1.0]], dtype=torch.float64)
    mask_BT = torch.tensor([[1, 1], [0, 0], [1, 0]])
    return logprobs_BT.requires_grad_(), logprobs_BT - ratios_BT.log(), mask_BT


def test_sequence_metrics_count_only_sequences_with_tokens():
    logprobs_BT, behavior_BT, mask_BT = _with_an_empty_sequence()
    advantages_B = torch.tensor([1.0, 5.0, -1.0], dtype=torch.float64)
    _, metrics = aipo_sequence_loss(
        logprobs_BT, behavior_BT, advantages_B, mask_BT, rho=1.2, num_valid_tokens=3
    )
    assert_close(metrics["ratio_mean"], torch.tensor(1.25, dtype=torch.float64))
    assert_close(metrics["ratio_max"], torch.tensor(1.5, dtype=torch.float64))
    assert_close(metrics["truncated_fraction"], torch.tensor(0.5, dtype=torch.float64))
    # GSPO: geometric means sqrt(2 * 0.5) = 1 and 1.5.
    _, metrics = gspo_loss(logprobs_BT, behavior_BT, advantages_B, mask_BT, num_sequences=3)
    assert set(metrics) == {"ratio_mean", "ratio_max", "clipped_fraction", "mismatch_kl"}
    assert_close(metrics["ratio_mean"], torch.tensor(1.25, dtype=torch.float64))
    assert_close(metrics["ratio_max"], torch.tensor(1.5, dtype=torch.float64))


def test_mismatch_kl_metric_saturates_at_the_log_ratio_limit():
    # pi / mu = e^-30 on one token: its log-ratio counts as -20 (LOG_RATIO_LIMIT), as everywhere else.
    logprobs_BT = torch.tensor([[-31.0, -1.0]], dtype=torch.float64, requires_grad=True)
    behavior_BT = torch.tensor([[-1.0, -1.0]], dtype=torch.float64)
    _, metrics = aipo_loss(
        logprobs_BT, behavior_BT, torch.ones(1, dtype=torch.float64), torch.ones(1, 2), num_valid_tokens=2
    )
    k3 = (math.exp(-20) - 1 + 20) / 2
    assert_close(metrics["mismatch_kl"], torch.tensor(k3, dtype=torch.float64))


def test_dr_grpo_needs_a_length_constant():
    logprobs_BT, behavior_BT, mask_BT = _with_an_empty_sequence()
    with pytest.raises(ValueError, match=r"^dr_grpo needs max_response_length or num_valid_tokens$"):
        dr_grpo_loss(logprobs_BT, behavior_BT, torch.ones(3, dtype=torch.float64), mask_BT, num_sequences=3)
