"""The NCCL-rules transport catches what gloo forgives: a reordered pair of messages, a wrong buffer
pairing, and receive-before-send or send-before-receive orders that deadlock on NCCL's one stream per
pair. Each case runs over plain gloo too, where it passes, so the test shows the difference."""

from __future__ import annotations

import time

import pytest
import torch

from llamarl.comm import WeightSyncEndpoint, WeightSyncError, WeightSyncGroup
from llamarl.comm.testing import run_distributed, transport_kwargs

pytestmark = pytest.mark.timeout(120)

DEADLINE_S = 3.0


def _group(rank: int, world_size: int, rdv, transport: str) -> WeightSyncGroup:
    group = WeightSyncGroup(
        WeightSyncEndpoint(
            host=rdv.host, port=rdv.port, rank=rank, world_size=world_size, timeout_s=DEADLINE_S
        ),
        **transport_kwargs(transport),
    )
    group.form(0)
    return group


def _finish(group: WeightSyncGroup, rank: int) -> None:
    """Rank 0 hosts the store: it leaves last."""
    if rank == 0:
        group.get("test/done", timeout_s=30)
    else:
        group.put("test/done", True)


def _two_messages(rank: int, world_size: int, rdv, transport: str, order: str):
    """Rank 0 sends tag 1 then tag 2; rank 1 receives them in ``order``; returns what rank 1 got or
    the error it raised."""
    group = _group(rank, world_size, rdv, transport)
    sizes = {1: 8, 2: 8 if order == "swapped-same-size" else 16}
    try:
        if rank == 0:
            works = [group.send(torch.full((sizes[t],), t, dtype=torch.uint8), 1, t) for t in (1, 2)]
            for work in works:
                group.wait(work, peer=1, what="sending")
            return None
        tags = (1, 2) if order == "in-order" else (2, 1)
        bufs = {t: torch.zeros(sizes[t], dtype=torch.uint8) for t in tags}
        works = [group.recv(bufs[t], 0, t) for t in tags]
        for work in works:
            group.wait(work, peer=0, what="receiving")
        return {t: sorted(set(b.tolist())) for t, b in bufs.items()}
    except WeightSyncError as exc:
        return str(exc)
    finally:
        _finish(group, rank)


@pytest.mark.parametrize("order", ["in-order", "swapped", "swapped-same-size"])
@pytest.mark.parametrize("transport", ["gloo", "nccl-rules"])
def test_messages_pair_by_tag_on_gloo_and_by_order_under_nccl_rules(transport: str, order: str) -> None:
    _, got = run_distributed(_two_messages, 2, transport, order, timeout_s=60)
    if transport == "gloo" or order == "in-order":
        assert got == {1: [1], 2: [2]}, got  # each buffer holds its own message
        return
    # NCCL would have put message 1 into the buffer meant for message 2: the transport refuses it.
    assert isinstance(got, str) and "NCCL ignores tags" in got, got
    assert "tag 0x2" in got and "tag 0x1" in got, got


def _crossed(rank: int, world_size: int, rdv, transport: str, first: str):
    """Both ranks post ``first`` ("recv" or "send") with the other, then the opposite, then wait for
    both. Gloo buffers small messages and matches by tag, so this completes; on NCCL the two first
    operations block the pair's stream on both sides."""
    group = _group(rank, world_size, rdv, transport)
    peer = 1 - rank
    out = torch.zeros(4, dtype=torch.uint8)
    mine = torch.full((4,), rank + 1, dtype=torch.uint8)
    start = time.monotonic()
    try:
        ops = [group.recv(out, peer, 7), group.send(mine, peer, 7)]
        if first == "send":
            ops.reverse()
        for work in ops:
            group.wait(work, peer=peer, what="exchanging")
        return {"got": out.tolist()}
    except WeightSyncError as exc:
        return {"error": str(exc), "seconds": time.monotonic() - start}
    finally:
        _finish(group, rank)


@pytest.mark.parametrize("first", ["recv", "send"])
@pytest.mark.parametrize("transport", ["gloo", "nccl-rules"])
def test_crossed_orders_deadlock_under_nccl_rules_and_fail_on_the_deadline(
    transport: str, first: str
) -> None:
    results = run_distributed(_crossed, 2, transport, first, timeout_s=60)
    for rank, result in enumerate(results):
        if transport == "gloo":
            assert result == {"got": [2 - rank] * 4}, result
            continue
        assert "error" in result and "missed its" in result["error"], result
        assert f"peer rank {1 - rank}" in result["error"], result
        assert result["seconds"] < 2 * DEADLINE_S + 2, result  # a deadline, not a hang


def _serialised(rank: int, world_size: int, rdv, transport: str):
    """Rank 0 posts two sends to rank 1 and waits for the second only; rank 1 receives the second only
    after the first arrived. Under NCCL's rules the second cannot complete before the first."""
    group = _group(rank, world_size, rdv, transport)
    try:
        if rank == 0:
            first = group.send(torch.ones(4, dtype=torch.uint8), 1, 1)
            second = group.send(torch.full((4,), 2, dtype=torch.uint8), 1, 2)
            group.wait(second, peer=1, what="sending")
            return first.is_completed()
        bufs = [torch.zeros(4, dtype=torch.uint8) for _ in range(2)]
        for tag, buf in zip((1, 2), bufs, strict=True):
            group.wait(group.recv(buf, 0, tag), peer=0, what="receiving")
        return [b.tolist() for b in bufs]
    finally:
        _finish(group, rank)


def test_operations_with_a_peer_complete_in_post_order() -> None:
    first_done, got = run_distributed(_serialised, 2, "nccl-rules", timeout_s=60)
    assert first_done is True
    assert got == [[1] * 4, [2] * 4]
