"""How the launcher shares the CPU cores between ranks (the vLLM engine inherits its rank's share)."""

from __future__ import annotations

import os

from llamarl.control.config import RunConfig
from llamarl.control.launcher import _default_threads, rank_threads


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
    assert _default_threads(config("sync")) == cores
    assert _default_threads(config("sync", 3)) == cores


def test_async_mode_splits_the_cores_between_concurrent_ranks():
    cores = os.cpu_count() or 1
    assert _default_threads(config("async")) == max(1, cores // 2)
    assert _default_threads(config("async", 3)) == max(1, cores // 4)


def test_threads_per_rank_overrides_the_share_of_the_cores():
    for mode in ("sync", "async", "stream"):
        assert rank_threads(config(mode, threads_per_rank=3)) == 3
        assert rank_threads(config(mode)) == _default_threads(config(mode))


def test_the_cores_are_shared_among_one_machines_ranks_only():
    # Four ranks over two machines: each machine runs two of them at once.
    cores = os.cpu_count() or 1
    two_nodes = RunConfig(
        task="gsm8k",
        schedule={"mode": "async", "prompts_per_step": 12},
        ranks={"num_trainers": 2, "num_generators": 2},
        launch={"nnodes": 2, "rdzv_endpoint": "node0:29400"},
    )
    assert _default_threads(two_nodes) == max(1, cores // 2)
