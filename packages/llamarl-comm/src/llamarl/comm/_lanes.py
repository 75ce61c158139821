"""The order of one sync's messages on each pair of ranks, the same on both sides (NCCL's rule).

ProcessGroupNCCL ignores tags: messages between two ranks match in the order each side posts them, and
every operation between a pair (both directions) runs on one stream, so an operation waits for the
previous one with that peer. Both sides of a pair therefore post its messages in one order computed
from the plan (``plan_lanes``): bucket index, then stream id, a stream's manifest (the trailers of its
direct buckets) right after its last direct bucket. ``PairOrder`` posts a rank's messages in that
order: a receive waits to be posted until this rank's earlier sends on that pair are, and vice versa.
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

MANIFEST_TAG = 0x8000  # tag bit of a stream's manifest (bucket indices stay below it)


@dataclass(frozen=True, eq=False)
class Message:
    """One message this rank exchanges with a peer: a bucket of a stream, or the stream's manifest."""

    stream: Stream
    bucket: Bucket  # for a manifest: the stream's last direct bucket
    manifest: bool
    outgoing: bool  # this rank sends it (else receives it)

    @property
    def order(self) -> tuple[int, int, int]:
        """Position on its pair, the same on both sides."""
        return (self.bucket.index, self.stream.stream_id, int(self.manifest))

    def __str__(self) -> str:
        what = "manifest" if self.manifest else f"bucket {self.bucket.index}"
        return f"{'send' if self.outgoing else 'receive'} of {what} of stream {self.stream.stream_id}"

    @property
    def tag(self) -> int:
        # Unique per message of a pair: plan.MAX_BUCKETS_PER_STREAM keeps the index below MANIFEST_TAG.
        return (self.stream.stream_id << 16) | (MANIFEST_TAG if self.manifest else self.bucket.index)


def plan_lanes(plan: TransferPlan, rank: int) -> dict[int, tuple[Message, ...]]:
    """For each peer of ``rank``: the messages between them, in the order both post them."""
    lanes: dict[int, list[Message]] = {}
    for stream in plan.streams:
        hops = [(stream.src, stream.chain[0]), *zip(stream.chain, stream.chain[1:], strict=False)]
        for sender, receiver in hops:
            if rank not in (sender, receiver):
                continue
            peer, outgoing = (receiver, True) if rank == sender else (sender, False)
            for bucket in stream.buckets:
                lanes.setdefault(peer, []).append(Message(stream, bucket, False, outgoing))
                if bucket.direct and bucket.index == stream.num_direct - 1:
                    lanes[peer].append(Message(stream, bucket, True, outgoing))
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


# Where a receive lands and the copies that unpack it; None: not yet (its staging slot is still busy).
ReceiveTarget = Callable[[Message], tuple[torch.Tensor, BucketCopies | None] | None]


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
        self.recvs: dict[tuple[int, int, bool], PostedRecv] = {}  # (stream, bucket, manifest) -> receive

    def ready_key(self, rank: int) -> str:
        """The store key by which ``rank`` says it posted the receives it could before data flows."""
        return f"ready/{self.sync_index}/{rank}"

    def next(self, peer: int) -> Message | None:
        """The next message to post on the pair with ``peer`` (None: all of them are posted)."""
        i = self.posted[peer]
        msgs = self.lanes[peer]
        return msgs[i] if i < len(msgs) else None

    def send(
        self, stream: Stream, bucket: Bucket, payload: torch.Tensor, *, manifest: bool = False
    ) -> Pending:
        """Post a send down ``stream``: it must be the next message with that peer (receives before it
        are posted first); the first one waits until the peer has posted its receives."""
        peer = stream.downstream(self.rank)
        assert peer is not None
        self.post_receives_ahead(peer)
        msg = self.next(peer)
        want = Message(stream, bucket, manifest, outgoing=True)
        if msg is None or (msg.stream.stream_id, msg.bucket.index, msg.manifest, msg.outgoing) != (
            stream.stream_id,
            bucket.index,
            manifest,
            True,
        ):
            raise WeightSyncError(
                f"rank {self.rank}: protocol error: the {want} to peer rank {peer} is not next on that "
                f"pair ({msg or 'nothing'} is)",
                peer=peer,
                bucket=bucket.index,
            )
        if peer not in self.peers_ready:
            self.group.get(self.ready_key(peer), peer=peer, in_sync=True)
            self.peers_ready.add(peer)
        pending = Pending(self.group.send(payload, peer, msg.tag, bucket=bucket.index), peer, bucket.index)
        self.posted[peer] += 1
        self.post_receives_ahead(peer)  # receives that come after this send on the pair
        return pending

    def post_receives_ahead(self, peer: int) -> None:
        """Post the receives from ``peer`` that are next on the pair, as long as ``receive_target``
        has somewhere for them to land."""
        while (msg := self.next(peer)) is not None and not msg.outgoing:
            target = self.receive_target(msg)
            if target is None:
                return
            payload, unpack = target
            work = self.group.recv(payload, peer, msg.tag, bucket=msg.bucket.index)
            self.recvs[(msg.stream.stream_id, msg.bucket.index, msg.manifest)] = PostedRecv(
                Pending(work, peer, msg.bucket.index), payload, unpack
            )
            self.posted[peer] += 1

    def take_receive(self, stream: Stream, bucket: Bucket, *, manifest: bool = False) -> PostedRecv:
        """The posted receive of ``bucket`` (or of the stream's manifest), handed over once."""
        return self.recvs.pop((stream.stream_id, bucket.index, manifest))

    def unposted(self) -> dict[int, int]:
        """Per peer, the messages of the sync never posted (all zeros once a sync ran whole)."""
        return {peer: len(msgs) - self.posted[peer] for peer, msgs in self.lanes.items()}
