"""LoRA (peft) in the trainer: only the adapters train; weight syncs carry only them to an hf generator
with the same adapters, which then samples from what the trainer holds; the merged model computes the
same function."""

from __future__ import annotations

import pytest
import torch

from llamarl.comm.testing import run_distributed
from llamarl.exec import HFGenerator, PolicyTrainer, SamplingConfig
from llamarl.exec.config import LoraConfig
from llamarl.exec.lora import adapter_tensors
from llamarl.exec.testing import TINY_EOS_TOKEN_ID, build_trainer

pytestmark = pytest.mark.timeout(300)

PROMPTS = [[1, 5, 9, 13, 17], [1, 7], [1, 3, 4, 30, 31, 32, 33, 8]]
LORA = LoraConfig(rank=4)
NUM_STEPS = 2


@pytest.fixture(scope="module")
def batch(tiny_model_dir):
    gen = HFGenerator(str(tiny_model_dir), SamplingConfig(), seed=3, eos_token_ids=[TINY_EOS_TOKEN_ID])
    gen.setup()
    rollout = gen.generate(PROMPTS, samples_per_prompt=2, max_new_tokens=10)
    gen.close()
    rollout.rewards_B = torch.tensor([1.0, 0.0] * len(PROMPTS))
    return rollout


def _trainer(model_dir: str, **overrides) -> PolicyTrainer:
    config = dict(lr=5e-2, seed=0, pack_tokens=64, lora=LORA)
    config.update(overrides)
    trainer = build_trainer(model_dir, **config)
    trainer.setup()
    return trainer


def test_only_the_adapters_train_and_the_merged_model_computes_the_same(tiny_model_dir, batch):
    trainer = _trainer(str(tiny_model_dir))
    trained = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trained == set(adapter_tensors(trainer.model)) and trained
    assert all(".lora_A." in n or ".lora_B." in n for n in trained)
    frozen_before = {
        n: p.detach().clone() for n, p in trainer.model.named_parameters() if not p.requires_grad
    }
    before = trainer.compute_logprobs(batch)
    for _ in range(NUM_STEPS):
        trainer.train_step(batch)
    after = trainer.compute_logprobs(batch)
    assert not torch.allclose(after, before)  # the policy moved ...
    for name, param in trainer.model.named_parameters():  # ... through the adapters alone
        if name in frozen_before:
            assert torch.equal(param, frozen_before[name]), name
    # AdamW state exists for the adapters only.
    assert len(trainer.optimizer.state) == len(trained)
    # The merged weights, loaded into a plain model (no peft), give the LoRA model's log-probs.
    from transformers import AutoModelForCausalLM

    merged = trainer.full_state_dict()
    assert not any("lora_" in n or "base_layer" in n for n in merged)
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    plain.load_state_dict(merged)
    plain_trainer = build_trainer(str(tiny_model_dir), pack_tokens=64)
    plain_trainer.setup()
    plain_trainer.model.load_state_dict(merged)
    torch.testing.assert_close(plain_trainer.compute_logprobs(batch), after, rtol=1e-4, atol=1e-5)


def test_in_bf16_the_frozen_base_is_held_once_in_bf16_and_the_saved_model_is_float32(tiny_model_dir, batch):
    trainer = _trainer(str(tiny_model_dir), compute_dtype="bfloat16")
    frozen = {n: p for n, p in trainer.model.named_parameters() if not p.requires_grad}
    computed = dict(trainer.compute_model.named_parameters())
    assert frozen and all(p.dtype == torch.bfloat16 for p in frozen.values())
    # No float32 copy of the base: the master's frozen weights are the compute copy's tensors.
    assert all(p.data_ptr() == computed[n].data_ptr() for n, p in frozen.items())
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters() if p.requires_grad)
    before = trainer.compute_logprobs(batch)
    trainer.train_step(batch)
    assert not torch.allclose(trainer.compute_logprobs(batch), before)
    assert {t.dtype for t in trainer.full_state_dict().values()} == {torch.float32}


def _sync_worker(rank: int, world_size: int, rdv, model_dir: str, batch, lora_rank: int, dtype: str):
    """Rank 0 trains (LoRA or full) and sends after each step; rank 1, an hf generator, receives."""
    from llamarl.comm import WeightSender, WeightSyncEndpoint, WeightSyncGroup

    endpoint = WeightSyncEndpoint(
        host=rdv.host, port=rdv.port, rank=0, world_size=2, timeout_s=60, dead_after_s=4.0
    )
    lora = LoraConfig(rank=lora_rank)
    wire = torch.bfloat16 if dtype == "bfloat16" else None
    if rank == 0:
        trainer = _trainer(model_dir, lora=lora, compute_dtype=None if wire is None else dtype, pack_tokens=0)
        group = WeightSyncGroup(endpoint)
        sender = WeightSender(group, trainer.sync_tensors(), wire_dtype=wire)
        stats = []
        for _ in range(NUM_STEPS):
            trainer.train_step(batch)
            stats.append(sender.send(trainer.policy_version))
        logprobs = trainer.compute_logprobs(batch)
        sender.close()
        group.close()
        return {"bytes": stats[-1].bytes, "logprobs": logprobs}
    generator = HFGenerator(
        model_dir, SamplingConfig(), dtype=dtype, lora=lora, seed=0, eos_token_ids=[TINY_EOS_TOKEN_ID]
    )
    generator.setup()
    generator.connect_weight_sync(endpoint.for_rank(1))
    dead_after_s = generator._weights.group.endpoint.dead_after_s
    for _ in range(NUM_STEPS):
        # Sampling between syncs, as a run does: the packed copies of the old weights must not survive.
        generator.generate([[1, 2, 3]], samples_per_prompt=1, max_new_tokens=2)
        version = generator.receive_weights(60)
    with pytest.raises(RuntimeError, match="came from a weight sync"):
        generator.serve_initial_weights()  # its weights are the trainer's now, not the checkpoint
    # What the generator's model now computes, scored by a trainer forward (padded rows, as the trainer
    # scored its own) on the generator's module.
    scorer = build_trainer(model_dir, pack_tokens=0, lora=lora)
    scorer.setup()
    scorer.model = scorer.compute_model = generator.model  # no_grad scoring of the generator's weights
    logprobs = scorer.compute_logprobs(batch)
    generator.close()
    return {"version": version, "logprobs": logprobs, "dead_after_s": dead_after_s}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_adapter_sync_makes_the_generator_compute_what_the_trainer_does(tiny_model_dir, batch, dtype):
    full = run_distributed(_sync_worker, 2, str(tiny_model_dir), batch, 0, dtype, timeout_s=240)
    lora = run_distributed(_sync_worker, 2, str(tiny_model_dir), batch, LORA.rank, dtype, timeout_s=240)
    trainer, generator = lora
    assert generator["version"] == NUM_STEPS
    assert generator["dead_after_s"] == 4.0  # the run's setting reaches the generator's group
    # The generator holds exactly the trainer's adapters (bf16: rounded as the trainer's compute copy
    # rounds them), so it computes the trainer's log-probs.
    tolerance = 1e-5 if dtype == "float32" else 2e-2
    torch.testing.assert_close(generator["logprobs"], trainer["logprobs"], rtol=0, atol=tolerance)
    # The adapters are a small part of the weights: the sync carries only them.
    assert lora[0]["bytes"] < full[0]["bytes"] / 5, (lora[0]["bytes"], full[0]["bytes"])
