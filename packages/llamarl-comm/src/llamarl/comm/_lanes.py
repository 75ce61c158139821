"""The order of one sync's messages on each pair of ranks, the same on both sides (NCCL's rule).

ProcessGroupNCCL ignores tags: messages between two ranks match in the order each side posts them, and
every operation between a pair (both directions) runs on one stream, so an operation waits for the
previous one with that peer. Both sides of a pair therefore post its messages in one order computed
from the plan (``plan_lanes``): bucket index, then stream id, a stream's manifest (the trailers of its
direct buckets) right after its last direct bucket. In a group that sends changed-only syncs every
bucket is two messages instead, a fixed-size header then its payload, whose size only the header
tells (``delta=True``); a payload that turns out empty is skipped by both sides. ``PairOrder`` posts a
rank's messages in that order: a receive waits to be posted until this rank's earlier sends on that
pair are, and vice versa.
Tags stay unique per message, so gloo (and the NCCL-rules test transport) can check the pairing. The
"receives posted" signal goes through the store, not through the pair, where it would queue behind
the receives.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from llamarl.comm.buckets import BucketCopies
from llamarl.comm.plan import Bucket, Stream, TransferPlan
from llamarl.comm.transport import WeightSyncError, WeightSyncGroup

SECOND_TAG = 0x8000  # tag bit of a stream's manifest, or of a bucket's payload after its header

# What a message carries (a full sync: a bucket, or a stream's manifest after its last direct bucket; a
# changed-only group's sync: a bucket's header, then its payload), and its place among its bucket's.
BUCKET, MANIFEST, HEADER, PAYLOAD = "bucket", "manifest", "header", "payload"
_SECOND = {BUCKET: False, HEADER: False, MANIFEST: True, PAYLOAD: True}


@dataclass(frozen=True, eq=False)
class Message:
    """One message this rank exchanges with a peer: a bucket of a stream, the stream's manifest, or a
    bucket's header or payload."""

    stream: Stream
    bucket: Bucket  # for a manifest: the stream's last direct bucket
    part: str  # BUCKET, MANIFEST, HEADER or PAYLOAD
    outgoing: bool  # this rank sends it (else receives it)

    @property
    def order(self) -> tuple[int, int, int]:
        """Position on its pair, the same on both sides."""
        return (self.bucket.index, self.stream.stream_id, int(_SECOND[self.part]))

    def __str__(self) -> str:
        what = "manifest" if self.part == MANIFEST else f"{self.part} {self.bucket.index}"
        return f"{'send' if self.outgoing else 'receive'} of {what} of stream {self.stream.stream_id}"

    @property
    def key(self) -> tuple[int, int, str]:
        return (self.stream.stream_id, self.bucket.index, self.part)

    @property
    def tag(self) -> int:
        # Unique per message of a pair: plan.MAX_BUCKETS_PER_STREAM keeps the index below SECOND_TAG.
        return (self.stream.stream_id << 16) | (SECOND_TAG if _SECOND[self.part] else self.bucket.index)


def plan_lanes(plan: TransferPlan, rank: int, *, delta: bool = False) -> dict[int, tuple[Message, ...]]:
    """For each peer of ``rank``: the messages between them, in the order both post them (``delta``:
    the header and payload of every bucket, for a group that sends changed-only syncs)."""
    lanes: dict[int, list[Message]] = {}
    for stream in plan.streams:
        hops = [(stream.src, stream.chain[0]), *zip(stream.chain, stream.chain[1:], strict=False)]
        for sender, receiver in hops:
            if rank not in (sender, receiver):
                continue
            peer, outgoing = (receiver, True) if rank == sender else (sender, False)
            lane = lanes.setdefault(peer, [])
            for bucket in stream.buckets:
                if delta:
                    lane += [
                        Message(stream, bucket, HEADER, outgoing),
                        Message(stream, bucket, PAYLOAD, outgoing),
                    ]
                    continue
                lane.append(Message(stream, bucket, BUCKET, outgoing))
                if bucket.direct and bucket.index == stream.num_direct - 1:
                    lane.append(Message(stream, bucket, MANIFEST, outgoing))
    return {peer: tuple(sorted(msgs, key=lambda m: m.order)) for peer, msgs in lanes.items()}


@dataclass
class Pending:
    """A started send or receive, waited with its peer and bucket named on failure."""

    work: Any
    peer: int
    bucket_index: int

    def wait(self, group: WeightSyncGroup, what: str) -> None:
        group.wait(self.work, peer=self.peer, what=what, bucket=self.bucket_index)


@dataclass
class PostedRecv:
    """A receive posted ahead: where the message lands and the copies that unpack it, if any."""

    pending: Pending
    payload: torch.Tensor  # uint8 [bytes], trailer included for a packed bucket
    unpack: BucketCopies | None


