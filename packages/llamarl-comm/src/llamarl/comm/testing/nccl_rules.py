"""A CPU transport that enforces NCCL's point-to-point rules, to test a protocol without a GPU.

``ProcessGroupNCCL`` ignores the tag of ``send`` / ``recv``: messages between two ranks match strictly
in the order each side posts them. It runs every operation between a pair of ranks, in both directions,
on one CUDA stream, so an operation does not start before the previous one with that peer completed,
and a send completes only once the peer receives it. A protocol that relies on gloo's tags (matching
out of order) or on gloo's buffering (a send completing before its receive is posted) passes on gloo
and deadlocks or pairs the wrong buffers on NCCL.

``NcclRulesProcessGroup`` wraps a gloo group and behaves like NCCL on those points:

- every message goes with one gloo tag, so gloo matches them in post order per pair; a small header
  travels first (size in bytes, dtype, the tag the caller meant, the message's sequence number on the
  pair) and the receiver raises ``NcclRulesViolation`` on any mismatch with the receive it posted, so
  a reordering or a wrong buffer pairing fails loudly instead of corrupting weights;
- each peer has one *lane* (a thread) that runs the operations with that peer strictly in post order,
  the next starting once the previous completed; a send completes only when the receiver acknowledges
  it (stricter than NCCL for tiny messages, which NCCL may buffer; a protocol must not count on that).
  A protocol that would deadlock on NCCL's single stream per pair deadlocks here too, and its waits
  fail on their deadline.

Use it inside a ``WeightSyncGroup`` with ``process_group_factory=nccl_rules_process_group``. It checks
ordering only: it says nothing about CUDA streams, memory or NCCL's own performance.
"""

from __future__ import annotations

import datetime
import queue
import threading
import weakref
import zlib
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["NcclRulesProcessGroup", "NcclRulesViolation", "nccl_rules_process_group"]

DATA_TAG = 0  # every header and payload: gloo then matches them in post order per pair
ACK_TAG = 1  # the receiver's acknowledgement, which completes a send
IDLE_POLL_S = 0.2  # how often an idle lane checks whether its group was dropped


class NcclRulesViolation(RuntimeError):
    """A message arrived that does not fit the receive posted for it (NCCL would pair them anyway)."""


def _dtype_code(dtype: torch.dtype) -> int:
    return zlib.crc32(str(dtype).encode())


def _describe(nbytes: int, dtype_code: int, tag: int, seq: int) -> str:
    return f"message #{seq} (tag {tag:#x}, {nbytes} bytes, dtype code {dtype_code})"


@dataclass(eq=False)
class _Op:
    """One send or receive, queued on its peer's lane."""

    kind: str  # "send" or "recv"
    tensor: torch.Tensor
    tag: int
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


class _Work:
    """What ``send`` / ``recv`` return: ``wait(timeout)`` like a torch ``Work``."""

    def __init__(self, op: _Op, rank: int, peer: int) -> None:
        self._op, self._rank, self._peer = op, rank, peer

    def is_completed(self) -> bool:
        return self._op.done.is_set()

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        seconds = None if timeout is None else timeout.total_seconds()
        if not self._op.done.wait(seconds):
            raise TimeoutError(
                f"rank {self._rank}: {self._op.kind} (tag {self._op.tag:#x}) with peer {self._peer} did not "
                f"complete within {seconds}s under NCCL's rules (one stream per pair, matched in post order)"
            )
        if self._op.error is not None:
            raise RuntimeError(f"rank {self._rank}: {self._op.error}") from self._op.error
        return True


