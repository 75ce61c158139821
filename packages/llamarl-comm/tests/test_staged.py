"""Pull before pause (`llamarl.comm.adapters.staged.StagedReceiver`): a sync arrives into staging on a
thread while the engine's own thread keeps working, and is taken only when the engine asks; a pull the
engine gave up waiting for is kept for the next sync, and a stale one is dropped."""

from __future__ import annotations

import time

import pytest
import torch

from llamarl.comm import WeightReceiver, WeightSender, WeightSyncEndpoint, WeightSyncError, WeightSyncGroup
from llamarl.comm.adapters.staged import StagedReceiver
from llamarl.comm.testing import run_distributed, wait_until

pytestmark = pytest.mark.timeout(120)


def _endpoint(rdv, rank: int) -> WeightSyncEndpoint:
    return WeightSyncEndpoint(host=rdv.host, port=rdv.port, rank=rank, world_size=2, timeout_s=20)


def _weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(256, 64, generator=g), "b": torch.randn(64, generator=g)}


def _worker(rank: int, world_size: int, rdv) -> dict | None:
    group = WeightSyncGroup(_endpoint(rdv, rank))
    if rank == 0:  # the trainer: sends 1 once told the engine is busy, then 2 after a pause, then 3
        tensors = _weights(1)
        sender = WeightSender(group, tensors, bucket_bytes=4096)  # many buckets
        group.get("test/pulling", peer=1)
        sender.send(1)
        group.get("test/gave_up", peer=1)  # the engine stopped waiting for sync 2 before it was sent
        tensors["w"].add_(1.0)
        sender.send(2)
        tensors["w"].add_(1.0)
        sender.send(3)
        group.get("test/done", peer=1)
        group.close()
        return None

    staging = {name: torch.zeros_like(t) for name, t in _weights(0).items()}
    staged = StagedReceiver(WeightReceiver(group, staging))
    out: dict = {}
    with pytest.raises(RuntimeError, match="no staged pull is pending"):
        staged.wait(1.0)
    staged.start()
    out["pending_at_start"], out["done_at_start"] = staged.pending, staged.done()
    group.put("test/pulling", True)
    # The engine's own thread works on while the sync arrives: it counts its steps until the pull ended.
    steps = 0
    while not staged.done():
        torch.mm(torch.randn(64, 64), torch.randn(64, 64))
        steps += 1
    out["steps_while_pulling"] = steps
    out["version_1"] = staged.wait(5.0)
    out["pull_s"] = staged.pull_s
    out["staging_1"] = torch.equal(staging["w"], _weights(1)["w"])
    # A pull the engine stops waiting for (the trainer has not sent yet) stays pending, and the next
    # start keeps it: it is the pull of that next sync.
    staged.start()
    with pytest.raises(WeightSyncError, match="did not end within"):
        staged.wait(0.5)
    out["pending_after_giving_up"] = staged.pending
    group.put("test/gave_up", True)
    staged.start()  # kept, not a second pull
    out["version_2"] = staged.wait(30.0)
    # A pull that ended untaken is dropped by the next start, which pulls the next sync on top of it.
    staged.start()
    wait_until(staged.done, timeout_s=30, what="the pull of sync 3")
    out["staging_3"] = torch.equal(staging["w"], _weights(1)["w"].add_(1.0).add_(1.0))
    staged.start()  # sync 3 is dropped; this pull waits for a sync 4 (never sent here)
    out["pulling_again"] = staged.pending and not staged.done()
    group.put("test/done", True)
    staged.close(timeout_s=0.1)  # (the pull of sync 4 ends with the group)
    time.sleep(0.2)  # let the trainer read "done" before the store's host sees this rank leave
    group.close()
    return out


def test_a_staged_pull_arrives_while_the_engine_works_and_waits_to_be_taken():
    _, engine = run_distributed(_worker, 2, timeout_s=90)
    assert engine["pending_at_start"] and not engine["done_at_start"]
    assert engine["steps_while_pulling"] > 0  # the engine's thread was never blocked by the pull
    assert engine["version_1"] == 1 and engine["staging_1"] and engine["pull_s"] > 0
    assert engine["pending_after_giving_up"]
    assert engine["version_2"] == 2
    assert engine["staging_3"] and engine["pulling_again"]
