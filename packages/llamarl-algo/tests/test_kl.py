"""KL estimators and the KL penalty."""

import math

import pytest
import torch
from llamarl_algo_testing import assert_close

from llamarl.algo import KL_ESTIMATORS, kl_k1, kl_k2, kl_k3, kl_penalty_loss


def test_kl_estimators_hand_computed():
    logprobs_BT = torch.tensor([[-1.0, -2.0]], dtype=torch.float64)
    ref_BT = torch.tensor([[-1.5, -1.0]], dtype=torch.float64)
    # log r = ref - logp = [-0.5, 1.0]
    assert_close(kl_k1(logprobs_BT, ref_BT), torch.tensor([[0.5, -1.0]], dtype=torch.float64))
    assert_close(kl_k2(logprobs_BT, ref_BT), torch.tensor([[0.125, 0.5]], dtype=torch.float64))
    k3 = [math.exp(-0.5) - 1 + 0.5, math.e - 1 - 1.0]
    assert_close(kl_k3(logprobs_BT, ref_BT), torch.tensor([k3], dtype=torch.float64))


def test_kl_estimators_match_the_exact_kl_in_expectation():
    # KL(pi || ref) for two categoricals, estimated from tokens sampled from pi.
    gen = torch.Generator().manual_seed(0)
    pi = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    ref = torch.tensor([0.4, 0.4, 0.2], dtype=torch.float64)
    exact = (pi * (pi / ref).log()).sum()
    tokens = torch.multinomial(pi, 200_000, replacement=True, generator=gen)
    logprobs, ref_logprobs = pi.log()[tokens][None], ref.log()[tokens][None]
    assert_close(kl_k1(logprobs, ref_logprobs).mean(), exact, atol=2e-3, rtol=0)
    assert_close(kl_k3(logprobs, ref_logprobs).mean(), exact, atol=2e-3, rtol=0)
    # k2 is biased but close for nearby distributions.
    assert_close(kl_k2(logprobs, ref_logprobs).mean(), exact, atol=5e-3, rtol=0)


@pytest.mark.parametrize("estimator", list(KL_ESTIMATORS))
def test_kl_penalty_gradient_masking_extremes_and_micro_batches(estimator):
    gen = torch.Generator().manual_seed(1)
    logprobs_BT = (-torch.rand(4, 3, generator=gen, dtype=torch.float64) * 2).requires_grad_()
    ref_BT = logprobs_BT.detach() + 0.3 * torch.randn(4, 3, generator=gen, dtype=torch.float64)
    mask_BT = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0], [0, 0, 0]])
    assert torch.autograd.gradcheck(
        lambda lp: kl_penalty_loss(lp, ref_BT, mask_BT, estimator=estimator, coef=0.5, num_valid_tokens=6)[0],
        (logprobs_BT,),
    )
    full, metrics = kl_penalty_loss(logprobs_BT, ref_BT, mask_BT, estimator=estimator, num_valid_tokens=6)
    parts = sum(
        kl_penalty_loss(logprobs_BT[s], ref_BT[s], mask_BT[s], estimator=estimator, num_valid_tokens=6)[0]
        for s in (slice(0, 2), slice(2, 4))
    )
    assert_close(parts, full)
    assert_close(metrics[f"kl_{estimator}"], full)
    # Closed-form gradients per valid token: k1: 1, k2: logp - ref, k3: 1 - ref/pi.
    (grad,) = torch.autograd.grad(full, logprobs_BT)
    diff_BT = (logprobs_BT - ref_BT).detach()
    closed = {"k1": torch.ones_like(diff_BT), "k2": diff_BT, "k3": 1 - torch.exp(-diff_BT)}[estimator]
    assert_close(grad, closed * mask_BT / 6)
    padding_BT = ~mask_BT.bool()
    garbage_BT = torch.where(padding_BT, -torch.inf, logprobs_BT.detach()).requires_grad_()
    masked, _ = kl_penalty_loss(
        garbage_BT,
        torch.where(padding_BT, torch.nan, ref_BT),
        mask_BT,
        estimator=estimator,
        num_valid_tokens=6,
    )
    assert_close(masked, full.detach())
    (masked_grad,) = torch.autograd.grad(masked, garbage_BT)
    assert_close(masked_grad, grad)
    extreme, _ = kl_penalty_loss(
        torch.tensor([[-1e4, 0.0]], requires_grad=True),
        torch.tensor([[0.0, -1e4]]),
        torch.ones(1, 2),
        estimator=estimator,
        num_valid_tokens=2,
    )
    assert torch.isfinite(extreme)
    with pytest.raises(ValueError, match="k1, k2, k3"):
        kl_penalty_loss(logprobs_BT, ref_BT, mask_BT, estimator="k4", num_valid_tokens=6)


def test_kl_penalty_defaults_to_k3():
    logprobs_BT = torch.tensor([[-1.0, -2.0]], dtype=torch.float64)
    ref_BT = torch.tensor([[-1.5, -1.0]], dtype=torch.float64)
    mask_BT = torch.ones(1, 2)
    loss, metrics = kl_penalty_loss(logprobs_BT, ref_BT, mask_BT, num_valid_tokens=2)
    assert set(metrics) == {"kl_k3"}
    assert_close(loss, kl_k3(logprobs_BT, ref_BT).mean())


def test_log_ratios_saturate_at_the_limit_on_both_sides():
    # A token 100 nats less likely under the reference counts as 20 nats (LOG_RATIO_LIMIT), not 100:
    # one such token would otherwise dominate the batch's penalty.
    logprobs_BT = torch.tensor([[-1.0, -101.0]], dtype=torch.float64)
    ref_BT = torch.tensor([[-101.0, -1.0]], dtype=torch.float64)
    # log r = ref - logp = [-100, 100] -> clamped to [-20, 20]
    assert_close(kl_k1(logprobs_BT, ref_BT), torch.tensor([[20.0, -20.0]], dtype=torch.float64))
    assert_close(kl_k2(logprobs_BT, ref_BT), torch.tensor([[200.0, 200.0]], dtype=torch.float64))
    k3 = [math.exp(-20) - 1 + 20, math.exp(20) - 1 - 20]
    assert_close(kl_k3(logprobs_BT, ref_BT), torch.tensor([k3], dtype=torch.float64))
