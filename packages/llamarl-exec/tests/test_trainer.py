"""PolicyTrainer on a tiny random Llama: micro-batching invariance, learning direction, versions."""

from __future__ import annotations

import pytest
import torch

from llamarl.exec import PolicyTrainer
from llamarl.exec.testing import build_trainer

PROMPTS = [[1, 5, 9, 13, 17], [1, 7], [1, 3, 4, 30, 31, 32, 33, 8]]
TEMPERATURE = 0.8


@pytest.fixture(scope="module")
def batch(tiny_rollout):
    """A rollout of the tiny model (3 prompts x 2 samples) with rewards 1 for the first sample of each."""
    rollout = tiny_rollout(
        PROMPTS, seed=6, temperature=TEMPERATURE
    )  # (a seed whose completions end unevenly)
    rollout.rewards_B = torch.tensor([1.0, 0.0] * len(PROMPTS))
    return rollout


def _trainer(tiny_model_dir, **overrides) -> PolicyTrainer:
    # Padded rows unless a test packs: most tests here are about micro_batch_size.
    config = dict(temperature=TEMPERATURE, lr=1e-2, max_grad_norm=1.0, seed=0, pack_tokens=0)
    config.update(overrides)
    trainer = build_trainer(str(tiny_model_dir), **config)
    trainer.setup()
    return trainer


def test_micro_batches_sum_to_the_full_batch_gradient(tiny_model_dir, batch):
    full = _trainer(tiny_model_dir, micro_batch_size=batch.num_sequences)
    single = _trainer(tiny_model_dir, micro_batch_size=1)
    uneven = _trainer(tiny_model_dir, micro_batch_size=4)  # 4 + 2: a ragged last micro-batch
    metrics = [t.accumulate_gradients(batch) for t in (full, single, uneven)]
    for other, other_metrics in ((single, metrics[1]), (uneven, metrics[2])):
        assert other_metrics["loss"] == pytest.approx(metrics[0]["loss"], rel=1e-5, abs=1e-7)
        assert other_metrics["ratio_mean"] == pytest.approx(metrics[0]["ratio_mean"], rel=1e-5)
        for (name, p_full), p_other in zip(
            full.model.named_parameters(), other.model.parameters(), strict=True
        ):
            torch.testing.assert_close(p_other.grad, p_full.grad, rtol=1e-4, atol=1e-7, msg=name)
    assert any(p.grad.abs().sum() > 0 for p in full.model.parameters())


def test_train_steps_raise_the_logprob_of_a_rewarded_sequence(tiny_model_dir, batch):
    trainer = _trainer(tiny_model_dir, micro_batch_size=2)
    before = trainer.compute_logprobs(batch).sum(1)
    # Fresh weights equal the sampling weights: every importance ratio is 1 (no off-policyness yet).
    first = trainer.train_step(batch)
    assert first["ratio_mean"] == pytest.approx(1.0, abs=1e-4)
    assert first["mismatch_kl"] == pytest.approx(0.0, abs=1e-5)
    for _ in range(2):
        metrics = trainer.train_step(batch)
    after = trainer.compute_logprobs(batch).sum(1)
    assert trainer.policy_version == 3 and metrics["policy_version"] == 3.0
    rewarded = batch.rewards_B > 0
    assert (after[rewarded] > before[rewarded]).all(), (before, after)
    assert (after[~rewarded] < before[~rewarded]).all(), (before, after)
    for key in ("loss", "grad_norm", "tokens_per_s", "reward_mean", "train_s", "ratio_mean", "ratio_max"):
        assert key in metrics and torch.isfinite(torch.tensor(metrics[key])), key
    assert metrics["reward_mean"] == pytest.approx(0.5)
    assert metrics["num_valid_tokens"] == batch.num_completion_tokens


def _gradients_at_the_optimizer_step(trainer: PolicyTrainer) -> dict[str, torch.Tensor]:
    """Fills, at every optimizer step of `trainer`, {name: the gradient the step applies} (after clipping)."""
    seen: dict[str, torch.Tensor] = {}

    def record(optimizer, args, kwargs) -> None:
        seen.update({n: p.grad.detach().clone() for n, p in trainer.model.named_parameters()})

    trainer.optimizer.register_step_pre_hook(record)
    return seen


