"""Property-based tests: invariants of the algo functions over generated inputs (hypothesis).

The profiles in conftest.py keep every test deterministic and bounded. Tensor values come from a torch
generator seeded by a drawn integer; shapes, lengths, splits and hyper-parameters are drawn directly, so
hypothesis explores the edges (one token, empty sequences, one-row parts, chunk sizes of 1).
"""

import math

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st
from llamarl_algo_testing import assert_close

from llamarl.algo import (
    ADVANTAGE_NAMES,
    KL_ESTIMATORS,
    MISMATCH_MODES,
    POLICY_LOSS_NAMES,
    get_advantage_estimator,
    get_policy_loss,
    kl_penalty_loss,
    mismatch_weights,
    token_logprobs,
)
from llamarl.algo.logprobs import _chunks
from llamarl.algo.masking import LOG_RATIO_LIMIT

seeds = st.integers(0, 2**31 - 1)


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---- policy losses: micro-batches and data-parallel parts add up ------------------------------------


@st.composite
def loss_batches(draw):
    """A right-padded float64 batch, [B] or [B, T] advantages, and an assignment of rows to parts."""
    batch = draw(st.integers(1, 6))
    tokens = draw(st.integers(1, 6))
    lengths = draw(
        st.lists(st.integers(0, tokens), min_size=batch, max_size=batch).filter(lambda ls: sum(ls) > 0)
    )
    gen = _generator(draw(seeds))
    # Spreads from on-policy (ratio 1, the clip kinks) to far off-policy (ratios of e^+-6).
    spread = draw(st.sampled_from([0.0, 0.1, 0.5, 2.0]))
    logprobs_BT = -torch.rand(batch, tokens, generator=gen, dtype=torch.float64) * 3
    behavior_BT = logprobs_BT + spread * torch.randn(batch, tokens, generator=gen, dtype=torch.float64)
    mask_BT = (torch.arange(tokens)[None, :] < torch.tensor(lengths)[:, None]).long()
    shape = (batch, tokens) if draw(st.booleans()) else (batch,)
    advantages = torch.randn(shape, generator=gen, dtype=torch.float64)
    # Any assignment of rows to parts: contiguous micro-batches, strided data-parallel shards, or both.
    part_of_row = draw(st.lists(st.integers(0, 3), min_size=batch, max_size=batch))
    return logprobs_BT.requires_grad_(), behavior_BT, advantages, mask_BT, part_of_row


@pytest.mark.parametrize("name", POLICY_LOSS_NAMES)
@given(
    data=loss_batches(),
    mode=st.sampled_from([None, *MISMATCH_MODES]),
    trim=st.booleans(),
    max_response_length=st.sampled_from([None, 8]),
)
def test_parts_sum_to_the_full_batch_loss_and_gradient(name, data, mode, trim, max_response_length):
    logprobs_BT, behavior_BT, advantages, mask_BT, part_of_row = data
    hparams = {"max_response_length": max_response_length} if name == "dr_grpo" else {}
    loss_fn = get_policy_loss(name, mismatch_is=mode, **hparams)
    counts = {"num_valid_tokens": int(mask_BT.sum()), "num_sequences": mask_BT.shape[0]}
    full, _ = loss_fn(logprobs_BT, behavior_BT, advantages, mask_BT, **counts)
    (full_grad,) = torch.autograd.grad(full, logprobs_BT)
    total = torch.zeros((), dtype=torch.float64)
    for part in set(part_of_row):
        rows = torch.tensor([i for i, p in enumerate(part_of_row) if p == part])
        # A trainer may cut a part's all-padding columns: its T differs from the full batch's.
        width = max(int(mask_BT[rows].sum(-1).max()), 1) if trim else mask_BT.shape[1]
        advantages_part = advantages[rows] if advantages.dim() == 1 else advantages[rows, :width]
        loss, _ = loss_fn(
            logprobs_BT[rows, :width],
            behavior_BT[rows, :width],
            advantages_part,
            mask_BT[rows, :width],
            **counts,
        )
        total = total + loss
    (parts_grad,) = torch.autograd.grad(total, logprobs_BT)
    assert_close(total, full.detach())
    assert_close(parts_grad, full_grad)


