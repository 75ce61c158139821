"""Checkpoint writer and loader on two real processes (gloo): atomic commit, keep-last-M, verification,
bitwise restore of model, optimizer and RNG. The whole-run tests with kills are in tests/."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from llamarl.comm.testing import run_distributed
from llamarl.control.run import checkpoint as ckpt

pytestmark = pytest.mark.timeout(180)


def _model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


def _train_one_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(torch.randn(3, 8)).square().sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def _save_three_then_reload(rank: int, world_size: int, rdv, root: str) -> dict:
    dist.init_process_group("gloo", init_method=rdv.init_method, rank=rank, world_size=world_size)
    trainer_group = dist.new_group([0])
    writer = ckpt.CheckpointWriter(Path(root), rank=rank, world_size=world_size, keep=2)
    model, optimizer = _model_and_optimizer()
    saved = {}
    for step in (1, 2, 3):
        if rank == 0:
            _train_one_step(model, optimizer)
        torch.manual_seed(100 + step + rank)
        random.seed(step)
        writer.save(
            step,
            rank_state={"mine": f"rank {rank} step {step}"},
            trainer=(model, optimizer) if rank == 0 else None,
            trainer_group=trainer_group,
            controller_state={"tick": step} if rank == 0 else None,
        )
        # What this rank would draw next, and the trainer's state, as of this checkpoint.
        saved[step] = {
            "draws": (torch.rand(4), random.random()),
            "weight": model.weight.detach().clone(),
            "exp_avg": optimizer.state[model.weight]["exp_avg"].clone() if rank == 0 else None,
        }
    dist.barrier()
    if rank == 0:  # damage the newest checkpoint: a resume must fall back to step 2
        shard = next((Path(root) / "step_00000003" / ckpt.TRAINER_DIR).glob("*.distcp"))
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(data)
    notes: list[str] = []
    found = ckpt.choose_on_rank0(Path(root), rank=rank, log=notes.append)
    assert found is not None
    state = ckpt.load_rank_state(found, rank, world_size)
    fresh_model, fresh_optimizer = _model_and_optimizer()
    if rank == 0:
        ckpt.load_trainer(found, fresh_model, fresh_optimizer, trainer_group)
    torch.manual_seed(12345)  # anything; restore_rng must undo it
    ckpt.restore_rng(state["rng"])
    draws = (torch.rand(4), random.random())
    expected = saved[found.step]
    result = {
        "step": found.step,
        "notes": notes,
        "mine": state["mine"],
        "same_draws": torch.equal(draws[0], expected["draws"][0]) and draws[1] == expected["draws"][1],
    }
    if rank == 0:
        result["same_weight"] = torch.equal(fresh_model.weight, expected["weight"])
        result["same_exp_avg"] = torch.equal(
            fresh_optimizer.state[fresh_model.weight]["exp_avg"], expected["exp_avg"]
        )
        result["different_from_step_3"] = not torch.equal(fresh_model.weight, saved[3]["weight"])
        result["controller"] = ckpt.load_controller_state(found)
    dist.destroy_process_group()
    return result


def test_checkpoints_commit_atomically_keep_the_last_two_and_a_damaged_one_is_skipped(tmp_path):
    root = tmp_path / "checkpoints"
    results = run_distributed(_save_three_then_reload, 2, str(root), timeout_s=150)
    assert sorted(p.name for p in root.iterdir()) == ["step_00000002", "step_00000003"]
    for name in ("step_00000002", "step_00000003"):
        assert (root / name / ckpt.COMPLETE).is_file() and (root / name / ckpt.MANIFEST).is_file()
    trainer, generator = results
    assert trainer["step"] == generator["step"] == 2
    assert len(trainer["notes"]) == 1 and "does not match the manifest" in trainer["notes"][0]
    assert trainer["mine"] == "rank 0 step 2" and generator["mine"] == "rank 1 step 2"
    assert trainer["same_draws"] and generator["same_draws"]
    assert trainer["same_weight"] and trainer["same_exp_avg"] and trainer["different_from_step_3"]
    assert trainer["controller"] == {"tick": 2}


def test_an_unfinished_write_is_never_chosen(tmp_path):
    root = tmp_path / "checkpoints"
    (root / "step_00000005.tmp").mkdir(parents=True)  # a write that crashed before its commit
    (root / "step_00000004").mkdir()  # a final name without the marker (e.g. copied by hand, cut short)
    (root / "step_00000004" / ckpt.MANIFEST).write_text('{"world_size": 1, "files": {}}')
    notes: list[str] = []
    assert ckpt.find_latest(root, log=notes.append) is None
    assert notes == [
        f"checkpoint {root / 'step_00000004'} ignored: no 'complete' marker (the write did not finish)"
    ]


SETTINGS = {
    "task.name": "gsm8k",
    "seed": 7,
    "schedule.mode": "sync",
    "schedule.prompts_per_step": 2,
    "sampling.samples_per_prompt": 4,
    "ranks.num_generators": 1,
}
OTHER_VALUES = {
    "task.name": "math",
    "seed": 8,
    "schedule.mode": "async",
    "schedule.prompts_per_step": 4,
    "sampling.samples_per_prompt": 2,
    "ranks.num_generators": 2,
}


def _resume_with_other_settings(rank: int, world_size: int, rdv, output_dir: str) -> dict:
    dist.init_process_group("gloo", init_method=rdv.init_method, rank=rank, world_size=world_size)
    model, optimizer = _model_and_optimizer()
    checkpoints = ckpt.RunCheckpoints(
        Path(output_dir), rank=rank, world_size=world_size, keep=2, settings=SETTINGS
    )
    checkpoints.save(
        tick=1,
        policy_version=2,
        rank_state={},
        run_state={"history": [1.5, 2.5]},
        trainer=(model, optimizer),
        trainer_group=dist.new_group([0]),
    )
    refusals = {}
    for key, other in OTHER_VALUES.items():
        run = ckpt.RunCheckpoints(
            Path(output_dir), rank=rank, world_size=world_size, keep=2, settings={**SETTINGS, key: other}
        )
        try:
            run.resume(log=lambda message: None)
            refusals[key] = None
        except ckpt.CheckpointError as e:
            refusals[key] = str(e)
    same = checkpoints.resume(log=lambda message: None)
    assert same is not None
    dist.destroy_process_group()
    return {"refusals": refusals, "step": same.found.step, "run_state": same.run_state}


def test_a_resume_with_settings_that_change_the_prompts_is_refused(tmp_path):
    """Mode, seed, task, batch shape and generators fix which prompts each tick sees: a run with another
    value refuses the checkpoint, naming the setting and both values; the same settings resume."""
    assert set(OTHER_VALUES) == set(ckpt.MUST_MATCH_ON_RESUME)
    (result,) = run_distributed(_resume_with_other_settings, 1, str(tmp_path), timeout_s=150)
    path = tmp_path / ckpt.CHECKPOINTS_DIR / "step_00000002"
    assert result["refusals"] == {
        key: f"{path} was written with {key}={SETTINGS[key]!r}, this run has {other!r}"
        for key, other in OTHER_VALUES.items()
    }
    assert result["step"] == 2
    assert result["run_state"] == {
        "history": [1.5, 2.5],
        "tick": 2,
        "policy_version": 2,
        "settings": SETTINGS,
    }
