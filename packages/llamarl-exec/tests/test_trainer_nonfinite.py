"""PolicyTrainer refuses a non-finite update: a step whose advantages, loss or gradient hold a NaN or an
inf leaves every weight, the optimizer state and the learning-rate schedule bitwise as they were, and
its metrics name the cause; on two FSDP2 ranks both skip when only one rank's part is non-finite."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch

from llamarl.algo import group_mean_advantages
from llamarl.comm.testing import run_distributed
from llamarl.exec import PolicyTrainer
from llamarl.exec.testing import build_trainer

pytestmark = pytest.mark.timeout(300)

PROMPTS = [[1, 5, 9, 13, 17], [1, 7], [1, 3, 4, 30, 31, 32, 33, 8], [1, 11, 12]]
HOOKED = "model.layers.1.mlp.down_proj.weight"  # the parameter whose gradient the "nan_gradient" fault spoils
FAULTS = {  # fault -> the cause the step reports
    "nan_reward": "advantages",
    "inf_advantage": "advantages",
    "nan_behavior_logprob": "loss",
    "nan_gradient": f"grad of {HOOKED}",
}


@pytest.fixture(scope="module")
def batch(tiny_rollout):
    """4 prompts x 2 samples of the tiny model, rewards 1 for the first of each pair."""
    rollout = tiny_rollout(PROMPTS, seed=5)
    rollout.rewards_B = torch.tensor([1.0, 0.0] * len(PROMPTS))
    return rollout


def _trainer(model_dir: str, group=None) -> PolicyTrainer:
    trainer = build_trainer(model_dir, group=group, lr=1e-2, seed=0, pack_tokens=0, micro_batch_size=4)
    trainer.setup()
    return trainer


def _with_fault(trainer: PolicyTrainer, batch, fault: str):
    """`batch` (a copy) spoiled by `fault`, or the trainer made to spoil it (advantages, a gradient)."""
    bad = dataclasses.replace(
        batch, rewards_B=batch.rewards_B.clone(), behavior_logprobs_BC=batch.behavior_logprobs_BC.clone()
    )
    if fault == "nan_reward":
        bad.rewards_B[1] = math.nan
    elif fault == "nan_behavior_logprob":
        assert bad.completion_mask_BC[0, 0] == 1  # a token the loss counts
        bad.behavior_logprobs_BC[0, 0] = math.nan
    elif fault == "inf_advantage":

        def inf_first(rewards_B: torch.Tensor, group_size: int) -> torch.Tensor:
            advantages_B = group_mean_advantages(rewards_B, group_size)
            advantages_B[0] = math.inf
            return advantages_B

        trainer.advantage_fn = inf_first
    elif fault == "nan_gradient":
        param = dict(trainer.model.named_parameters())[HOOKED]
        param.register_hook(lambda grad: torch.full_like(grad, math.nan))
    else:
        raise AssertionError(fault)
    return bad


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _state(trainer: PolicyTrainer) -> dict:
    """This rank's weights (its shards under FSDP2), optimizer state and schedule, copied."""
    return {
        "weights": {n: _local(p.detach()).clone() for n, p in trainer.model.named_parameters()},
        "optimizer": [
            {k: _local(v).clone() for k, v in trainer.optimizer.state[p].items()}
            for p in trainer.model.parameters()
        ],
        "param_groups": copy.deepcopy(trainer.optimizer.state_dict()["param_groups"]),
        "scheduler": trainer.scheduler.state_dict(),
    }


def _same_state(a: dict, b: dict) -> bool:
    return (
        a["weights"].keys() == b["weights"].keys()
        and all(torch.equal(a["weights"][n], b["weights"][n]) for n in a["weights"])
        and len(a["optimizer"]) == len(b["optimizer"])
        and all(
            x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
            for x, y in zip(a["optimizer"], b["optimizer"], strict=True)
        )
        and a["param_groups"] == b["param_groups"]
        and a["scheduler"] == b["scheduler"]
    )


@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_nonfinite_step_changes_no_weight_nor_optimizer_state_and_names_its_cause(
    tiny_model_dir, batch, fault
):
    trainer = _trainer(str(tiny_model_dir))
    first = trainer.train_step(batch)  # so the optimizer has moments and a step count to keep
    assert first["skipped_nonfinite"] == 0.0 and "nonfinite_cause" not in first
    before = _state(trainer)
    bad = _with_fault(trainer, batch, fault)
    metrics = trainer.train_step(bad)
    assert metrics["skipped_nonfinite"] == 1.0
    assert metrics["nonfinite_cause"] == FAULTS[fault]
    assert _same_state(_state(trainer), before)
    assert all(p.grad is None for p in trainer.model.parameters())  # dropped, not left for the next step
    assert trainer.policy_version == 2 and metrics["policy_version"] == 2.0  # a skipped step still counts


def test_a_finite_step_after_a_skipped_one_trains_again(tiny_model_dir, batch):
    trainer = _trainer(str(tiny_model_dir))
    trainer.train_step(batch)
    trainer.train_step(_with_fault(trainer, batch, "nan_reward"))
    before = _state(trainer)
    metrics = trainer.train_step(batch)
    assert metrics["skipped_nonfinite"] == 0.0 and "nonfinite_cause" not in metrics
    assert math.isfinite(metrics["loss"]) and math.isfinite(metrics["grad_norm"])
    after = _state(trainer)
    assert all(not torch.equal(after["weights"][n], before["weights"][n]) for n in before["weights"])
    assert after["scheduler"]["last_epoch"] == before["scheduler"]["last_epoch"] + 1


NUM_TRAINERS = 2
ONE_RANK_FAULTS = ("nan_reward", "nan_behavior_logprob")


def _one_rank_fault_worker(rank: int, world_size: int, rdv, model_dir: str, batch):
    """Both ranks train their part; then, twice, rank 1's part alone is spoiled; then a clean step."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=rdv.init_method, rank=rank, world_size=world_size)
    group = dist.new_group(list(range(NUM_TRAINERS)))
    trainer = _trainer(model_dir, group)
    part = batch.data_parallel_part(rank, NUM_TRAINERS)
    trainer.train_step(part)
    before = _state(trainer)
    out = {}
    for fault in ONE_RANK_FAULTS:
        spoiled = _with_fault(trainer, part, fault) if rank == 1 else part
        metrics = trainer.train_step(spoiled)
        out[fault] = (
            metrics["skipped_nonfinite"],
            metrics.get("nonfinite_cause"),
            _same_state(_state(trainer), before),
        )
    metrics = trainer.train_step(part)
    out["clean"] = (
        metrics["skipped_nonfinite"],
        metrics.get("nonfinite_cause"),
        _same_state(_state(trainer), before),
    )
    return out


def test_both_fsdp2_ranks_skip_when_only_one_rank_part_is_nonfinite(tiny_model_dir, batch):
    results = run_distributed(_one_rank_fault_worker, NUM_TRAINERS, str(tiny_model_dir), batch, timeout_s=240)
    for fault, cause in zip(ONE_RANK_FAULTS, ("advantages", "loss"), strict=True):
        assert results[1][fault] == (1.0, cause, True), fault
        assert results[0][fault] == (1.0, f"{cause} on another trainer rank", True), fault
    for rank in range(NUM_TRAINERS):
        assert results[rank]["clean"] == (0.0, None, False)  # and then both train again