@pytest.mark.parametrize("max_grad_norm", [1e-3, 1e6], ids=["clipped", "below_the_threshold"])
def test_gradient_clipping_scales_the_applied_gradient_to_the_asked_norm(
    tiny_model_dir, batch, max_grad_norm
):
    trainer = _trainer(tiny_model_dir, micro_batch_size=6, max_grad_norm=max_grad_norm, lr=0.0)
    trainer.optimizer.zero_grad()
    trainer.accumulate_gradients(batch)
    raw = {n: p.grad.clone() for n, p in trainer.model.named_parameters()}
    raw_norm = float(torch.nn.utils.get_total_norm(list(raw.values())))
    assert 1e-3 < raw_norm < 1e6
    applied = _gradients_at_the_optimizer_step(trainer)
    metrics = trainer.train_step(batch)
    assert metrics["grad_norm"] == pytest.approx(raw_norm, rel=1e-4)  # reported before clipping
    applied_norm = float(torch.nn.utils.get_total_norm(list(applied.values())))
    # The optimizer steps with the gradient scaled to the asked norm (same direction), or untouched
    # when its norm is below the threshold.
    scale = min(1.0, max_grad_norm / raw_norm)
    assert applied_norm == pytest.approx(min(raw_norm, max_grad_norm), rel=1e-4)
    for name, grad in raw.items():
        torch.testing.assert_close(applied[name], grad * scale, rtol=1e-4, atol=1e-12, msg=name)


def test_unknown_loss_or_hyperparameter_fails_at_construction(tiny_model_dir):
    with pytest.raises(ValueError, match="aipo"):  # the error lists the valid names
        build_trainer(str(tiny_model_dir), loss="nope")
    with pytest.raises(ValueError, match="no hyper-parameter"):
        build_trainer(str(tiny_model_dir), loss_hparams={"rhoo": 2.0})


