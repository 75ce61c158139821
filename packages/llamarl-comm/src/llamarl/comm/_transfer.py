"""One sync on one rank: ``SyncTransfer`` runs this rank's part of the plan.

Destinations post every direct receive (straight into the destination tensors) and their stream's
manifest receive up front, and packed receives as staging slots free up: gloo moves a message only
once its receive is posted, so this lets every source stream at full speed. Sources start direct sends
from their tensors' memory at once and compute each checksum while the bytes travel; boxes that need
packing (packed buckets, and direct ones with ``src_copy``) cycle through ``NUM_SLOTS`` staging
buffers, bucket k+1 packed while bucket k is on the wire. A relay forwards each bucket before unpacking
it, and a stream's manifest after its last direct bucket; direct buckets are verified against the
manifest once it has arrived.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from llamarl.comm._staging import NUM_SLOTS, SourceLocals, StagingCache, direct_len
from llamarl.comm.buckets import (
    TRAILER_BYTES,
    BucketCopies,
    Checksummer,
    Trailer,
    bucket_packer,
    read_trailer,
    read_trailers,
    trailers_bytes,
    write_trailer,
)
from llamarl.comm.plan import Bucket, Stream, TransferPlan
from llamarl.comm.transport import WeightSyncError, WeightSyncGroup

MANIFEST_TAG = 0x8000  # tag bit of a stream's manifest: the trailers of its direct buckets
READY_INDEX = 0x7FFF  # tag of a stream's "receives posted" message (no bucket has this index)


def _tag(stream: Stream, bucket: Bucket) -> int:
    # Unique per (stream, bucket) so a message can only ever match its own receive.
    return (stream.stream_id << 16) | bucket.index  # plan.MAX_BUCKETS_PER_STREAM keeps it below 0x7FFF


def _manifest_tag(stream: Stream) -> int:
    return (stream.stream_id << 16) | MANIFEST_TAG


def _ready_tag(stream: Stream) -> int:
    return (stream.stream_id << 16) | READY_INDEX


@dataclass
class _Pending:
    """Started sends or receives with one peer, waited together."""

    works: list[Any]
    peer: int
    bucket_index: int

    def wait(self, group: WeightSyncGroup, what: str) -> None:
        for work in self.works:
            group.wait(work, peer=self.peer, what=what, bucket=self.bucket_index)


@dataclass
class _PostedRecv:
    """A receive posted ahead: where the bucket lands and the copies that unpack it, if any."""

    pending: _Pending
    payload: torch.Tensor  # uint8 [bytes], trailer included for a packed bucket
    unpack: BucketCopies | None


class SyncTransfer:
    """This rank's part of one sync, created for that sync: its posted receives, pending sends and
    checksums. ``run()`` goes through the steps: post receives, start direct sends, then each bucket
    of the schedule (source or destination side), then wait for what is still in flight."""

    def __init__(
        self,
        *,
        group: WeightSyncGroup,
        plan: TransferPlan,
        staging: StagingCache,
        checksum_stride: int,
        sync_index: int,
        policy_version: int,
        locals_: SourceLocals | None,
        dst_tensors: dict[str, torch.Tensor] | None,
    ) -> None:
        self.group = group
        self.rank = group.rank
        self.plan = plan
        self.staging = staging
        self.checksum_stride = checksum_stride  # 0: checksums off
        self.sync_index = sync_index
        self.policy_version = policy_version
        self.locals_ = locals_
        self.dst_tensors = dst_tensors
        self.src_views = staging.source_views(locals_) if locals_ is not None else {}
        # (stream, slot) -> a slot's send, waited before the slot is reused
        self.slot_sends: dict[tuple[int, int], _Pending] = {}
        self.loose_sends: list[_Pending] = []  # sends from tensors' memory: waited at the end
        self.slot_uses: dict[int, int] = {}  # stream -> staging buffers used so far on this (source) rank
        self.recvs: dict[tuple[int, int], _PostedRecv] = {}  # (stream, bucket) -> its posted receive
        self.manifests: dict[int, tuple[_Pending, torch.Tensor]] = {}  # stream -> (receive, manifest)
        self.next_post: dict[int, int] = {}  # stream -> next bucket index to post a receive for
        self.ready_from: dict[int, _Pending] = {}  # stream -> the next hop's "receives posted" message
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
        """Post every receive this rank can before data flows, then tell each upstream peer to start.

        Gloo copies a message under a lock that posting a receive also takes, so receives posted while
        data flows wait for it: post them all first."""
        group = self.group
        for stream in self.plan.streams:
            if self.rank in (stream.src, *stream.chain):
                downstream = stream.downstream(self.rank)
                if downstream is not None:
                    flag = torch.zeros(1, dtype=torch.int64, device=group.device)
                    works = [group.recv(flag, downstream, _ready_tag(stream), bucket=0)]
                    self.ready_from[stream.stream_id] = _Pending(works, downstream, 0)
        for stream in self.plan.streams:
            if self.rank in stream.chain:
                self._post_receives_ahead(stream, 0)
        for stream in self.plan.streams:
            if self.rank in stream.chain:
                peer = stream.upstream(self.rank)
                flag = torch.ones(1, dtype=torch.int64, device=group.device)
                self.loose_sends.append(
                    _Pending([group.send(flag, peer, _ready_tag(stream), bucket=0)], peer, 0)
                )

    def start_direct_sends(self) -> None:
        """(Source) start every send straight from the tensors' memory at once, so those bytes flow
        while the rest is packed; each checksum is computed while its bytes travel."""
        for stream in self.plan.streams:
            if stream.src != self.rank:
                continue
            assert self.locals_ is not None
            self._await_ready(stream)
            dst = stream.chain[0]
            for bucket in stream.buckets:
                if not bucket.direct or bucket.src_copy:
                    continue
                key = ("send", stream.stream_id, bucket.index)
                payload = self.src_views.get(key)
                if payload is None:
                    payload = self.src_views[key] = self.staging.direct_source(bucket, self.locals_)
                works = [self.group.send(payload, dst, _tag(stream, bucket), bucket=bucket.index)]
                self.loose_sends.append(_Pending(works, dst, bucket.index))
                self.in_flight[(stream.stream_id, bucket.index)] = self._checksum(
                    self.src_views, ("sum", stream.stream_id, bucket.index), payload
                )

    def send_bucket(self, stream: Stream, bucket: Bucket) -> None:
        """(Source) one bucket of the schedule: a direct one (already on the wire, or packed and sent
        now; the manifest follows the last), or a packed one with its trailer."""
        sid, dst = stream.stream_id, stream.chain[0]
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
            works = [
                self.group.send(buf[: n + TRAILER_BYTES], dst, _tag(stream, bucket), bucket=bucket.index)
            ]
            self.slot_sends[key] = _Pending(works, dst, bucket.index)
            return
        if bucket.index == 0:
            self.manifest_sums[sid] = []
        if (sid, bucket.index) in self.in_flight:
            bucket_sum = self.in_flight.pop((sid, bucket.index))
        else:  # a column slice, or a box of a strided tensor: pack it first
            key, buf = self._source_slot(stream)
            payload = buf[: direct_len(bucket)]
            self._pack(stream, bucket, key[1], buf)
            works = [self.group.send(payload, dst, _tag(stream, bucket), bucket=bucket.index)]
            self.slot_sends[key] = _Pending(works, dst, bucket.index)
            # before the staging slot is reused
            bucket_sum = self._checksum(self.staging.views, ("sum", sid, bucket.index, key[1]), payload)
        if bucket_sum is not None:  # a 0-d tensor: on a GPU, no host sync per bucket
            self.manifest_sums[sid].append(bucket_sum)
        if bucket.index == stream.num_direct - 1:
            self._send_manifest(stream, bucket)

    def receive_bucket(self, stream: Stream, bucket: Bucket) -> None:
        """(Destination) one bucket of the schedule: wait for it, forward it down the chain, verify it,
        unpack it, then post the receives its staging slot frees."""
        upstream = stream.upstream(self.rank)
        posted = self.recvs.pop((stream.stream_id, bucket.index))
        posted.pending.wait(self.group, "receiving weights")
        if stream.downstream(self.rank) is not None:
            self._await_ready(stream)
        if bucket.direct:
            self._receive_direct(stream, bucket, posted, upstream)
        else:
            self._receive_packed(stream, bucket, posted, upstream)
        self._post_receives_ahead(stream, bucket.index + 1)

    def finish(self) -> None:
        """Wait for every send still in flight."""
        for key in list(self.slot_sends):
            self._wait_slot_send(key)
        for pending in self.loose_sends:
            pending.wait(self.group, "sending weights")

    # ----------------------------------------------------------------------------------------------
    # Source side

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
        sid, dst = stream.stream_id, stream.chain[0]
        manifest = trailers_bytes(
            self.manifest_sums.pop(sid),
            [(sid, i) for i in range(stream.num_direct)],
            policy_version=self.policy_version,
            sync_index=self.sync_index,
            device=self.group.device,
        )
        works = [self.group.send(manifest, dst, _manifest_tag(stream), bucket=last_direct.index)]
        self.loose_sends.append(_Pending(works, dst, last_direct.index))

    # ----------------------------------------------------------------------------------------------
    # Destination side

    def _post_receives_ahead(self, stream: Stream, processed: int) -> None:
        """Post receives ahead: the manifest and every direct one, packed ones as their slots free up."""
        assert self.dst_tensors is not None
        nd = stream.num_direct
        i = self.next_post.get(stream.stream_id, 0)
        peer = stream.upstream(self.rank)
        if i == 0 and nd:
            manifest = self.staging.manifest(stream)
            works = [self.group.recv(manifest, peer, _manifest_tag(stream), bucket=nd - 1)]
            self.manifests[stream.stream_id] = (_Pending(works, peer, nd - 1), manifest)
        while i < len(stream.buckets):
            bucket = stream.buckets[i]
            if bucket.direct:
                payload, unpack = self.staging.direct_target(stream, bucket, self.dst_tensors)
            else:
                if i - nd >= max(0, processed - nd) + NUM_SLOTS:
                    break  # its staging slot still holds an earlier bucket
                payload, unpack = self.staging.packed_target(stream, bucket, self.dst_tensors)
            works = [self.group.recv(payload, peer, _tag(stream, bucket), bucket=bucket.index)]
            self.recvs[(stream.stream_id, i)] = _PostedRecv(
                _Pending(works, peer, bucket.index), payload, unpack
            )
            i += 1
        self.next_post[stream.stream_id] = i

    def _receive_direct(self, stream: Stream, bucket: Bucket, posted: _PostedRecv, upstream: int) -> None:
        """A direct bucket arrived: forward it first (the next replica receives while we go on), move it
        into place if it landed in a buffer of its own, and verify the stream's direct buckets against
        the manifest after the last of them."""
        sid = stream.stream_id
        self._forward(stream, bucket, posted.payload, _tag(stream, bucket), loose=True)
        if posted.unpack is not None:
            posted.unpack.run()
        self.received_direct.setdefault(sid, []).append(
            self._checksum(self.staging.views, ("sum", sid, bucket.index), posted.payload)
        )
        if bucket.index != stream.num_direct - 1:
            return
        pending, manifest = self.manifests.pop(sid)
        pending.wait(self.group, "receiving the manifest")
        self._forward(stream, bucket, manifest, _manifest_tag(stream), loose=True)
        direct = stream.buckets[: stream.num_direct]
        self._verify(self.received_direct.pop(sid), read_trailers(manifest), direct, stream, upstream)

    def _receive_packed(self, stream: Stream, bucket: Bucket, posted: _PostedRecv, upstream: int) -> None:
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
        self._forward(stream, bucket, payload, _tag(stream, bucket), loose=False)
        posted.unpack.run()
        self._wait_slot_send((sid, -1))  # a packed forward must finish before its slot is reused

    def _forward(
        self, stream: Stream, bucket: Bucket, payload: torch.Tensor, tag: int, *, loose: bool
    ) -> None:
        """Send a received message on to the next member of the chain, if any."""
        downstream = stream.downstream(self.rank)
        if downstream is None:
            return
        pending = _Pending(
            [self.group.send(payload, downstream, tag, bucket=bucket.index)], downstream, bucket.index
        )
        if loose:
            self.loose_sends.append(pending)
        else:
            self.slot_sends[(stream.stream_id, -1)] = pending

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

    def _await_ready(self, stream: Stream) -> None:
        """Before the first message down ``stream``: the next hop has posted its receives."""
        pending = self.ready_from.pop(stream.stream_id, None)
        if pending is not None:
            pending.wait(self.group, "waiting for the receiver to post its receives")

    def _wait_slot_send(self, key: tuple[int, int]) -> None:
        pending = self.slot_sends.pop(key, None)
        if pending is not None:
            pending.wait(self.group, "sending weights")

    def _checksum(
        self, cache: dict[Any, Any], key: tuple[Any, ...], payload: torch.Tensor
    ) -> torch.Tensor | None:
        # Taken right after a payload was written or read (sent, packed, received) while its bytes are
        # still in cache: later, summing a spot-check stride reads DRAM as much as a copy does.
        if not self.checksum_stride:
            return None
        summer = cache.get(key)
        if summer is None:
            summer = cache[key] = Checksummer(payload, self.checksum_stride)
        return summer(self.sync_index)
