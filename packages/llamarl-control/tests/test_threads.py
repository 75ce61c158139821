"""How the launcher shares the CPU cores between ranks (the vLLM engine inherits its rank's share)."""

from __future__ import annotations

import os

import pytest
import torch

from llamarl.control.config import RunConfig
from llamarl.control.launch.threads import borrowed_cores, busy_threads, default_threads, rank_threads


def config(mode: str, num_generators: int = 1, **ranks) -> RunConfig:
    return RunConfig(
        task="gsm8k",
        schedule={"mode": mode, "prompts_per_step": 12},
        ranks={"num_generators": num_generators, **ranks},
    )


def test_sync_mode_gives_every_rank_all_cores():
    # Ranks take turns in sync mode: the generator generates while the trainer waits, and the other way
    # round, so each may use every core (a generator keeping half of them would idle the other half).
    cores = os.cpu_count() or 1
    assert default_threads(config("sync")) == cores
    assert default_threads(config("sync", 3)) == cores


def test_async_mode_splits_the_cores_between_concurrent_ranks():
    cores = os.cpu_count() or 1
    assert default_threads(config("async")) == max(1, cores // 2)
    assert default_threads(config("async", 3)) == max(1, cores // 4)


def test_threads_per_rank_overrides_the_share_of_the_cores():
    for mode in ("sync", "async", "stream"):
        assert rank_threads(config(mode, threads_per_rank=3)) == 3
        assert rank_threads(config(mode)) == default_threads(config(mode))


def test_the_cores_are_shared_among_one_machines_ranks_only():
    # Four ranks over two machines: each machine runs two of them at once.
    cores = os.cpu_count() or 1
    two_nodes = RunConfig(
        task="gsm8k",
        schedule={"mode": "async", "prompts_per_step": 12},
        ranks={"num_trainers": 2, "num_generators": 2},
        launch={"nnodes": 2, "rdzv_endpoint": "node0:29400"},
    )
    assert default_threads(two_nodes) == max(1, cores // 2)


def test_a_side_working_alone_borrows_the_waiting_sides_cores(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    run = config("async")  # a trainer and a generator: 4 threads each by default
    assert rank_threads(run) == 4
    assert busy_threads(run, busy_ranks=1) == 8
    # Three generators at work (the trainer waiting) share the 8 cores: 2 each, as by default (4 ranks).
    assert busy_threads(config("async", 3), busy_ranks=3) == 2
    assert busy_threads(config("async", 3), busy_ranks=2) == 4
    # Nothing is borrowed when the user fixed the threads, or when the run spans several machines.
    assert busy_threads(config("async", threads_per_rank=2), busy_ranks=1) is None
    two_nodes = RunConfig(
        task="gsm8k",
        schedule={"mode": "async", "prompts_per_step": 12},
        ranks={"num_trainers": 2, "num_generators": 2},
        launch={"nnodes": 2, "rdzv_endpoint": "node0:29400"},
    )
    assert busy_threads(two_nodes, busy_ranks=2) is None


def test_borrowed_cores_are_given_back_even_when_the_work_fails(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with borrowed_cores(config("async"), busy_ranks=1):
            assert torch.get_num_threads() == 2
        assert torch.get_num_threads() == 1
        with pytest.raises(RuntimeError, match="boom"), borrowed_cores(config("async"), busy_ranks=1):
            raise RuntimeError("boom")
        assert torch.get_num_threads() == 1
        with borrowed_cores(config("async", threads_per_rank=1), busy_ranks=1):
            assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
