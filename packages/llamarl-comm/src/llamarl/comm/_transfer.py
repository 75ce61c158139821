"""One sync on one rank: ``SyncTransfer`` runs this rank's part of the plan.

Correct under NCCL's rules, not only gloo's: every message goes through ``_lanes.PairOrder``, which
posts the messages of each pair of ranks in the one order both sides compute from the plan.

Speed on gloo: destinations post every receive they can before data flows (direct receives straight
into the destination tensors, packed ones as staging slots free up), then signal the store, and each
upstream rank waits for that signal before its first message (gloo copies a message under a lock that
posting a receive also takes, so receives posted while data flows wait for it). Sources start the
direct sends from their tensors' memory at once (they come first in each stream) and compute each
checksum while the bytes travel; boxes that need packing cycle through ``NUM_SLOTS`` staging buffers,
bucket k+1 packed while bucket k is on the wire. A relay forwards each bucket before unpacking it.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from llamarl.comm._lanes import MANIFEST, Message, Pending, PostedRecv
from llamarl.comm._staging import NUM_SLOTS, SourceLocals, direct_len
from llamarl.comm._sync_part import SyncPart
from llamarl.comm.buckets import (
    TRAILER_BYTES,
    BucketCopies,
    Trailer,
    bucket_packer,
    read_trailer,
    read_trailers,
    trailers_bytes,
    write_trailer,
)
from llamarl.comm.plan import Bucket, Stream
from llamarl.comm.transport import WeightSyncError


class SyncTransfer(SyncPart):
    """This rank's part of one sync, created for that sync: its posted receives, pending sends and
    checksums. ``run()`` goes through the steps: post receives, start direct sends, then each bucket
    of the schedule (source or destination side), then wait for what is still in flight."""

    def __init__(
        self, *, locals_: SourceLocals | None, dst_tensors: dict[str, torch.Tensor] | None, **common: Any
    ) -> None:
        super().__init__(delta=False, **common)
        self.locals_ = locals_
        self.dst_tensors = dst_tensors
        self.src_views = self.staging.source_views(locals_) if locals_ is not None else {}
        # (stream, slot) -> a slot's send, waited before the slot is reused
        self.slot_sends: dict[tuple[int, int], Pending] = {}
        self.loose_sends: list[Pending] = []  # sends from tensors' memory: waited at the end
        self.slot_uses: dict[int, int] = {}  # stream -> staging buffers used so far on this (source) rank
        self.packed_done: dict[int, int] = {}  # stream -> packed buckets unpacked and forwarded here
        # Checksums (0-d tensors; None with checksums off), gathered for a stream's manifest:
        self.in_flight: dict[tuple[int, int], torch.Tensor | None] = {}  # started direct sends
        self.manifest_sums: dict[int, list[torch.Tensor]] = {}  # source: direct buckets sent
        self.received_direct: dict[int, list[torch.Tensor | None]] = {}  # destination: awaiting the manifest

    def run(self) -> tuple[int, int]:
        """Run this rank's part of the plan. Returns ``(payload bytes, buckets)`` handled here."""
        schedule = self.plan.schedule(self.rank)
        self.post_receives()
        self.start_direct_sends()
        total_bytes = 0
        for stream, bucket in schedule:
            if stream.src == self.rank:
                self.send_bucket(stream, bucket)
            else:
                self.receive_bucket(stream, bucket)
            total_bytes += bucket.payload_bytes
        self.finish()
        return total_bytes, len(schedule)

    # ----------------------------------------------------------------------------------------------
    # Steps

    def post_receives(self) -> None:
        """Post every receive this rank can before data flows, then tell the upstream peers (store)."""
        for peer in self.pairs.lanes:
            self.pairs.post_receives_ahead(peer)
        if self.rank in self.plan.dest_ranks:
            self.group.put(self.pairs.ready_key(self.rank), True)

    def start_direct_sends(self) -> None:
        """(Source) start the sends straight from the tensors' memory (the first buckets of each
        stream) at once, so those bytes flow while the rest is packed; each checksum is computed while
        its bytes travel."""
        for stream in self.plan.streams:
            if stream.src != self.rank:
                continue
            for bucket in stream.buckets:
                if not bucket.direct or bucket.src_copy:
                    break  # packed at the source: sent in schedule order, after these
                self._send_from_memory(stream, bucket)

    def send_bucket(self, stream: Stream, bucket: Bucket) -> None:
        """(Source) one bucket of the schedule: a direct one (already on the wire, or packed and sent
        now; the manifest follows the last), or a packed one with its trailer."""
        sid = stream.stream_id
        if not bucket.direct:
            key, buf = self._source_slot(stream)
            n = bucket.payload_bytes
            self._pack(stream, bucket, key[1], buf)
            bucket_sum = self._checksum(self.staging.views, ("sum", sid, bucket.index, key[1]), buf[:n])
            ids = {"stream_id": sid, "bucket_index": bucket.index}
            stamp = {"policy_version": self.policy_version, "sync_index": self.sync_index}
            write_trailer(
                buf[n:], buf[:n], **ids, **stamp, checksum=self.checksum_stride, bucket_sum=bucket_sum
            )
            self.slot_sends[key] = self.pairs.send(stream, bucket, buf[: n + TRAILER_BYTES])
            return
        if (sid, bucket.index) not in self.in_flight:
            if bucket.src_copy:  # a column slice, or a box of a strided tensor: pack it first
                key, buf = self._source_slot(stream)
                payload = buf[: direct_len(bucket)]
                self._pack(stream, bucket, key[1], buf)
                self.slot_sends[key] = self.pairs.send(stream, bucket, payload)
                # before the staging slot is reused
                bucket_sum = self._checksum(self.staging.views, ("sum", sid, bucket.index, key[1]), payload)
                self.in_flight[(sid, bucket.index)] = bucket_sum
            else:
                self._send_from_memory(stream, bucket)
        bucket_sum = self.in_flight.pop((sid, bucket.index))
        if bucket_sum is not None:  # a 0-d tensor: on a GPU, no host sync per bucket
            self.manifest_sums.setdefault(sid, []).append(bucket_sum)
        if bucket.index == stream.num_direct - 1:
            self._send_manifest(stream, bucket)

    def receive_bucket(self, stream: Stream, bucket: Bucket) -> None:
        """(Destination) one bucket of the schedule: wait for it, forward it down the chain, verify it,
        unpack it, then post the receives that freed."""
        upstream = stream.upstream(self.rank)
        posted = self.pairs.take_receive(stream, bucket)
        posted.pending.wait(self.group, "receiving weights")
        if bucket.direct:
            self._receive_direct(stream, bucket, posted, upstream)
        else:
            self._receive_packed(stream, bucket, posted, upstream)
        self.pairs.post_receives_ahead(upstream)

    def finish(self) -> None:
        """Wait for every send still in flight; check that every message of every pair was posted."""
        for key in list(self.slot_sends):
            self._wait_slot_send(key)
        for pending in self.loose_sends:
            pending.wait(self.group, "sending weights")
        unposted = self.pairs.unposted()
        if any(unposted.values()):
            raise WeightSyncError(f"rank {self.rank}: sync ended with messages never posted: {unposted}")
        if self.rank in self.plan.dest_ranks:
            # Every upstream peer has read it by now. Best effort: the weights are all here, and a
            # trainer whose sends completed may already have left, taking the store with it.
            with contextlib.suppress(Exception):
                self.group.delete(self.pairs.ready_key(self.rank))

    # ----------------------------------------------------------------------------------------------
    # Where receives land

    def _receive_target(self, msg: Message) -> tuple[torch.Tensor, BucketCopies | None] | None:
        """Where a receive from upstream lands: a manifest in its buffer, a direct bucket straight in
        the destination tensors, a packed one in its staging slot once that slot is free (else None)."""
        stream, bucket = msg.stream, msg.bucket
        assert self.dst_tensors is not None
        if msg.part == MANIFEST:
            return self.staging.manifest(stream), None
        if bucket.direct:
            return self.staging.direct_target(stream, bucket, self.dst_tensors)
        if bucket.index - stream.num_direct >= self.packed_done.get(stream.stream_id, 0) + NUM_SLOTS:
            return None  # its staging slot still holds an earlier bucket
        return self.staging.packed_target(stream, bucket, self.dst_tensors)

    # ----------------------------------------------------------------------------------------------
    # Source side

    def _send_from_memory(self, stream: Stream, bucket: Bucket) -> None:
        """Start a direct bucket's send straight from the source tensor's memory."""
        assert self.locals_ is not None
        sid = stream.stream_id
        payload = self.src_views.get(("send", sid, bucket.index))
        if payload is None:
            payload = self.src_views[("send", sid, bucket.index)] = self.staging.direct_source(
                bucket, self.locals_
            )
        self.loose_sends.append(self.pairs.send(stream, bucket, payload))
        self.in_flight[(sid, bucket.index)] = self._checksum(
            self.src_views, ("sum", sid, bucket.index), payload
        )

    def _source_slot(self, stream: Stream) -> tuple[tuple[int, int], torch.Tensor]:
        """The next staging buffer of ``stream``, once its previous bucket is on the wire."""
        uses = self.slot_uses.get(stream.stream_id, 0)
        self.slot_uses[stream.stream_id] = uses + 1
        key = (stream.stream_id, uses % NUM_SLOTS)
        self._wait_slot_send(key)
        return key, self.staging.buffer(stream, key[1])

    def _pack(self, stream: Stream, bucket: Bucket, slot: int, buf: torch.Tensor) -> None:
        """Pack ``bucket`` into staging slot ``slot`` (copies built on first use, then replayed)."""
        assert self.locals_ is not None
        key = ("pack", stream.stream_id, bucket.index, slot)
        copies = self.src_views.get(key)
        if copies is None:
            copies = self.src_views[key] = bucket_packer(buf, bucket, self.locals_)
        copies.run()

    def _send_manifest(self, stream: Stream, last_direct: Bucket) -> None:
        """The trailers of every direct bucket of ``stream``, in one message after the last of them."""
        sid = stream.stream_id
        manifest = trailers_bytes(
            self.manifest_sums.pop(sid, None),
            [(sid, i) for i in range(stream.num_direct)],
            policy_version=self.policy_version,
            sync_index=self.sync_index,
            device=self.group.device,
        )
        self.loose_sends.append(self.pairs.send(stream, last_direct, manifest, part=MANIFEST))

    # ----------------------------------------------------------------------------------------------
    # Destination side

    def _receive_direct(self, stream: Stream, bucket: Bucket, posted: PostedRecv, upstream: int) -> None:
        """A direct bucket arrived: forward it first (the next replica receives while we go on), move it
        into place if it landed in a buffer of its own, and verify the stream's direct buckets against
        the manifest after the last of them."""
        sid = stream.stream_id
        if stream.downstream(self.rank) is not None:
            self.loose_sends.append(self.pairs.send(stream, bucket, posted.payload))
        if posted.unpack is not None:
            posted.unpack.run()
        self.received_direct.setdefault(sid, []).append(
            self._checksum(self.staging.views, ("sum", sid, bucket.index), posted.payload)
        )
        if bucket.index != stream.num_direct - 1:
            return
        manifest = self.pairs.take_receive(stream, bucket, part=MANIFEST)
        manifest.pending.wait(self.group, "receiving the manifest")
        if stream.downstream(self.rank) is not None:
            self.loose_sends.append(self.pairs.send(stream, bucket, manifest.payload, part=MANIFEST))
        direct = stream.buckets[: stream.num_direct]
        self._verify(self.received_direct.pop(sid), read_trailers(manifest.payload), direct, stream, upstream)

    def _receive_packed(self, stream: Stream, bucket: Bucket, posted: PostedRecv, upstream: int) -> None:
        """A packed bucket arrived: verify it against its trailer, forward it, unpack it; its slot is
        free once the forward is done too."""
        sid, n = stream.stream_id, bucket.payload_bytes
        assert posted.unpack is not None
        payload = posted.payload
        self._verify(
            [self._checksum(self.staging.views, ("sum", sid, bucket.index), payload[:n])],
            [read_trailer(payload[n : n + TRAILER_BYTES])],
            [bucket],
            stream,
            upstream,
        )
        forward = (
            self.pairs.send(stream, bucket, payload) if stream.downstream(self.rank) is not None else None
        )
        posted.unpack.run()
        if forward is not None:  # a packed forward must finish before its slot is reused
            forward.wait(self.group, "sending weights")
        self.packed_done[sid] = self.packed_done.get(sid, 0) + 1

    def _verify(
        self,
        sums: list[torch.Tensor | None],
        trailers: list[Trailer],
        buckets: list[Bucket] | tuple[Bucket, ...],
        stream: Stream,
        upstream: int,
    ) -> None:
        """Check received buckets against their trailers: ids and versions, then the checksums computed
        on arrival (0-d tensors on the device, read back once for all of them; None: checksums off)."""
        want = (self.policy_version, self.sync_index, stream.stream_id)
        for bucket, (_, *got) in zip(buckets, trailers, strict=True):
            if tuple(got) != (*want, bucket.index):
                raise WeightSyncError(
                    f"rank {self.rank}: bucket {bucket.index} of stream {stream.stream_id} from peer rank "
                    f"{upstream} is (version, sync, stream, bucket) {tuple(got)}, expected "
                    f"{(*want, bucket.index)}",
                    peer=upstream,
                    bucket=bucket.index,
                )
        if not self.checksum_stride:
            return
        computed_sums = torch.stack(sums).tolist()  # type: ignore[arg-type]  # all set when checksums are on
        for bucket, computed, trailer in zip(buckets, computed_sums, trailers, strict=True):
            if computed != trailer[0]:
                raise WeightSyncError(
                    f"rank {self.rank}: checksum mismatch in bucket {bucket.index} of stream "
                    f"{stream.stream_id} from peer rank {upstream}: computed {computed}, sent {trailer[0]}",
                    peer=upstream,
                    bucket=bucket.index,
                )

    # ----------------------------------------------------------------------------------------------
    # Shared

    def _wait_slot_send(self, key: tuple[int, int]) -> None:
        pending = self.slot_sends.pop(key, None)
        if pending is not None:
            pending.wait(self.group, "sending weights")