# ---- advantages --------------------------------------------------------------------------------------


@st.composite
def grouped_rewards(draw, min_group_size=1):
    group_size = draw(st.integers(min_group_size, 5))
    num_groups = draw(st.integers(1, 4))
    # Rewards on a grid of quarters, as rule rewards are (0, 1, 0.5, -0.25): sums stay exact.
    rewards = draw(
        st.lists(st.integers(-40, 40), min_size=group_size * num_groups, max_size=group_size * num_groups)
    )
    shifts = draw(st.lists(st.integers(-400, 400), min_size=num_groups, max_size=num_groups))
    rewards_B = torch.tensor(rewards, dtype=torch.float64) / 4
    shifts_B = (torch.tensor(shifts, dtype=torch.float64) / 4).repeat_interleave(group_size)
    return rewards_B, shifts_B, group_size


@pytest.mark.parametrize("name", ADVANTAGE_NAMES)
@given(data=grouped_rewards())
def test_advantages_ignore_a_constant_added_to_a_groups_rewards(name, data):
    # Every registered estimator is invariant to a per-group offset: each subtracts its group's mean
    # (REINFORCE++-baseline then normalises the group-centred values over the batch).
    rewards_B, shifts_B, group_size = data
    assume(name != "rloo" or group_size >= 2)  # RLOO needs another sample to compare with
    estimator = get_advantage_estimator(name)
    assert_close(estimator(rewards_B + shifts_B, group_size), estimator(rewards_B, group_size), atol=1e-9)


@pytest.mark.parametrize("name", ADVANTAGE_NAMES)
@given(
    data=grouped_rewards(min_group_size=2),
    equal_groups=st.lists(st.booleans(), min_size=4, max_size=4),
    value=st.floats(-1e3, 1e3, allow_subnormal=False),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
)
def test_a_group_of_equal_rewards_gets_zero_advantages(name, data, equal_groups, value, dtype):
    # Exactly zero, in every dtype and for any value: a plain mean of G equal float32 rewards can round
    # one unit in the last place away from them, which the std normalisation (std ~ 1 ulp, eps 1e-6)
    # would blow up to advantages of order 1 for a group that carries no signal.
    rewards_B, _, group_size = data
    rewards_PG = rewards_B.view(-1, group_size).clone()
    equal_P = torch.tensor(equal_groups[: rewards_PG.shape[0]])
    rewards_PG[equal_P] = value
    advantages_PG = get_advantage_estimator(name)(rewards_PG.reshape(-1).to(dtype), group_size).view_as(
        rewards_PG
    )
    assert torch.isfinite(advantages_PG).all()
    assert (advantages_PG[equal_P] == 0).all(), advantages_PG


# ---- KL estimators -----------------------------------------------------------------------------------

logprob_values = st.one_of(
    st.floats(-30.0, 0.0, allow_subnormal=False), st.sampled_from([-1e4, -1e-9, 0.0, -LOG_RATIO_LIMIT])
)


@st.composite
def logprob_pairs(draw, max_tokens=6):
    tokens = draw(st.integers(1, max_tokens))
    rows = [draw(st.lists(logprob_values, min_size=tokens, max_size=tokens)) for _ in range(2)]
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    return torch.tensor([rows[0]], dtype=dtype), torch.tensor([rows[1]], dtype=dtype)


@pytest.mark.parametrize("estimator", ["k2", "k3"])
@given(pair=logprob_pairs())
def test_k2_and_k3_are_non_negative(estimator, pair):
    # Documented in kl.py: k2 and k3 are >= 0 for every token (k1 can be negative).
    logprobs_BT, ref_BT = pair
    kl_BT = KL_ESTIMATORS[estimator](logprobs_BT, ref_BT)
    assert torch.isfinite(kl_BT).all() and (kl_BT >= 0).all(), kl_BT
    loss, _ = kl_penalty_loss(
        logprobs_BT, ref_BT, torch.ones_like(logprobs_BT), estimator=estimator, num_valid_tokens=3
    )
    assert loss >= 0


