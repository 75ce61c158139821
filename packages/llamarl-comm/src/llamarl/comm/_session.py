"""What senders and receivers share: publishing layouts, planning, group generations, the sync loop.

Store protocol (keys under the group's prefix, values JSON):

- ``layout/{rank}``: every rank's ``SourceLayout`` or ``DestLayout``; every rank reads all of them and
  computes the same plan (``plan.make_plan``), so there is no coordinator to agree with.
- ``gen/requested``: a counter; a restarted receiver bumps it to ask for a new group generation, the
  announcing source bumps it after a failed sync. ``gen/{g}/done`` marks a generation that formed: a
  receiver constructed when ``gen/0/done`` exists is rejoining, and skips syncs announced on
  generations already formed (its predecessor's), joining the next fresh one.
- ``sync/count`` and ``sync/{n}``: the announcing source (the lowest source rank) announces sync ``n``
  with the generation it runs on and its ``policy_version``; everyone else waits for the announcement,
  (re)forms the group if the generation moved, then runs its part of the plan.
- ``held/{rank}``: the ``policy_version`` each receiver holds after its last successful sync.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from llamarl.comm.buckets import (
    TRAILER_BYTES,
    BucketCopies,
    Checksummer,
    Trailer,
    box_bytes,
    bucket_packer,
    bucket_unpacker,
    read_trailer,
    read_trailers,
    trailers_bytes,
    write_trailer,
)
from llamarl.comm.layouts import DestLayout, SourceLayout, dtype_from_str
from llamarl.comm.plan import Bucket, Stream, TransferPlan, make_plan
from llamarl.comm.transport import WeightSyncError, WeightSyncGroup

# Staging buffers per stream on each rank: one being packed/unpacked while the other is on the wire.
NUM_SLOTS = 2


@dataclass(kw_only=True)
class SyncStats:
    """What one sync did on this rank."""

    seconds: float  # wall time of the sync on this rank, announcement included
    bytes: int  # payload bytes this rank sent (source) or received (destination)
    buckets: int  # buckets this rank sent or received
    policy_version: int  # the version synced
    generation: int  # group generation the sync ran on


MANIFEST_TAG = 0x8000  # tag bit of a stream's manifest: the trailers of its direct buckets
READY_INDEX = 0x7FFF  # tag of a stream's "receives posted" message (no bucket has this index)


def _tag(stream: Stream, bucket: Bucket) -> int:
    # Unique per (stream, bucket) so a message can only ever match its own receive.
    return (stream.stream_id << 16) | bucket.index  # plan.MAX_BUCKETS_PER_STREAM keeps it below 0x7FFF


def _manifest_tag(stream: Stream) -> int:
    return (stream.stream_id << 16) | MANIFEST_TAG


def _ready_tag(stream: Stream) -> int:
    return (stream.stream_id << 16) | READY_INDEX


def _direct_len(bucket: Bucket) -> int:
    """Exact bytes of a direct bucket's single raw box (its payload_bytes is rounded up)."""
    e = bucket.entries[0]
    return math.prod(e.sizes) * dtype_from_str(e.src_dtype).itemsize


