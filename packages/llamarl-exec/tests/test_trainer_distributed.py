"""PolicyTrainer on 2 trainer ranks (FSDP2 over gloo, one process each) against a single-rank trainer on
the same batch: the same gradient, and after the same steps bitwise the same weights, read by a generator
rank straight from the FSDP2 shards through llamarl.comm. A mixture of experts too (its expert tensors
sharded by FSDP2 like every other; its generator's routes replayed on each rank's part)."""

from __future__ import annotations

import pytest
import torch

from llamarl.comm.testing import run_distributed
from llamarl.exec import PolicyTrainer
from llamarl.exec.testing import build_trainer

pytestmark = pytest.mark.timeout(300)

NUM_TRAINERS = 2
PROMPTS = [[1, 5, 9, 13, 17], [1, 7], [1, 3, 4, 30, 31, 32, 33, 8], [1, 11, 12]]


@pytest.fixture(scope="module")
def moe_model_dir(tmp_path_factory) -> str:
    """A tiny Qwen3-MoE (4 experts, 2 per token), vocab 64 (eos 2, pad 0)."""
    from llamarl.exec.models import tiny_moe_model

    path = tmp_path_factory.mktemp("tiny_moe")
    tiny_moe_model("qwen3_moe", 64, eos_token_id=2, pad_token_id=0, seed=0).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def moe_batch(moe_model_dir):
    """The tiny MoE's rollout of PROMPTS (2 samples each, its routes recorded), rewards as `batch`'s."""
    from llamarl.exec import HFGenerator, SamplingConfig

    generator = HFGenerator(moe_model_dir, SamplingConfig(), seed=5, eos_token_ids=[2, 50])
    generator.setup()
    rollout = generator.generate(PROMPTS, samples_per_prompt=2, max_new_tokens=10)
    generator.close()
    rollout.rewards_B = torch.tensor([1.0, 0.0, 0.0, 1.0] * 2)
    return rollout


MODELS = {"dense": ("tiny_model_dir", "batch"), "moe": ("moe_model_dir", "moe_batch")}


@pytest.fixture(scope="module")
def batch(tiny_rollout):
    """4 prompts x 2 samples of the tiny model, uneven lengths, rewards 1 for the first of each pair."""
    rollout = tiny_rollout(PROMPTS, seed=5)
    rollout.rewards_B = torch.tensor([1.0, 0.0, 0.0, 1.0] * 2)
    return rollout


def _trainer(model_dir: str, group=None, **overrides) -> PolicyTrainer:
    # Half the batch per micro-batch: the single-rank trainer's two micro-batches are the two ranks' parts.
    config = dict(lr=1e-2, seed=0, pack_tokens=0, micro_batch_size=4, share_prompts=False)
    config.update(overrides)
    return build_trainer(model_dir, group=group, **config)


def _single_rank_grads(model_dir: str, batch) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    trainer = _trainer(model_dir)
    trainer.setup()
    metrics = trainer.accumulate_gradients(batch)
    return {n: p.grad.clone() for n, p in trainer.model.named_parameters()}, metrics


def _grad_worker(rank: int, world_size: int, rdv, model_dir: str, batch, overrides: dict):
    import torch.distributed as dist

    from llamarl.exec.train.parallel import full_tensor

    dist.init_process_group("gloo", init_method=rdv.init_method, rank=rank, world_size=world_size)
    group = dist.new_group(list(range(NUM_TRAINERS)))  # the trainer ranks' own group, as in the app
    trainer = _trainer(model_dir, group, **overrides)
    trainer.setup()
    metrics = trainer.accumulate_gradients(batch.data_parallel_part(rank, NUM_TRAINERS))
    grads = {n: full_tensor(p.grad) for n, p in trainer.model.named_parameters()}
    norm = float(full_tensor(torch.nn.utils.clip_grad_norm_(trainer.model.parameters(), 1.0)))
    return (grads, metrics, norm) if rank == 0 else None