# ---- mismatch weights --------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MISMATCH_MODES)
@given(
    old_and_behavior=logprob_pairs(max_tokens=40),
    cap=st.one_of(st.floats(1e-3, 10.0), st.just(math.inf)),
    seed=seeds,
)
def test_mismatch_weights_are_bounded_by_the_cap(mode, old_and_behavior, cap, seed):
    trainer_old_BT, behavior_BT = old_and_behavior
    mask_BT = (torch.rand(trainer_old_BT.shape, generator=_generator(seed)) < 0.8).long()
    weights, metrics = mismatch_weights(trainer_old_BT, behavior_BT, mask_BT, mode=mode, cap=cap)
    # Finite even with cap = inf: the log-ratios are clamped before exp.
    assert torch.isfinite(weights).all()
    assert (weights >= 0).all() and (weights <= cap).all()
    assert (weights <= math.exp(LOG_RATIO_LIMIT) * (1 + 1e-6)).all()
    assert all(torch.isfinite(v) for v in metrics.values()), metrics
    if mode == "token_truncate":
        # Padding counts as ratio 1, so it is never the token that decides anything.
        log_ratio_BT = (trainer_old_BT - behavior_BT).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
        log_ratio_BT = torch.where(mask_BT.bool(), log_ratio_BT, torch.zeros_like(log_ratio_BT))
        assert_close(weights, log_ratio_BT.exp().clamp(max=cap))


# ---- token log-probs ---------------------------------------------------------------------------------


@given(
    batch=st.integers(1, 4),
    tokens=st.integers(0, 6),
    vocab=st.integers(1, 9),
    chunk_size=st.integers(1, 40),
    temperature=st.sampled_from([0.5, 1.0, 1.7]),
    seed=seeds,
)
def test_token_logprobs_match_log_softmax_for_any_chunk_size(
    batch, tokens, vocab, chunk_size, temperature, seed
):
    gen = _generator(seed)
    logits_BTV = (torch.randn(batch, tokens, vocab, generator=gen, dtype=torch.float64) * 4).requires_grad_()
    token_ids_BT = torch.randint(0, vocab, (batch, tokens), generator=gen)
    weights_BT = torch.randn(batch, tokens, generator=gen, dtype=torch.float64)
    logprobs_BT = token_logprobs(logits_BTV, token_ids_BT, temperature=temperature, chunk_size=chunk_size)
    (grad,) = torch.autograd.grad((logprobs_BT * weights_BT).sum(), logits_BTV)
    reference_BTV = logits_BTV.detach().requires_grad_()
    log_softmax_BTV = torch.log_softmax(reference_BTV / temperature, dim=-1)
    expected_BT = log_softmax_BTV.gather(-1, token_ids_BT[..., None]).squeeze(-1)
    (expected_grad,) = torch.autograd.grad((expected_BT * weights_BT).sum(), reference_BTV)
    assert_close(logprobs_BT, expected_BT.detach(), rtol=1e-10, atol=1e-10)
    assert_close(grad, expected_grad, rtol=1e-10, atol=1e-10)


@given(batch=st.integers(0, 5), tokens=st.integers(0, 9), chunk_size=st.integers(1, 20))
def test_chunks_cover_every_token_once_within_the_chunk_size(batch, tokens, chunk_size):
    # The memory bound of token_logprobs: each chunk upcasts at most chunk_size tokens, and no token is
    # computed twice.
    covered_BT = torch.zeros(batch, tokens, dtype=torch.int64)
    for chunk in _chunks(batch, tokens, chunk_size):
        covered_BT[chunk] += 1
        assert 0 < covered_BT[chunk].numel() <= chunk_size
    assert (covered_BT == 1).all()
