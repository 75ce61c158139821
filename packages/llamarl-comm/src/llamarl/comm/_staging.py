"""Memory a rank reuses sync after sync: staging buffers, and the views and copies built into them.

A sync repeats the same copies between the same memory, so the views are built on first use and
replayed: views into this rank's staging buffers and destination tensors live until the next replan;
views into a source's local tensors live until one of those tensors moves (FSDP2 may swap a shard).

A group that sends changed-only syncs keeps more here (``delta.py``): each source's *shadow* of every
bucket it sends (the wire bytes it sent last: as many bytes as it sends in a full sync), and on a
destination, where each bucket's last wire bytes are found again (``DeltaBase``): in place in its
destination tensors where those hold the wire values exactly (no copy kept), else in a shadow of its
own (fp8 on the wire: its scales and values, about one byte per weight).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from llamarl.comm.buckets import (
    TRAILER_BYTES,
    BucketCopies,
    box_bytes,
    bucket_packer,
    bucket_repacker,
    bucket_unpacker,
)
from llamarl.comm.layouts import dtype_from_str
from llamarl.comm.plan import Bucket, Stream
from llamarl.comm.transport import WeightSyncError

# Staging buffers per stream on each rank: one being packed/unpacked while the other is on the wire.
NUM_SLOTS = 2

# What a source holds: {parameter name: (local tensor, offsets of its box in the full parameter)}.
SourceLocals = dict[str, tuple[torch.Tensor, tuple[int, ...]]]


def direct_len(bucket: Bucket) -> int:
    """Exact bytes of a direct bucket's single raw box (its payload_bytes is rounded up)."""
    e = bucket.entries[0]
    return math.prod(e.sizes) * dtype_from_str(e.src_dtype).itemsize


def wire_len(bucket: Bucket) -> int:
    """Bytes of a bucket's wire values: a direct bucket's raw box, or a packed bucket's payload."""
    return direct_len(bucket) if bucket.direct else bucket.payload_bytes


@dataclass(frozen=True)
class DeltaBase:
    """Where a destination finds a bucket's last wire bytes again, to apply a delta to them.

    ``bytes``: uint8 ``[wire_len]``: the destination tensor's own box (a direct bucket landing in place),
    a buffer that ``repack`` refills from the destination tensors before each delta (they hold the wire
    values exactly), or the bucket's shadow (they do not: fp8). ``unpack`` moves the bytes into the
    destination tensors afterwards (None when they are already there)."""

    bytes: torch.Tensor
    repack: BucketCopies | None
    unpack: BucketCopies | None