# Where a receive lands and the copies that unpack it; None: not yet (its staging slot is still busy,
# or its size is not known yet); SKIP: the message does not travel (an empty payload).
SKIP = "skip"
ReceiveTarget = Callable[[Message], tuple[torch.Tensor, BucketCopies | None] | str | None]


class PairOrder:
    """This rank's messages of one sync with each peer (``lanes``, from `plan_lanes`), posted in order.

    A send must be the next message on its pair (`send` posts the receives before it first, and the
    first send to a peer waits for that peer's "ready" in the store); receives are posted as far ahead
    as the pair's order and ``receive_target`` allow (`post_receives_ahead`), and taken back when their
    bucket is due (`take_receive`)."""

    def __init__(
        self,
        group: WeightSyncGroup,
        lanes: dict[int, tuple[Message, ...]],
        *,
        sync_index: int,
        receive_target: ReceiveTarget,
    ) -> None:
        self.group = group
        self.rank = group.rank
        self.lanes = lanes
        self.sync_index = sync_index
        self.receive_target = receive_target
        self.posted: dict[int, int] = dict.fromkeys(lanes, 0)  # peer -> messages posted so far
        self.peers_ready: set[int] = set()  # downstream peers known to have posted their receives
        self.recvs: dict[tuple[int, int, str], PostedRecv] = {}  # (stream, bucket, part) -> receive

    def ready_key(self, rank: int) -> str:
        """The store key by which ``rank`` says it posted the receives it could before data flows."""
        return f"ready/{self.sync_index}/{rank}"

    def next(self, peer: int) -> Message | None:
        """The next message to post on the pair with ``peer`` (None: all of them are posted)."""
        i = self.posted[peer]
        msgs = self.lanes[peer]
        return msgs[i] if i < len(msgs) else None

    def send(self, stream: Stream, bucket: Bucket, payload: torch.Tensor, *, part: str = BUCKET) -> Pending:
        """Post a send down ``stream``: it must be the next message with that peer (receives before it
        are posted first); the first one waits until the peer has posted its receives."""
        peer, msg = self._next_send(stream, bucket, part)
        if peer not in self.peers_ready:
            self.group.get(self.ready_key(peer), peer=peer, in_sync=True)
            self.peers_ready.add(peer)
        pending = Pending(self.group.send(payload, peer, msg.tag, bucket=bucket.index), peer, bucket.index)
        self.posted[peer] += 1
        self.post_receives_ahead(peer)  # receives that come after this send on the pair
        return pending

    def skip_send(self, stream: Stream, bucket: Bucket, *, part: str) -> None:
        """Pass over a message down ``stream`` that does not travel (an empty payload: its header said
        so, and the peer skips its receive the same way)."""
        peer, _ = self._next_send(stream, bucket, part)
        self.posted[peer] += 1
        self.post_receives_ahead(peer)

    def _next_send(self, stream: Stream, bucket: Bucket, part: str) -> tuple[int, Message]:
        peer = stream.downstream(self.rank)
        assert peer is not None
        self.post_receives_ahead(peer)
        msg = self.next(peer)
        want = Message(stream, bucket, part, outgoing=True)
        if msg is None or (*msg.key, msg.outgoing) != (*want.key, True):
            raise WeightSyncError(
                f"rank {self.rank}: protocol error: the {want} to peer rank {peer} is not next on that "
                f"pair ({msg or 'nothing'} is)",
                peer=peer,
                bucket=bucket.index,
            )
        return peer, msg

    def post_receives_ahead(self, peer: int) -> None:
        """Post the receives from ``peer`` that are next on the pair, as long as ``receive_target``
        has somewhere for them to land."""
        while (msg := self.next(peer)) is not None and not msg.outgoing:
            target = self.receive_target(msg)
            if target is None:
                return
            if target == SKIP:
                self.posted[peer] += 1
                continue
            payload, unpack = target
            work = self.group.recv(payload, peer, msg.tag, bucket=msg.bucket.index)
            self.recvs[msg.key] = PostedRecv(Pending(work, peer, msg.bucket.index), payload, unpack)
            self.posted[peer] += 1

    def take_receive(self, stream: Stream, bucket: Bucket, *, part: str = BUCKET) -> PostedRecv:
        """The posted receive of ``bucket``'s ``part`` (or of the stream's manifest), handed over once."""
        return self.recvs.pop((stream.stream_id, bucket.index, part))

    def unposted(self) -> dict[int, int]:
        """Per peer, the messages of the sync never posted (all zeros once a sync ran whole)."""
        return {peer: len(msgs) - self.posted[peer] for peer, msgs in self.lanes.items()}