def _budget_with_unequal_micro_batches(batch) -> int:
    """A token budget that gives the two ranks' parts different numbers of packed micro-batches."""
    from llamarl.exec.train.packing import sequence_lengths, token_budget_rows

    for budget in range(8, 80):
        counts = set()
        for rank in range(NUM_TRAINERS):
            part = batch.data_parallel_part(rank, NUM_TRAINERS)
            lengths = sequence_lengths(part.prompt_mask_BP, part.completion_mask_BC)
            counts.add(len(token_budget_rows(lengths, budget)))
        if len(counts) > 1:
            return budget
    raise AssertionError("no budget splits the parts unequally; change the batch")


@pytest.mark.parametrize(
    ("layout", "model"),
    [
        *((layout, "dense") for layout in ("padded", "shared", "packed", "packed_shared", "packed_unequal")),
        ("checkpointed", "dense"),
        ("packed_shared", "moe"),
        ("packed_shared", "moe-expert-parallel"),
        ("checkpointed", "moe-expert-parallel"),  # the recompute runs the all-to-alls again, in backward
    ],
)
def test_two_rank_gradient_equals_the_single_rank_gradient(request, layout, model):
    """FSDP2 (and, for a mixture of experts, expert parallelism: each rank holds half the experts and
    the tokens go to them) gives the single rank's gradient, loss and norm."""
    tiny_model_dir, batch = (
        request.getfixturevalue(name) for name in MODELS[model.removesuffix("-expert-parallel")]
    )
    # "packed_unequal": one rank's budget gives it fewer micro-batches; it must split into as many as
    # the other's (FSDP2 runs collectives in every pass), else this would hang until the timeout.
    overrides = {
        "padded": {},
        "shared": {"share_prompts": True},
        "packed": {"pack_tokens": 40},
        "packed_shared": {"pack_tokens": 40, "share_prompts": True},  # each group's prompt laid once
        "packed_unequal": {"pack_tokens": _budget_with_unequal_micro_batches(batch)},
        "checkpointed": {"pack_tokens": 40, "activation_checkpointing": True},  # activation checkpointing
    }[layout]
    if model.endswith("-expert-parallel"):
        overrides = {**overrides, "expert_parallel": True}
    grads, metrics, norm = run_distributed(
        _grad_worker, NUM_TRAINERS, str(tiny_model_dir), batch, overrides, timeout_s=240
    )[0]
    expected, expected_metrics = _single_rank_grads(str(tiny_model_dir), batch)
    assert set(grads) == set(expected)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected[name], rtol=1e-5, atol=1e-7, msg=name)
    expected_norm = float(torch.nn.utils.get_total_norm(list(expected.values())))
    assert norm == pytest.approx(expected_norm, rel=1e-5)
    assert expected_norm > 0
    for key in ("loss", "logprob_mean", "reward_mean", "ratio_mean", "ratio_max", "num_valid_tokens"):
        assert metrics[key] == pytest.approx(expected_metrics[key], rel=1e-5, abs=1e-7), key


NUM_STEPS = 2


def _sync_worker(rank: int, world_size: int, rdv, model_dir: str, batch, expert_parallel: bool):
    """Ranks 0..1 train under FSDP2 (experts sharded by expert with `expert_parallel`) and send their
    shards; rank 2 holds a plain copy and receives them."""
    import torch.distributed as dist

    from llamarl.comm import WeightReceiver, WeightSender, WeightSyncEndpoint, WeightSyncGroup

    dist.init_process_group("gloo", init_method=rdv.init_method, rank=rank, world_size=world_size)
    group = dist.new_group(list(range(NUM_TRAINERS)))
    sync_group = WeightSyncGroup(
        WeightSyncEndpoint(host=rdv.host, port=rdv.port, rank=rank, world_size=world_size, timeout_s=60)
    )
    # max_grad_norm large: clipping then scales by exactly 1.0, so the weights can agree bit for bit.
    settings = {"max_grad_norm": 1e9}
    if rank < NUM_TRAINERS:
        trainer = _trainer(model_dir, group, expert_parallel=expert_parallel, **settings)
        trainer.setup()
        sender = WeightSender(sync_group, trainer.model, bucket_bytes=4096)
        part = batch.data_parallel_part(rank, NUM_TRAINERS)
        for _ in range(NUM_STEPS):
            trainer.train_step(part)
            sender.send(trainer.policy_version)
        sent = trainer.full_state_dict()  # (a collective: rank 0 gets the whole weights)
        return sent if rank == 0 else None
    from transformers import AutoModelForCausalLM

    generator_model = AutoModelForCausalLM.from_pretrained(model_dir)
    receiver = WeightReceiver(sync_group, generator_model)
    for _ in range(NUM_STEPS):
        version = receiver.receive()
    received = {n: p.detach().clone() for n, p in generator_model.named_parameters()}
    # What a single-rank trainer holds after the same steps on the whole batch, in this same process.
    single = _trainer(model_dir, **settings)
    single.setup()
    for _ in range(NUM_STEPS):
        single.train_step(batch)
    expected = {n: p.detach().clone() for n, p in single.model.named_parameters()}
    initial = {n: p.detach().clone() for n, p in tiny_model_params(model_dir).items()}
    return version, received, expected, initial