class StagingCache:
    """This rank's staging buffers and cached views, for the current plan."""

    def __init__(self, rank: int, device: torch.device) -> None:
        self.rank = rank
        self.device = device
        self._buffers: dict[tuple[int, int], torch.Tensor] = {}  # (stream, slot) -> uint8 buffer
        self.views: dict[tuple[Any, ...], Any] = {}  # into staging buffers and destination tensors
        self._src_views: dict[tuple[Any, ...], Any] = {}  # into the source's local tensors
        self._src_key: tuple[tuple[int, tuple[int, ...]], ...] | None = None
        self._delta: dict[tuple[Any, ...], torch.Tensor] = {}  # shadows and delta buffers

    def clear(self) -> None:
        """Drop every buffer, shadow and view (after a replan, or to release memory)."""
        self._buffers.clear()
        self.views.clear()
        self._src_views.clear()
        self._src_key = None
        self._delta.clear()

    def shadow_bytes(self) -> int:
        """Bytes held in shadows (the wire bytes last sent or received, kept for the next delta)."""
        return sum(t.numel() for k, t in self._delta.items() if k[0] == "shadow")

    def _delta_buffer(self, key: tuple[Any, ...], nbytes: int) -> torch.Tensor:
        buf = self._delta.get(key)
        if buf is None:
            buf = self._delta[key] = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return buf

    def shadow(self, stream: Stream, bucket: Bucket) -> torch.Tensor:
        """The bucket's shadow ``[wire_len]`` (uint8): its wire bytes as last sent (a source) or received
        (a destination whose tensors cannot hold them exactly), kept until the next replan."""
        return self._delta_buffer(("shadow", stream.stream_id, bucket.index), wire_len(bucket))

    def delta_buffer(self, stream: Stream, role: str, header_bytes: int = 0) -> torch.Tensor:
        """A buffer ``[header_bytes + the stream's largest wire_len]`` (uint8) of ``stream``, one per
        ``role``: a source's send slots, a destination's landing buffer for payloads, for repacked bases."""
        size = header_bytes + max((wire_len(b) for b in stream.buckets), default=0)
        return self._delta_buffer(("buffer", stream.stream_id, role), size)

    def header_buffer(self, stream: Stream, role: str, nbytes: int) -> torch.Tensor:
        """A buffer ``[nbytes]`` (uint8) of ``stream`` for one header, one per ``role``."""
        return self._delta_buffer(("header", stream.stream_id, role), nbytes)

    def delta_base(self, stream: Stream, bucket: Bucket, dst_tensors: dict[str, torch.Tensor]) -> DeltaBase:
        """Where this destination finds ``bucket``'s last wire bytes (built once, then replayed)."""
        key = ("delta-base", stream.stream_id, bucket.index)
        base = self.views.get(key)
        if base is None:
            base = self.views[key] = self._find_base(stream, bucket, dst_tensors)
        return base

    def _find_base(self, stream: Stream, bucket: Bucket, dst_tensors: dict[str, torch.Tensor]) -> DeltaBase:
        n = wire_len(bucket)
        if bucket.direct:
            e = bucket.entries[0]
            box = box_bytes(dst_tensors[e.dst_name], e.dst_offsets, e.sizes)
            if box is not None:
                return DeltaBase(box, None, None)
        buf = self.delta_buffer(stream, "base")
        repack = bucket_repacker(buf, bucket, dst_tensors)
        if repack is None:
            buf = self.shadow(stream, bucket)
        return DeltaBase(buf[:n], repack, bucket_unpacker(buf, bucket, dst_tensors))

    def source_packer(
        self,
        views: dict[Any, Any],
        buf: torch.Tensor,
        key: tuple[Any, ...],
        bucket: Bucket,
        locals_: SourceLocals,
    ) -> BucketCopies:
        """The copies that pack ``bucket`` from the source's tensors into ``buf`` (cached in ``views``,
        the source-view cache, under ``key``)."""
        copies = views.get(key)
        if copies is None:
            copies = views[key] = bucket_packer(buf, bucket, locals_)
        return copies

    def buffer(self, stream: Stream, slot: int) -> torch.Tensor:
        """A staging buffer ``[bytes]`` (uint8) of ``stream`` for the largest bucket this rank packs or
        unpacks, trailer included (slots are reused sync after sync; zero-copy buckets need none)."""
        key = (stream.stream_id, slot)
        buf = self._buffers.get(key)
        if buf is None:
            is_src = stream.src == self.rank
            staged = [b for b in stream.buckets if not b.direct or (is_src and b.src_copy)]
            size = max((b.payload_bytes for b in staged), default=0) + TRAILER_BYTES
            buf = torch.empty(size, dtype=torch.uint8, device=self.device)
            self._buffers[key] = buf
        return buf

    def source_views(self, locals_: SourceLocals) -> dict[Any, Any]:
        """The cache of views into the source's local tensors, emptied when any of them moved (FSDP2 may
        swap a shard). A cached view keeps its tensor's memory alive, so an unchanged address means the
        same memory."""
        key = tuple((t.data_ptr(), t.stride()) for t, _ in locals_.values())
        if key != self._src_key:
            self._src_views.clear()
            self._src_key = key
        return self._src_views

    def manifest(self, stream: Stream) -> torch.Tensor:
        """A buffer ``[num_direct * 32]`` (uint8) for the trailers of ``stream``'s direct buckets."""
        return torch.zeros(stream.num_direct * TRAILER_BYTES, dtype=torch.uint8, device=self.device)

    def direct_source(self, bucket: Bucket, locals_: SourceLocals) -> torch.Tensor:
        """A direct bucket's bytes ``[bytes]`` (uint8 view) in the source's local tensor, sent from there."""
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

    def direct_target(
        self, stream: Stream, bucket: Bucket, dst_tensors: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, BucketCopies | None]:
        """Where a direct bucket lands ``[bytes]`` (uint8): its box in the destination tensor, or (a
        destination that is not contiguous) a buffer of its own, with the copies that move it into place."""
        key = ("recv", stream.stream_id, bucket.index)
        target = self.views.get(key)
        if target is None:
            e = bucket.entries[0]
            payload = box_bytes(dst_tensors[e.dst_name], e.dst_offsets, e.sizes)
            unpack = None
            if payload is None:
                payload = torch.empty(direct_len(bucket), dtype=torch.uint8, device=self.device)
                unpack = bucket_unpacker(payload, bucket, dst_tensors)
            target = self.views[key] = (payload, unpack)
        return target

    def packed_target(
        self, stream: Stream, bucket: Bucket, dst_tensors: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, BucketCopies]:
        """Where a packed bucket lands ``[payload + 32]`` (its staging slot, trailer included) and the
        copies that unpack it."""
        key = ("recv", stream.stream_id, bucket.index)
        target = self.views.get(key)
        if target is None:
            staged = self.buffer(stream, (bucket.index - stream.num_direct) % NUM_SLOTS)
            payload = staged[: bucket.payload_bytes + TRAILER_BYTES]
            target = self.views[key] = (payload, bucket_unpacker(staged, bucket, dst_tensors))
        return target