def test_shared_prompt_forward_matches_the_full_forward(tiny_model_dir, batch):
    """Running each prompt once per group (keys/values reused) gives the same log-probs and gradients.
    Padded rows share through a KV cache, which activation checkpointing (the default) rules out."""
    kept = {"activation_checkpointing": False}
    shared = _trainer(tiny_model_dir, micro_batch_size=4, share_prompts=True, **kept)  # groups of 2: shared
    full = _trainer(tiny_model_dir, micro_batch_size=4, share_prompts=False, **kept)
    can_share = shared.forward._can_share_prompts
    assert can_share(batch.prompt_ids_BP[:4], batch.prompt_mask_BP[:4], batch.group_size)
    torch.testing.assert_close(
        shared.compute_logprobs(batch), full.compute_logprobs(batch), rtol=1e-5, atol=1e-5
    )
    shared_metrics = shared.accumulate_gradients(batch)
    full_metrics = full.accumulate_gradients(batch)
    assert shared_metrics["loss"] == pytest.approx(full_metrics["loss"], rel=1e-5, abs=1e-7)
    for (name, p_shared), p_full in zip(
        shared.model.named_parameters(), full.model.parameters(), strict=True
    ):
        torch.testing.assert_close(p_shared.grad, p_full.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_prompt_sharing_falls_back_when_a_group_is_split_or_activations_are_recomputed(tiny_model_dir, batch):
    trainer = _trainer(tiny_model_dir, micro_batch_size=3, activation_checkpointing=False)
    # Rows 0..2 hold one whole group and half of the next: not shareable, so the full forward runs.
    can_share = trainer.forward._can_share_prompts
    assert can_share(batch.prompt_ids_BP[:2], batch.prompt_mask_BP[:2], batch.group_size)
    assert not can_share(batch.prompt_ids_BP[:3], batch.prompt_mask_BP[:3], batch.group_size)
    assert not can_share(batch.prompt_ids_BP[1:3], batch.prompt_mask_BP[1:3], 2)
    # Nor under activation checkpointing (the default), which leaves the padded path no KV cache.
    checkpointed = _trainer(tiny_model_dir, micro_batch_size=3).forward._can_share_prompts
    assert not checkpointed(batch.prompt_ids_BP[:2], batch.prompt_mask_BP[:2], batch.group_size)


@pytest.mark.parametrize("share_prompts", [False, True], ids=["one_prompt_per_sample", "shared_prompts"])
def test_packed_micro_batches_match_the_padded_path(tiny_model_dir, batch, monkeypatch, share_prompts):
    """Packing the real tokens into one row per micro-batch gives the padded path's log-probs, loss and
    gradients (the same function of the same tokens; only the order of float sums differs). Packed rows
    go through the per-segment (varlen) attention, with the micro-batch's segments; with shared prompts
    a group's prompt is laid once and its samples' completions branch off it."""
    from llamarl.exec.train import varlen_attention

    lengths = batch.completion_mask_BC.sum(1)
    assert lengths.min() < lengths.max(), "the rollout should have uneven completion lengths"
    padded = _trainer(tiny_model_dir, micro_batch_size=2, share_prompts=False)
    # A budget giving several rows, some with more than one sequence (a shared prompt counts once);
    # activations kept, so that each layer attends once per forward pass (none recomputed in backward).
    packed = _trainer(
        tiny_model_dir,
        pack_tokens=28 if share_prompts else 24,
        share_prompts=share_prompts,
        activation_checkpointing=False,
    )
    assert packed.model.config._attn_implementation == varlen_attention.VARLEN_ATTENTION
    assert padded.model.config._attn_implementation != varlen_attention.VARLEN_ATTENTION
    rows = packed.forward.micro_batches(batch)
    assert len(rows) > 1 and any(r.stop - r.start > 1 for r in rows)  # several rows, some packed
    laid = []  # per layer call: (segments, tokens in the row)
    row_attention = varlen_attention._row_attention

    def spy(*args, **kwargs):
        laid.append((len(args[3]), args[0].shape[1]))
        return row_attention(*args, **kwargs)

    monkeypatch.setattr(varlen_attention, "_row_attention", spy)
    torch.testing.assert_close(
        packed.compute_logprobs(batch), padded.compute_logprobs(batch), rtol=1e-5, atol=1e-5
    )
    padded_metrics = padded.accumulate_gradients(batch)
    packed_metrics = packed.accumulate_gradients(batch)
    assert packed_metrics["loss"] == pytest.approx(padded_metrics["loss"], rel=1e-5, abs=1e-7)
    assert packed_metrics["num_valid_tokens"] == padded_metrics["num_valid_tokens"]
    for (name, p_packed), p_padded in zip(
        packed.model.named_parameters(), padded.model.parameters(), strict=True
    ):
        torch.testing.assert_close(p_packed.grad, p_padded.grad, rtol=1e-4, atol=1e-6, msg=name)
    # Every layer of every packed row attended per sequence, or per group when prompts are shared (2
    # forward passes: log-probs, gradients), over the real tokens only, each shared prompt once.
    prompt_lengths = batch.prompt_mask_BP.sum(1).tolist()
    expected = []
    for r in rows:
        prompts = prompt_lengths[r]
        if share_prompts:  # the fixture's groups are consecutive pairs with one prompt each
            firsts = [i for i in range(r.start, r.stop) if i == r.start or i % batch.group_size == 0]
            num_segments, prompt_tokens = len(firsts), sum(prompt_lengths[i] for i in firsts)
        else:
            num_segments, prompt_tokens = len(prompts), sum(prompts)
        expected.append((num_segments, prompt_tokens + int(lengths[r].sum())))
    num_layers = packed.model.config.num_hidden_layers
    assert laid == [e for e in expected for _ in range(num_layers)] * 2
    assert all(tokens <= packed.config.pack_tokens for _, tokens in expected)
    assert share_prompts == any(n < r.stop - r.start for (n, _), r in zip(expected, rows, strict=True))


def test_token_budget_keeps_order_and_isolates_long_sequences():
    from llamarl.exec.train.packing import token_budget_rows

    assert token_budget_rows([3, 4, 2, 9, 1, 1], 7) == [slice(0, 2), slice(2, 3), slice(3, 4), slice(4, 6)]
    assert token_budget_rows([], 5) == []
    with pytest.raises(ValueError):
        token_budget_rows([1], 0)


def test_token_budget_counts_a_shared_prompt_again_where_a_micro_batch_opens_mid_group():
    from llamarl.exec.train.packing import token_budget_rows

    # One group: a 10-token prompt, five 2-token completions; shared, the samples after the first cost 2.
    shared, alone = [12, 2, 2, 2, 2], [12] * 5
    # Counted as shared everywhere, the second row (prompt laid again + 3 completions = 16) would pass.
    assert token_budget_rows(shared, 15) == [slice(0, 2), slice(2, 5)]
    rows = token_budget_rows(shared, 15, opening_lengths=alone)
    assert rows == [slice(0, 2), slice(2, 4), slice(4, 5)]
    assert all(alone[r.start] + sum(shared[r.start + 1 : r.stop]) <= 15 for r in rows)


def test_balanced_rows_give_exactly_the_parts_asked():
    from llamarl.exec.train.packing import balanced_rows

    assert balanced_rows([5, 5, 5, 5], 2) == [slice(0, 2), slice(2, 4)]
    assert balanced_rows([100, 1, 1, 1], 3) == [slice(0, 1), slice(1, 2), slice(2, 4)]
    assert balanced_rows([1, 1, 1, 100], 3) == [slice(0, 2), slice(2, 3), slice(3, 4)]  # 100 alone
    assert balanced_rows([3, 3, 3], 3) == [slice(0, 1), slice(1, 2), slice(2, 3)]
    assert balanced_rows([7, 2], 1) == [slice(0, 2)]
    with pytest.raises(ValueError):
        balanced_rows([1, 2], 3)


def test_kl_penalty_to_a_frozen_reference(tiny_model_dir, batch):
    """The reference starts equal to the policy (KL 0), stays frozen, the KL grows as the policy moves,
    and the penalty adds exactly kl_coef x KL (k3, token mean) to the loss."""
    kl_coef = 0.5
    trainer = _trainer(tiny_model_dir, micro_batch_size=3, kl_coef=kl_coef, kl_estimator="k3")
    plain = _trainer(tiny_model_dir, micro_batch_size=3)
    reference_logprobs = plain.compute_logprobs(batch)  # the initial policy: the reference's
    ref_before = [p.detach().clone() for p in trainer.ref_model.parameters()]
    first = trainer.train_step(batch)
    assert first["kl_k3"] == pytest.approx(0.0, abs=1e-6)
    assert first["loss"] == pytest.approx(plain.train_step(batch)["loss"], rel=1e-5, abs=1e-7)
    # The KL's gradient is 0 where the policy equals the reference: both took the same first step.
    for (name, p_kl), p_plain in zip(trainer.model.named_parameters(), plain.model.parameters(), strict=True):
        torch.testing.assert_close(p_kl, p_plain, rtol=1e-6, atol=1e-7, msg=name)
    # k3 of the moved policy against the reference, averaged over the completion tokens.
    log_ratio = reference_logprobs - trainer.compute_logprobs(batch)
    mask = batch.completion_mask_BC.bool()
    expected_kl = float((torch.expm1(log_ratio) - log_ratio)[mask].mean())
    assert expected_kl > 1e-6
    second = trainer.train_step(batch)
    assert second["kl_k3"] == pytest.approx(expected_kl, rel=1e-3)
    assert all(not p.requires_grad for p in trainer.ref_model.parameters())
    for before, after in zip(ref_before, trainer.ref_model.parameters(), strict=True):
        assert torch.equal(before, after)
    # The penalty is in the loss: the same step without it is lower by exactly kl_coef * KL.
    plain_second = plain.train_step(batch)
    assert second["loss"] - plain_second["loss"] == pytest.approx(kl_coef * expected_kl, rel=1e-3)


def test_lr_schedule_warms_up_then_decays(tiny_model_dir, batch):
    trainer = _trainer(
        tiny_model_dir, micro_batch_size=6, lr=1e-3, lr_schedule="linear", warmup_steps=2, total_steps=4
    )
    lrs = [trainer.train_step(batch)["lr"] for _ in range(5)]
    assert lrs == pytest.approx([1e-3 / 3, 2e-3 / 3, 1e-3, 5e-4, 0.0])