def tiny_model_params(model_dir: str) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return dict(AutoModelForCausalLM.from_pretrained(model_dir).named_parameters())


@pytest.mark.parametrize("model", ["dense", "moe", "moe-expert-parallel"])
def test_generator_receives_bitwise_the_single_rank_weights(request, model):
    tiny_model_dir, batch = (
        request.getfixturevalue(name) for name in MODELS[model.removesuffix("-expert-parallel")]
    )
    results = run_distributed(
        _sync_worker,
        NUM_TRAINERS + 1,
        str(tiny_model_dir),
        batch,
        model.endswith("-expert-parallel"),
        timeout_s=240,
    )
    sent, (version, received, expected, initial) = results[0], results[NUM_TRAINERS]
    assert version == NUM_STEPS
    assert set(received) == set(expected)
    # What the generator holds is, to the bit, what the trainer ranks hold between them.
    assert not [n for n in expected if not torch.equal(received[n], sent[n])]
    if model.endswith("-expert-parallel"):
        # The experts' outputs are summed in another order than the single rank's loop over experts:
        # the same weights as its to float rounding (AdamW's first steps magnify a gradient's last bits).
        for name in expected:
            torch.testing.assert_close(received[name], expected[name], atol=1e-4, rtol=1e-4, msg=name)
    else:
        mismatched = [n for n in expected if not torch.equal(received[n], expected[n])]
        assert not mismatched, mismatched
    assert all(not torch.equal(expected[n], initial[n]) for n in expected)  # every weight did move


def _mixed_precision_worker(rank: int, world_size: int, rdv, model_dir: str, batch):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=rdv.init_method, rank=rank, world_size=world_size)
    group = dist.new_group(list(range(NUM_TRAINERS)))
    out = {}
    for compute_dtype in (None, "bfloat16"):
        trainer = _trainer(model_dir, group, compute_dtype=compute_dtype)
        trainer.setup()
        logprobs = trainer.compute_logprobs(batch.data_parallel_part(rank, world_size))
        trainer.train_step(batch.data_parallel_part(rank, world_size))
        params = list(trainer.model.parameters())
        out[compute_dtype] = {
            "logprobs": logprobs,
            "param_dtypes": {p.dtype for p in params},
            "grad_free": all(p.grad is None for p in params),
            "optimizer_dtypes": {
                t.dtype for state in trainer.optimizer.state.values() for t in state.values() if t.dim() > 0
            },
        }
    return out if rank == 0 else None


def test_mixed_precision_computes_in_bf16_and_keeps_fp32_master_weights(tiny_model_dir, batch):
    out = run_distributed(_mixed_precision_worker, NUM_TRAINERS, str(tiny_model_dir), batch, timeout_s=240)[0]
    fp32, bf16 = out[None], out["bfloat16"]
    assert bf16["param_dtypes"] == {torch.float32} and bf16["optimizer_dtypes"] == {torch.float32}
    assert bf16["grad_free"]  # zeroed after the step
    # Same weights, bf16 matmuls: close to the fp32 log-probs but not equal to them.
    difference = (bf16["logprobs"] - fp32["logprobs"]).abs().max()
    assert 0 < difference < 0.1, difference