class _Endpoint:
    """A rank's membership in a weight-sync group: its layout, the plan, the generation, the sync count."""

    def __init__(self, group: WeightSyncGroup, layout: SourceLayout | DestLayout, *, strict: bool) -> None:
        self.group = group
        self.rank = group.rank
        self.layout = layout
        self.strict = strict
        self.plan: TransferPlan | None = None
        self._sync_index = 0  # index of the last sync this rank took part in (or skipped)
        self.rejoining = False  # a restarted receiver skips syncs on generations formed without it
        self._buffers: dict[tuple[int, int], torch.Tensor] = {}
        # Views a sync reuses (payloads, pack/unpack copies), built on first use: into this rank's
        # staging buffers and destination tensors (until the next replan), and into the source's local
        # tensors (until one of them moves: see _source_views).
        self._views: dict[tuple[Any, ...], Any] = {}
        self._src_views: dict[tuple[Any, ...], Any] = {}
        self._src_key: tuple[tuple[int, tuple[int, ...]], ...] | None = None
        group.put(f"layout/{self.rank}", layout.to_json())

    # ----------------------------------------------------------------------------------------------

    def _read_layouts(self) -> tuple[dict[int, SourceLayout], dict[int, DestLayout]]:
        sources: dict[int, SourceLayout] = {}
        dests: dict[int, DestLayout] = {}
        for r in range(self.group.world_size):
            data = self.group.get(f"layout/{r}", peer=r)
            if data["role"] == "source":
                sources[r] = SourceLayout.from_json(data)
            else:
                dests[r] = DestLayout.from_json(data)
        return sources, dests

    def _replan(self) -> TransferPlan:
        sources, dests = self._read_layouts()
        first = sources[min(sources)] if sources else None
        if first is not None and any(
            (s.bucket_bytes, s.checksum, s.direct_min_bytes)
            != (first.bucket_bytes, first.checksum, first.direct_min_bytes)
            for s in sources.values()
        ):
            raise WeightSyncError("source ranks disagree on bucket_bytes, checksum or direct_min_bytes")
        try:
            self.plan = make_plan(
                sources,
                dests,
                bucket_bytes=first.bucket_bytes if first else 64 << 20,
                strict=self.strict,
                direct_min_bytes=first.direct_min_bytes if first else 256 << 10,
            )
        except ValueError as exc:
            raise WeightSyncError(f"rank {self.rank}: weight layouts do not match: {exc}") from exc
        self.checksum = int(first.checksum) if first else 1
        self._buffers.clear()
        self._views.clear()
        self._src_views.clear()
        return self.plan

    def _form(self, generation: int) -> None:
        """Move to ``generation``: re-read every layout (a rejoined rank republished its own) and form."""
        self._replan()
        self.group.form(generation)

    @property
    def announcer(self) -> int:
        assert self.plan is not None
        return min(self.plan.source_ranks)

    def _buffer(self, stream: Stream, slot: int) -> torch.Tensor:
        """A staging buffer of ``stream`` for the largest bucket this rank packs or unpacks (slots are
        reused sync after sync; zero-copy buckets need none)."""
        key = (stream.stream_id, slot)
        buf = self._buffers.get(key)
        if buf is None:
            is_src = stream.src == self.rank
            staged = [b for b in stream.buckets if not b.direct or (is_src and b.src_copy)]
            size = max((b.payload_bytes for b in staged), default=0) + TRAILER_BYTES
            buf = torch.empty(size, dtype=torch.uint8, device=self.group.device)
            self._buffers[key] = buf
        return buf

    def _source_views(self, locals_: dict[str, tuple[torch.Tensor, tuple[int, ...]]]) -> dict[Any, Any]:
        """The cache of views into the source's local tensors, emptied when any of them moved (FSDP2 may
        swap a shard). A cached view keeps its tensor's memory alive, so an unchanged address means the
        same memory."""
        key = tuple((t.data_ptr(), t.stride()) for t, _ in locals_.values())
        if key != self._src_key:
            self._src_views.clear()
            self._src_key = key
        return self._src_views

    def _manifest(self, stream: Stream) -> torch.Tensor:
        """The trailers of ``stream``'s direct buckets, one 32-byte row each."""
        return torch.zeros(stream.num_direct * TRAILER_BYTES, dtype=torch.uint8, device=self.group.device)

    def _direct_source(
        self, bucket: Bucket, locals_: dict[str, tuple[torch.Tensor, tuple[int, ...]]]
    ) -> torch.Tensor:
        """A direct bucket's bytes in the source's local tensor, sent from there."""
        e = bucket.entries[0]
        local, local_offsets = locals_[e.src_name]
        rel = tuple(o - lo for o, lo in zip(e.src_offsets, local_offsets, strict=True))
        payload = box_bytes(local, rel, e.sizes)
        if payload is None:
            raise WeightSyncError(
                f"rank {self.rank}: {e.src_name} is no longer contiguous in memory; its layout was "
                "read when the sender was built (build a new sender after replacing parameters)"
            )
        return payload

    def _direct_target(
        self, stream: Stream, bucket: Bucket, dst_tensors: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, BucketCopies | None]:
        """Where a direct bucket lands: its box in the destination tensor, or (a destination that is
        not contiguous) a buffer of its own, with the copies that move it into place."""
        key = ("recv", stream.stream_id, bucket.index)
        target = self._views.get(key)
        if target is None:
            e = bucket.entries[0]
            payload = box_bytes(dst_tensors[e.dst_name], e.dst_offsets, e.sizes)
            unpack = None
            if payload is None:
                payload = torch.empty(_direct_len(bucket), dtype=torch.uint8, device=self.group.device)
                unpack = bucket_unpacker(payload, bucket, dst_tensors)
            target = self._views[key] = (payload, unpack)
        return target

    def _packed_target(
        self, stream: Stream, bucket: Bucket, dst_tensors: dict[str, torch.Tensor] | None
    ) -> tuple[torch.Tensor, BucketCopies]:
        """Where a packed bucket lands (its staging slot, trailer included) and the copies that unpack it."""
        assert dst_tensors is not None
        key = ("recv", stream.stream_id, bucket.index)
        target = self._views.get(key)
        if target is None:
            staged = self._buffer(stream, (bucket.index - stream.num_direct) % NUM_SLOTS)
            payload = staged[: bucket.payload_bytes + TRAILER_BYTES]
            target = self._views[key] = (payload, bucket_unpacker(staged, bucket, dst_tensors))
        return target

    # ----------------------------------------------------------------------------------------------
    # One sync

    def _run(
        self,
        *,
        sync_index: int,
        policy_version: int,
        locals_: dict[str, tuple[torch.Tensor, tuple[int, ...]]] | None,
        dst_tensors: dict[str, torch.Tensor] | None,
    ) -> tuple[int, int]:
        """Run this rank's part of the plan. Returns ``(payload bytes, buckets)`` handled here.

        Destinations post every direct receive (straight into the destination tensors) and their
        stream's manifest receive up front, and packed receives as staging slots free up: gloo moves a
        message only once its receive is posted, so this lets every source stream at full speed.
        Sources start direct sends from their tensors' memory at once and compute each checksum while
        the bytes travel; boxes that need packing (packed buckets, and direct ones with ``src_copy``)
        cycle through ``NUM_SLOTS`` staging buffers, bucket k+1 packed while bucket k is on the wire.
        A relay forwards each bucket before unpacking it, and a stream's manifest after its last direct
        bucket; direct buckets are verified against the manifest once it has arrived.
        """
        plan = self.plan
        assert plan is not None
        group = self.group
        schedule = plan.schedule(self.rank)
        # (stream, slot) -> (works, peer, bucket): a slot's send, waited before the slot is reused
        sends: dict[tuple[int, int], tuple[list[Any], int, int]] = {}
        loose: list[tuple[list[Any], int, int]] = []  # sends from tensors' memory: waited at the end
        # (stream, bucket) -> (receive, where it lands, the copies that unpack it if any)
        recvs: dict[tuple[int, int], tuple[list[Any], torch.Tensor, BucketCopies | None]] = {}
        manifests: dict[int, tuple[list[Any], torch.Tensor]] = {}  # stream -> (receive, manifest)
        manifest_sums: dict[int, list[torch.Tensor]] = {}  # stream -> checksums of its direct buckets
        received_direct: dict[int, list[torch.Tensor]] = {}  # stream -> checksums awaiting the manifest
        slot_uses: dict[int, int] = {}  # stream -> staging buffers used so far on this (source) rank
        next_post: dict[int, int] = {}  # stream -> next bucket index to post a receive for
        total_bytes = 0
        stamp = {"policy_version": policy_version, "sync_index": sync_index, "checksum": self.checksum}

        def wait_all(works: list[Any], peer: int, bucket_index: int, what: str) -> None:
            for work in works:
                group.wait(work, peer=peer, what=what, bucket=bucket_index)

        def wait_send(key: tuple[int, int]) -> None:
            pending = sends.pop(key, None)
            if pending is not None:
                wait_all(*pending, "sending weights")

        def source_slot(stream: Stream) -> tuple[tuple[int, int], torch.Tensor]:
            """The next staging buffer of ``stream``, once its previous bucket is on the wire."""
            uses = slot_uses.get(stream.stream_id, 0)
            slot_uses[stream.stream_id] = uses + 1
            key = (stream.stream_id, uses % NUM_SLOTS)
            wait_send(key)
            return key, self._buffer(stream, key[1])

        def pack(stream: Stream, bucket: Bucket, slot: int, buf: torch.Tensor) -> None:
            """Pack ``bucket`` into staging slot ``slot`` (copies built on first use, then replayed)."""
            assert locals_ is not None
            key = ("pack", stream.stream_id, bucket.index, slot)
            copies = src_views.get(key)
            if copies is None:
                copies = src_views[key] = bucket_packer(buf, bucket, locals_)
            copies.run()

        def post_recvs(stream: Stream, processed: int) -> None:
            """Post receives ahead: every direct one, packed ones as their slots free up."""
            nd = stream.num_direct
            i = next_post.get(stream.stream_id, 0)
            peer = stream.upstream(self.rank)
            if i == 0 and nd:
                manifest = self._manifest(stream)
                works = [group.recv(manifest, peer, _manifest_tag(stream), bucket=nd - 1)]
                manifests[stream.stream_id] = (works, manifest)
            while i < len(stream.buckets):
                bucket = stream.buckets[i]
                tag = _tag(stream, bucket)
                if bucket.direct:
                    assert dst_tensors is not None
                    payload, unpack = self._direct_target(stream, bucket, dst_tensors)
                else:
                    if i - nd >= max(0, processed - nd) + NUM_SLOTS:
                        break  # its staging slot still holds an earlier bucket
                    payload, unpack = self._packed_target(stream, bucket, dst_tensors)
                works = [group.recv(payload, peer, tag, bucket=bucket.index)]
                recvs[(stream.stream_id, i)] = (works, payload, unpack)
                i += 1
            next_post[stream.stream_id] = i

        # Gloo copies a message under a lock that posting a receive also takes, so receives posted
        # while data flows wait for it: post them all first, then tell the upstream peer to start.
        ready_from: dict[int, tuple[list[Any], int]] = {}  # stream -> (receive of "ready", peer)
        for stream in plan.streams:
            downstream = stream.downstream(self.rank) if self.rank in (stream.src, *stream.chain) else None
            if downstream is not None:
                flag = torch.zeros(1, dtype=torch.int64, device=group.device)
                works = [group.recv(flag, downstream, _ready_tag(stream), bucket=0)]
                ready_from[stream.stream_id] = (works, downstream)
        for stream in plan.streams:
            if self.rank in stream.chain:
                post_recvs(stream, 0)
        for stream in plan.streams:
            if self.rank in stream.chain:
                peer = stream.upstream(self.rank)
                flag = torch.ones(1, dtype=torch.int64, device=group.device)
                loose.append(([group.send(flag, peer, _ready_tag(stream), bucket=0)], peer, 0))

        def await_ready(stream: Stream) -> None:
            """Before the first message down ``stream``: the next hop has posted its receives."""
            pending = ready_from.pop(stream.stream_id, None)
            if pending is not None:
                wait_all(pending[0], pending[1], 0, "waiting for the receiver to post its receives")

        def checksum(
            cache: dict[Any, Any], key: tuple[Any, ...], payload: torch.Tensor
        ) -> torch.Tensor | None:
            # Taken right after a payload was written or read (sent, packed, received) while its bytes
            # are still in cache: later, summing a spot-check stride reads DRAM as much as a copy does.
            if not self.checksum:
                return None
            summer = cache.get(key)
            if summer is None:
                summer = cache[key] = Checksummer(payload, self.checksum)
            return summer(sync_index)

        # A source starts every send straight from its tensors' memory at once, so those bytes flow
        # while it packs the rest.
        in_flight: dict[tuple[int, int], torch.Tensor | None] = {}  # (stream, bucket) -> its checksum
        src_views = self._source_views(locals_) if locals_ is not None else {}
        for stream in plan.streams:
            if stream.src != self.rank:
                continue
            assert locals_ is not None
            await_ready(stream)
            dst = stream.chain[0]
            for bucket in stream.buckets:
                if not bucket.direct or bucket.src_copy:
                    continue
                payload = src_views.get(("send", stream.stream_id, bucket.index))
                if payload is None:
                    payload = self._direct_source(bucket, locals_)
                    src_views[("send", stream.stream_id, bucket.index)] = payload
                works = [group.send(payload, dst, _tag(stream, bucket), bucket=bucket.index)]
                loose.append((works, dst, bucket.index))
                in_flight[(stream.stream_id, bucket.index)] = checksum(
                    src_views, ("sum", stream.stream_id, bucket.index), payload
                )

        for stream, bucket in schedule:
            sid, tag = stream.stream_id, _tag(stream, bucket)
            ids = {"stream_id": sid, "bucket_index": bucket.index}
            last_direct = bucket.direct and bucket.index == stream.num_direct - 1
            if stream.src == self.rank:
                assert locals_ is not None
                dst = stream.chain[0]
                if bucket.direct:
                    if bucket.index == 0:
                        manifest_sums[sid] = []
                    if (sid, bucket.index) in in_flight:
                        bucket_sum = in_flight.pop((sid, bucket.index))
                    else:  # a column slice, or a box of a strided tensor: pack it first
                        key, buf = source_slot(stream)
                        payload = buf[: _direct_len(bucket)]
                        pack(stream, bucket, key[1], buf)
                        sends[key] = ([group.send(payload, dst, tag, bucket=bucket.index)], dst, bucket.index)
                        # before the staging slot is reused
                        bucket_sum = checksum(self._views, ("sum", sid, bucket.index, key[1]), payload)
                    if bucket_sum is not None:  # a 0-d tensor: on a GPU, no host sync per bucket
                        manifest_sums[sid].append(bucket_sum)
                    if last_direct:
                        manifest = trailers_bytes(
                            manifest_sums.pop(sid),
                            [(sid, i) for i in range(stream.num_direct)],
                            policy_version=policy_version,
                            sync_index=sync_index,
                            device=group.device,
                        )
                        works = [group.send(manifest, dst, _manifest_tag(stream), bucket=bucket.index)]
                        loose.append((works, dst, bucket.index))
                else:
                    key, buf = source_slot(stream)
                    n = bucket.payload_bytes
                    pack(stream, bucket, key[1], buf)
                    bucket_sum = checksum(self._views, ("sum", sid, bucket.index, key[1]), buf[:n])
                    write_trailer(buf[n:], buf[:n], **ids, **stamp, bucket_sum=bucket_sum)
                    works = [group.send(buf[: n + TRAILER_BYTES], dst, tag, bucket=bucket.index)]
                    sends[key] = (works, dst, bucket.index)
            else:
                assert dst_tensors is not None
                upstream = stream.upstream(self.rank)
                downstream = stream.downstream(self.rank)
                works, payload, unpack = recvs.pop((sid, bucket.index))
                wait_all(works, upstream, bucket.index, "receiving weights")
                if downstream is not None:
                    await_ready(stream)
                if bucket.direct:
                    if downstream is not None:  # forward first: the next replica receives while we go on
                        fwd = [group.send(payload, downstream, tag, bucket=bucket.index)]
                        loose.append((fwd, downstream, bucket.index))
                    if unpack is not None:  # landed in a buffer of its own
                        unpack.run()
                    received_direct.setdefault(sid, []).append(
                        checksum(self._views, ("sum", sid, bucket.index), payload)
                    )
                    if last_direct:
                        m_works, manifest = manifests.pop(sid)
                        wait_all(m_works, upstream, bucket.index, "receiving the manifest")
                        if downstream is not None:
                            fwd = [
                                group.send(manifest, downstream, _manifest_tag(stream), bucket=bucket.index)
                            ]
                            loose.append((fwd, downstream, bucket.index))
                        got = received_direct.pop(sid)
                        direct = stream.buckets[: stream.num_direct]
                        trailers = read_trailers(manifest)
                        self._verify(got, trailers, direct, stream, upstream, policy_version, sync_index)
                else:
                    n = bucket.payload_bytes
                    assert unpack is not None
                    self._verify(
                        [checksum(self._views, ("sum", sid, bucket.index), payload[:n])],
                        [read_trailer(payload[n : n + TRAILER_BYTES])],
                        [bucket],
                        stream,
                        upstream,
                        policy_version,
                        sync_index,
                    )
                    if downstream is not None:
                        fwd = [group.send(payload, downstream, tag, bucket=bucket.index)]
                        sends[(sid, -1)] = (fwd, downstream, bucket.index)
                    unpack.run()
                    wait_send((sid, -1))  # a packed forward must finish before its slot is reused
                post_recvs(stream, bucket.index + 1)
            total_bytes += bucket.payload_bytes
        for key in list(sends):
            wait_send(key)
        for works, peer, bucket_index in loose:
            wait_all(works, peer, bucket_index, "sending weights")
        return total_bytes, len(schedule)

    def _verify(
        self,
        sums: list[torch.Tensor | None],
        trailers: list[Trailer],
        buckets: list[Bucket] | tuple[Bucket, ...],
        stream: Stream,
        upstream: int,
        policy_version: int,
        sync_index: int,
    ) -> None:
        """Check received buckets against their trailers: ids and versions, then the checksums computed
        on arrival (0-d tensors on the device, read back once for all of them; None: checksums off)."""
        want = (policy_version, sync_index, stream.stream_id)
        for bucket, (_, *got) in zip(buckets, trailers, strict=True):
            if tuple(got) != (*want, bucket.index):
                raise WeightSyncError(
                    f"rank {self.rank}: bucket {bucket.index} of stream {stream.stream_id} from peer rank "
                    f"{upstream} is (version, sync, stream, bucket) {tuple(got)}, expected "
                    f"{(*want, bucket.index)}",
                    peer=upstream,
                    bucket=bucket.index,
                )
        if not self.checksum:
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
    # Announcements

    def _announce(self, policy_version: int) -> tuple[int, int]:
        """(Announcing source) pick the generation for the next sync and announce it."""
        group = self.group
        requested = group.add("gen/requested", 0)
        if not group.formed or group.generation is None:
            generation = group.add("gen/requested", 1)  # after a failure: a fresh generation for all
        elif requested > group.generation:
            generation = requested  # a receiver restarted and asked for this one
        else:
            generation = group.generation
        n = self._sync_index + 1
        group.put(f"sync/{n}", {"generation": generation, "policy_version": policy_version})
        group.add("sync/count", 1)
        return n, generation

    def _await_announcement(self, timeout_s: float | None) -> tuple[int, int, int]:
        """(Everyone else) wait for the next announced sync this rank should take part in."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            n = self._sync_index + 1
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            data = self.group.get(f"sync/{n}", peer=self.announcer_hint(), timeout_s=remaining)
            if self.rejoining and self.group.store.check([f"gen/{data['generation']}/done"]):
                # A generation formed before this process existed (with our dead predecessor): the
                # sender fails that sync without us and moves to a new generation, which we join.
                self._sync_index = n
                continue
            return n, int(data["generation"]), int(data["policy_version"])

    def announcer_hint(self) -> int | None:
        return self.announcer if self.plan is not None else None

    def _sync(
        self,
        *,
        announce_version: int | None,
        timeout_s: float | None,
        get_locals: Callable[[], dict[str, tuple[torch.Tensor, tuple[int, ...]]]] | None,
        dst_tensors: dict[str, torch.Tensor] | None,
    ) -> SyncStats:
        start = time.perf_counter()
        if announce_version is not None:
            n, generation = self._announce(announce_version)
            policy_version = announce_version
        else:
            n, generation, policy_version = self._await_announcement(timeout_s)
        try:
            if generation != self.group.generation or not self.group.formed:
                self._form(generation)
            num_bytes, num_buckets = self._run(
                sync_index=n,
                policy_version=policy_version,
                locals_=get_locals() if get_locals is not None else None,
                dst_tensors=dst_tensors,
            )
        except BaseException:
            # The group may hold half-delivered messages or dead peers: never reuse it.
            self.group.invalidate()
            self._sync_index = n
            raise
        self._sync_index = n
        return SyncStats(
            seconds=time.perf_counter() - start,
            bytes=num_bytes,
            buckets=num_buckets,
            policy_version=policy_version,
            generation=generation,
        )