class _Lane:
    """Runs the operations of this rank with one peer, in post order, one at a time."""

    def __init__(self, pg: Any, rank: int, peer: int, timeout: datetime.timedelta, owner: Any) -> None:
        self._pg, self._rank, self._peer, self._timeout = pg, rank, peer, timeout
        self._owner = weakref.ref(owner)  # the lane stops once its group is dropped
        self._queue: queue.SimpleQueue[_Op | None] = queue.SimpleQueue()
        self._sent = 0  # sequence numbers of messages on this pair, per direction
        self._received = 0
        self._broken: BaseException | None = None
        self._thread = threading.Thread(target=self._serve, name=f"nccl-rules-{rank}-{peer}", daemon=True)
        self._thread.start()

    def post(self, op: _Op) -> None:
        self._queue.put(op)

    def stop(self) -> None:
        self._queue.put(None)

    def _serve(self) -> None:
        while True:
            try:
                op = self._queue.get(timeout=IDLE_POLL_S)
            except queue.Empty:
                if self._owner() is None:
                    return
                continue
            if op is None:
                return
            try:
                if self._broken is not None:
                    raise RuntimeError(f"the lane to peer {self._peer} broke earlier: {self._broken}")
                self._send(op) if op.kind == "send" else self._recv(op)
            except BaseException as exc:
                # Without its traceback: its frames hold this lane and the gloo group, a cycle that would
                # keep the group alive until a garbage collection, perhaps in a child forked later, where
                # gloo's threads do not exist (a crash).
                exc.__traceback__ = None
                self._broken = self._broken or exc
                op.error = exc
            op.done.set()

    def _send(self, op: _Op) -> None:
        seq, self._sent = self._sent, self._sent + 1
        t = op.tensor
        header = torch.tensor([t.numel() * t.element_size(), _dtype_code(t.dtype), op.tag, seq])
        self._pg.send([header], self._peer, DATA_TAG).wait(self._timeout)
        self._pg.send([t], self._peer, DATA_TAG).wait(self._timeout)
        ack = torch.empty(1, dtype=torch.int64)
        self._pg.recv([ack], self._peer, ACK_TAG).wait(self._timeout)
        if int(ack) != seq:
            raise NcclRulesViolation(f"peer {self._peer} acknowledged message #{int(ack)}, not #{seq}")

    def _recv(self, op: _Op) -> None:
        seq, self._received = self._received, self._received + 1
        t = op.tensor
        header = torch.empty(4, dtype=torch.int64)
        self._pg.recv([header], self._peer, DATA_TAG).wait(self._timeout)
        got = tuple(int(x) for x in header.tolist())
        want = (t.numel() * t.element_size(), _dtype_code(t.dtype), op.tag, seq)
        if got != want:
            raise NcclRulesViolation(
                f"rank {self._rank} posted a receive for {_describe(*want)} from peer {self._peer}, and "
                f"the next message from it is {_describe(*got)}: NCCL ignores tags and would have paired "
                "them (a reordered pair or a wrong buffer)"
            )
        self._pg.recv([t], self._peer, DATA_TAG).wait(self._timeout)
        self._pg.send([torch.tensor([seq])], self._peer, ACK_TAG).wait(self._timeout)


class NcclRulesProcessGroup:
    """A gloo process group whose ``send`` / ``recv`` follow NCCL's rules (see the module doc).

    ``broadcast`` is passed through to gloo unchecked (only the weight-sync benchmark uses it).
    """

    def __init__(self, pg: Any, rank: int, timeout: datetime.timedelta) -> None:
        self._pg = pg
        self.rank = rank
        self._timeout = timeout
        self._lanes: dict[int, _Lane] = {}
        self._lock = threading.Lock()

    def _lane(self, peer: int) -> _Lane:
        with self._lock:
            lane = self._lanes.get(peer)
            if lane is None:
                lane = self._lanes[peer] = _Lane(self._pg, self.rank, peer, self._timeout, self)
            return lane

    def _post(self, kind: str, tensors: list[torch.Tensor], peer: int, tag: int) -> _Work:
        (tensor,) = tensors
        if not tensor.is_contiguous():
            raise ValueError("NCCL sends and receives contiguous tensors only")
        op = _Op(kind, tensor, tag)
        self._lane(peer).post(op)
        return _Work(op, self.rank, peer)

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> _Work:
        """Queue a send to ``dst``; it starts once every earlier operation with ``dst`` completed."""
        return self._post("send", tensors, dst, tag)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> _Work:
        """Queue a receive from ``src``; it takes the next message from ``src``, whatever its tag."""
        return self._post("recv", tensors, src, tag)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> Any:
        return self._pg.broadcast(tensors, opts)

    def shutdown(self) -> None:
        """Stop every lane once its queued operations are done."""
        with self._lock:
            for lane in self._lanes.values():
                lane.stop()
            self._lanes.clear()

    def __del__(self) -> None:
        self.shutdown()


def nccl_rules_process_group(
    store: Any, rank: int, world_size: int, timeout: datetime.timedelta
) -> NcclRulesProcessGroup:
    """A ``WeightSyncGroup(process_group_factory=...)``: a gloo group under NCCL's rules."""
    return NcclRulesProcessGroup(dist.ProcessGroupGloo(store, rank, world_size, timeout), rank, timeout)
