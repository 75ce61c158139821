"""bf16 mixed precision on one rank (a bf16 compute copy of float32 master weights) against float32 on the
same batch, and bf16 generation: the stated tolerances.

Tolerances (the tiny random Llama, 2 layers, hidden 32): the loss within 2% of float32's or 5e-4, the whole
gradient within 2% (relative L2) and at cosine > 0.999 of float32's; per-token log-probs within 0.1 nat.
"""

from __future__ import annotations

import pytest
import torch

from llamarl.exec import HFGenerator, PolicyTrainer, SamplingConfig
from llamarl.exec.testing import TINY_EOS_TOKEN_ID, build_trainer

PROMPTS = [[1, 5, 9, 13, 17], [1, 7], [1, 3, 4, 30, 31, 32, 33, 8]]
TEMPERATURE = 0.8


@pytest.fixture(scope="module")
def batch(tiny_model_dir):
    """3 prompts x 2 samples of the tiny model, rewards 1 for the first sample of each."""
    gen = HFGenerator(
        str(tiny_model_dir),
        SamplingConfig(temperature=TEMPERATURE),
        seed=3,
        eos_token_ids=[TINY_EOS_TOKEN_ID],
    )
    gen.setup()
    rollout = gen.generate(PROMPTS, samples_per_prompt=2, max_new_tokens=12)
    gen.close()
    rollout.rewards_B = torch.tensor([1.0, 0.0] * len(PROMPTS))
    return rollout


def _trainer(tiny_model_dir, **overrides) -> PolicyTrainer:
    config = dict(temperature=TEMPERATURE, lr=1e-2, seed=0, pack_tokens=64)
    config.update(overrides)
    trainer = build_trainer(str(tiny_model_dir), **config)
    trainer.setup()
    return trainer


def _flat_grad(trainer: PolicyTrainer) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in trainer.model.parameters()])


def test_bf16_loss_and_gradients_stay_within_tolerance_of_fp32(tiny_model_dir, batch):
    fp32 = _trainer(tiny_model_dir)
    bf16 = _trainer(tiny_model_dir, compute_dtype="bfloat16")
    metrics32, metrics16 = fp32.accumulate_gradients(batch), bf16.accumulate_gradients(batch)
    # The compute copy is bf16, the master weights and their gradients float32.
    assert {p.dtype for p in bf16.compute_model.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in bf16.model.parameters()} == {torch.float32}
    assert {p.grad.dtype for p in bf16.model.parameters()} == {torch.float32}
    assert all(p.grad is None for p in bf16.compute_model.parameters())  # moved into the masters
    # The loss sums per-token terms of size ~0.5 that nearly cancel (each group's advantages sum to zero),
    # so its bf16 error is absolute, not relative to the small sum: 5e-4 (measured 1.5e-4 on this batch).
    assert metrics16["loss"] == pytest.approx(metrics32["loss"], rel=2e-2, abs=5e-4)
    assert metrics16["entropy_mean"] == pytest.approx(metrics32["entropy_mean"], rel=2e-2)
    g32, g16 = _flat_grad(fp32), _flat_grad(bf16)
    assert float((g16 - g32).norm() / g32.norm()) < 2e-2  # (measured: 0.5%)
    assert float(torch.nn.functional.cosine_similarity(g16, g32, dim=0)) > 0.999
    # bf16 really computed: the log-probs differ from float32's, a little.
    difference = (bf16.compute_logprobs(batch) - fp32.compute_logprobs(batch)).abs().max()
    assert 0 < difference < 0.1, difference


@pytest.mark.parametrize("compute_dtype", [None, "bfloat16"])
def test_activation_checkpointing_gives_the_gradients_of_kept_activations(
    tiny_model_dir, batch, compute_dtype
):
    """On by default: the compute copy recomputes each layer in backward, to the same gradients."""
    kept = _trainer(tiny_model_dir, compute_dtype=compute_dtype, activation_checkpointing=False)
    recomputed = _trainer(tiny_model_dir, compute_dtype=compute_dtype)
    assert recomputed.compute_model.is_activation_checkpointing
    assert not kept.compute_model.is_activation_checkpointing
    kept.accumulate_gradients(batch)
    recomputed.accumulate_gradients(batch)
    torch.testing.assert_close(_flat_grad(recomputed), _flat_grad(kept), rtol=0, atol=0)


def test_bf16_micro_batches_accumulate_in_float32(tiny_model_dir, batch):
    """Micro-batch gradients are summed into the float32 master gradient, so splitting the batch changes
    the gradient only by bf16's per-pass rounding, not by a bf16 accumulation."""
    whole = _trainer(tiny_model_dir, compute_dtype="bfloat16", pack_tokens=0, micro_batch_size=6)
    split = _trainer(tiny_model_dir, compute_dtype="bfloat16", pack_tokens=0, micro_batch_size=1)
    whole.accumulate_gradients(batch)
    split.accumulate_gradients(batch)
    g_whole, g_split = _flat_grad(whole), _flat_grad(split)
    assert float((g_split - g_whole).norm() / g_whole.norm()) < 2e-2


def test_bf16_training_steps_update_the_float32_masters_and_the_compute_copy(tiny_model_dir, batch):
    trainer = _trainer(tiny_model_dir, compute_dtype="bfloat16")
    before = trainer.compute_logprobs(batch).sum(1)
    initial = [p.detach().clone() for p in trainer.model.parameters()]
    for _ in range(3):
        metrics = trainer.train_step(batch)
    assert metrics["policy_version"] == 3 and metrics["grad_norm"] > 0
    state_dtypes = {t.dtype for s in trainer.optimizer.state.values() for t in s.values() if t.dim() > 0}
    assert state_dtypes == {torch.float32}
    # The masters moved by steps far below bf16's resolution too (lr 1e-2 on weights of ~0.02).
    moved = [p for p, p0 in zip(trainer.model.parameters(), initial, strict=True) if not torch.equal(p, p0)]
    assert len(moved) == len(initial)
    after = trainer.compute_logprobs(batch).sum(1)  # refreshes the compute copy from the masters
    for master, compute in zip(trainer.model.parameters(), trainer.compute_model.parameters(), strict=True):
        assert torch.equal(compute, master.detach().to(torch.bfloat16))
    # Rewarded first samples gained probability against their unrewarded siblings (the learning signal).
    gain = after - before
    assert float(gain[0::2].mean()) > float(gain[1::2].mean())


def test_bf16_generator_samples_in_bf16_and_matches_the_bf16_trainer(tiny_model_dir):
    gen = HFGenerator(
        str(tiny_model_dir),
        SamplingConfig(temperature=TEMPERATURE),
        dtype="bfloat16",
        seed=3,
        eos_token_ids=[TINY_EOS_TOKEN_ID],
    )
    gen.setup()
    assert {p.dtype for p in gen.model.parameters()} == {torch.bfloat16}
    rollout = gen.generate(PROMPTS, samples_per_prompt=2, max_new_tokens=12)
    gen.close()
    trainer = _trainer(tiny_model_dir, compute_dtype="bfloat16")
    mask = rollout.completion_mask_BC.bool()
    difference = (trainer.compute_logprobs(rollout) - rollout.behavior_logprobs_BC)[mask].abs()
    # Cached decoding against one packed forward, both in bf16: close, as the fp32 pair is closer.
    assert float(difference.max()) < 0.1, difference.max()
