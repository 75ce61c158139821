"""A receiver process dies; the trainer's next sync fails clearly; a new process for the same rank
joins and gets the latest weights, without restarting the trainer."""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from functools import partial

import pytest
import torch

from llamarl.comm import WeightReceiver, WeightSender, WeightSyncEndpoint, WeightSyncError, WeightSyncGroup
from llamarl.comm.testing import TRANSPORTS, run_distributed, transport_kwargs, wait_until

pytestmark = pytest.mark.timeout(120)

TIMEOUT_S = 10.0


def _engine_process(
    host: str, port: int, tmpdir: str, out_path: str, die_after: bool, transport: str
) -> None:
    """One life of the engine at rank 1: join (or rejoin), receive once, save what it got."""
    group = WeightSyncGroup(
        WeightSyncEndpoint(host=host, port=port, rank=1, world_size=2, timeout_s=TIMEOUT_S),
        **transport_kwargs(transport),
    )
    weights = {"w": torch.zeros(64, 32), "b": torch.zeros(7), "emb": torch.zeros(300, 256)}
    receiver = WeightReceiver(group, weights)
    version = receiver.receive(timeout_s=60)
    torch.save({"version": version, "rejoined": receiver.rejoined, "weights": weights}, out_path)
    if die_after:
        os._exit(0)  # a crash: no goodbye to anyone
    # Stay in the group until the trainer has read the version this life reported holding.
    wait_until(lambda: os.path.exists(os.path.join(tmpdir, "held_read")), timeout_s=60, what="the trainer")
    os._exit(0)


def _worker(rank: int, world_size: int, rdv, transport: str):
    if rank == 0:
        group = WeightSyncGroup(
            WeightSyncEndpoint(host=rdv.host, port=rdv.port, rank=0, world_size=2, timeout_s=TIMEOUT_S),
            **transport_kwargs(transport),
        )
        weights = {"w": torch.randn(64, 32), "b": torch.randn(7), "emb": torch.randn(300, 256)}
        sender = WeightSender(group, weights, bucket_bytes=64 << 10)
        out = {"sent": []}
        sender.send(1)
        out["sent"].append({k: v.clone() for k, v in weights.items()})
        first_life_over = os.path.join(rdv.tmpdir, "first_life_over")
        wait_until(lambda: os.path.exists(first_life_over), timeout_s=90, what="the engine's first life")
        for t in weights.values():
            t.add_(1.0)
        start = time.monotonic()
        try:
            sender.send(2)  # the engine is dead
            out["error"] = None
        except WeightSyncError as exc:
            out["error"] = {"peer": exc.peer, "message": str(exc), "seconds": time.monotonic() - start}
        # Only now does the engine restart: had it asked to rejoin before sync 2 was announced, sync 2
        # would have gone to the new process (also correct, but not the failure this test wants).
        open(os.path.join(rdv.tmpdir, "sync2_over"), "w").close()
        for t in weights.values():
            t.mul_(3.0)
        sender.send(3)  # re-forms the group with the restarted engine, then sends the latest weights
        out["sent"].append({k: v.clone() for k, v in weights.items()})
        # The restarted engine reports the version it holds once its receive returned: wait for that.
        out["held"] = wait_until(
            sender.held_versions, lambda held: held == {1: 3}, timeout_s=30, what="the held version 3"
        )
        open(os.path.join(rdv.tmpdir, "held_read"), "w").close()
        return out
    fork = mp.get_context("fork")  # real processes, without a second torch import
    sync2_over = os.path.join(rdv.tmpdir, "sync2_over")
    lives = []
    for life, die_after in enumerate((True, False)):
        path = os.path.join(rdv.tmpdir, f"life{life}.pt")
        proc = fork.Process(
            target=_engine_process, args=(rdv.host, rdv.port, rdv.tmpdir, path, die_after, transport)
        )
        proc.start()
        proc.join(timeout=90)
        assert proc.exitcode == 0, proc.exitcode
        lives.append(torch.load(path))
        if life == 0:
            open(os.path.join(rdv.tmpdir, "first_life_over"), "w").close()
            wait_until(partial(os.path.exists, sync2_over), timeout_s=90, what="the trainer's failed sync 2")
    return lives


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_restarted_receiver_catches_up(transport: str) -> None:
    trainer, lives = run_distributed(_worker, 2, transport, timeout_s=110)
    assert trainer["error"] is not None and trainer["error"]["peer"] == 1, trainer["error"]
    assert "peer rank 1" in trainer["error"]["message"]
    assert trainer["error"]["seconds"] < TIMEOUT_S + 2
    first, second = lives
    assert first["version"] == 1 and not first["rejoined"]
    assert second["version"] == 3 and second["rejoined"]
    for name in ("w", "b", "emb"):
        assert torch.equal(first["weights"][name], trainer["sent"][0][name])
        assert torch.equal(second["weights"][name], trainer["sent"][1][name])
    assert trainer["held"] == {1: 3}
