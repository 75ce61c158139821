"""Packing plan entries into flat byte buckets and back, with a cheap checksum per bucket.

A bucket on the wire is ``payload_bytes`` of entries (each 8-byte aligned, see ``plan.Entry``) followed
by a 32-byte trailer of four int64 words: checksum, policy_version, sync index, stream/bucket id. A
direct bucket (``Bucket.direct``) is one raw box received straight into the destination tensor's memory
(and sent from the source tensor's, unless ``Bucket.src_copy``); the trailers of a stream's direct
buckets travel together in one manifest message after the last of them.
The checksum is the wrapping sum of the payload read as int64 words: one memory pass, computed by torch,
independent of summation order, and it catches truncated, shifted, stale or zeroed buckets (it is not a
cryptographic hash: it guards against bugs and torn transfers, not adversaries).

Precision on the wire (``plan.wire_kind``): ``bfloat16`` boxes are a plain cast; ``float8_e4m3fn`` boxes
hold ``sizes[0]`` float32 scales (one per leading row: ``amax(|row|) / 448``) then the fp8 values.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch

from llamarl.comm.layouts import dtype_from_str
from llamarl.comm.plan import BF16, FP8, Bucket, Entry

__all__ = [
    "FP8_MAX",
    "TRAILER_BYTES",
    "BucketCopies",
    "Checksummer",
    "Trailer",
    "box_bytes",
    "bucket_checksum",
    "bucket_packer",
    "bucket_repacker",
    "bucket_unpacker",
    "checksum_tensor",
    "holds_exactly",
    "pack_bucket",
    "read_trailer",
    "read_trailers",
    "trailers_bytes",
    "unpack_bucket",
    "write_trailer",
]

TRAILER_BYTES = 32
FP8_MAX = 448.0  # largest finite float8_e4m3fn


def _box(offsets: tuple[int, ...], sizes: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))


class Checksummer:
    """The checksum of one payload (uint8) at any phase, with its views built once: a sync replays it on
    the same memory, and building views costs more than summing a spot check.

    The checksum is the wrapping int64 sum of the payload read as int64 words (a ragged tail adds its
    bytes). With ``stride > 1`` it is a spot check over a fraction of the memory traffic: the words are
    cut into rows of ``stride`` and the sum takes column ``phase % stride`` of every row but the last,
    plus all of the last row (so the last word, and with it truncation, is always checked). Senders
    rotate ``phase`` with the sync index, so every word is checked once every ``stride`` syncs.
    """

    def __init__(self, payload_u8: torch.Tensor, stride: int = 1) -> None:
        self.payload = payload_u8
        self.stride = max(1, stride)
        # A box at an odd address (a slice of a tensor) is summed from an aligned copy at each call, so
        # both sides agree whatever the alignment of their own memory.
        self.aligned = payload_u8.data_ptr() % 8 == 0
        if self.aligned:
            self._views = self._split(payload_u8)

    def _split(
        self, payload_u8: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        n = payload_u8.numel()
        whole = n - n % 8
        tail = payload_u8[whole:] if whole != n else None
        if not whole:  # (an empty view as int64 would still need an aligned address)
            return None, None, tail
        words = payload_u8[:whole].view(torch.int64)
        if self.stride == 1:
            return None, words, tail
        rows = (words.numel() - 1) // self.stride  # the last (partial or whole) row is summed in full
        grid = words[: rows * self.stride].view(rows, self.stride) if rows else None
        return grid, words[rows * self.stride :], tail

    def __call__(self, phase: int = 0) -> torch.Tensor:
        """The checksum as a 0-d int64 tensor on the payload's device (no host sync: a GPU keeps going)."""
        grid, rest, tail = self._views if self.aligned else self._split(self.payload.clone())
        total = rest.sum() if rest is not None else None
        if grid is not None:
            total = grid[:, phase % self.stride].sum() + total
        if tail is not None:
            tail_sum = tail.sum(dtype=torch.int64)
            total = tail_sum if total is None else total + tail_sum
        if total is None:  # an empty payload
            total = torch.zeros((), dtype=torch.int64, device=self.payload.device)
        return total


def checksum_tensor(payload_u8: torch.Tensor, stride: int = 1, phase: int = 0) -> torch.Tensor:
    """The ``Checksummer`` sum of a payload (uint8) at ``phase``, as a 0-d int64 tensor on its device."""
    return Checksummer(payload_u8, stride)(phase)


def bucket_checksum(payload_u8: torch.Tensor, stride: int = 1, phase: int = 0) -> int:
    """``checksum_tensor`` as a Python int."""
    return int(checksum_tensor(payload_u8, stride, phase))


def box_bytes(tensor: torch.Tensor, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor | None:
    """The bytes of a box of ``tensor`` as one uint8 view, if the tensor is contiguous and the box is one
    run of memory there (see ``plan.is_contiguous_box``); None otherwise."""
    if not tensor.is_contiguous():
        return None
    start = sum(o * st for o, st in zip(offsets, tensor.stride(), strict=True))
    return tensor.reshape(-1)[start : start + math.prod(sizes)].view(torch.uint8)


def _fp8_rows(sizes: tuple[int, ...]) -> int:
    return sizes[0] if sizes else 1


class BucketCopies:
    """The copies that pack one bucket into a staging buffer, or unpack it, as prebuilt views.

    Slicing out a box and viewing the buffer as its dtype costs more Python time than copying a small
    box; a sync repeats the same copies between the same memory, so the views are built once and each
    sync replays them: one ``copy_`` per entry (fp8 entries, which compute scales, run their own code).
    """

    def __init__(self) -> None:
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []  # (to, from): a plain copy or a cast
        self.calls: list[Callable[[], None]] = []  # entries that are more than a copy (fp8)
        # The alignment padding after each entry, zeroed: a bucket's bytes are then a function of its
        # values alone, as a delta and its checksum need (and no stale memory goes on the wire).
        self.gaps: list[torch.Tensor] = []

    def run(self) -> None:
        for to, from_ in self.pairs:
            to.copy_(from_)
        for call in self.calls:
            call()
        for gap in self.gaps:
            gap.zero_()


def _source_region(entry: Entry, local: torch.Tensor, local_offsets: tuple[int, ...]) -> torch.Tensor:
    return local[
        _box(tuple(o - lo for o, lo in zip(entry.src_offsets, local_offsets, strict=True)), entry.sizes)
    ]


def _wire_view(buf_u8: torch.Tensor, entry: Entry) -> torch.Tensor:
    """``entry``'s box in the bucket, as its wire dtype (raw or bf16 entries)."""
    if entry.wire == "raw":
        dtype = dtype_from_str(entry.src_dtype)
    elif entry.wire == BF16:
        dtype = torch.bfloat16
    else:
        raise ValueError(f"wire kind {entry.wire!r} is not a plain view")
    at = entry.byte_offset
    return buf_u8[at : at + math.prod(entry.sizes) * dtype.itemsize].view(dtype).view(entry.sizes)


def _fp8_views(buf_u8: torch.Tensor, entry: Entry) -> tuple[torch.Tensor, torch.Tensor]:
    """``entry``'s float32 row scales ``[rows]`` and fp8 values ``[rows, rest]`` in the bucket."""
    rows, at = _fp8_rows(entry.sizes), entry.byte_offset
    scales = buf_u8[at : at + 4 * rows].view(torch.float32)
    values = buf_u8[at + 4 * rows : at + 4 * rows + math.prod(entry.sizes)].view(torch.float8_e4m3fn)
    return scales, values.view(rows, -1)


def _data_bytes(entry: Entry) -> int:
    """Bytes of an entry's values in a bucket (its ``nbytes`` less the alignment padding)."""
    numel = math.prod(entry.sizes)
    if entry.wire == FP8:
        return 4 * _fp8_rows(entry.sizes) + numel
    dtype = dtype_from_str(entry.src_dtype) if entry.wire == "raw" else torch.bfloat16
    return numel * dtype.itemsize


def _gap(buf_u8: torch.Tensor, entry: Entry) -> list[torch.Tensor]:
    start, end = entry.byte_offset + _data_bytes(entry), entry.byte_offset + entry.nbytes
    end = min(end, buf_u8.numel())  # (a direct bucket's buffer may end with its values)
    return [buf_u8[start:end]] if end > start else []


def _pack_fp8(scales: torch.Tensor, values: torch.Tensor, region: torch.Tensor) -> None:
    rows_x = region.reshape(values.shape[0], -1).float()
    scale_r = (rows_x.abs().amax(dim=1) / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    scales.copy_(scale_r)
    values.copy_((rows_x / scale_r[:, None]).clamp_(-FP8_MAX, FP8_MAX))


def _unpack_fp8(target: torch.Tensor, scales: torch.Tensor, values: torch.Tensor) -> None:
    target.copy_((values.float() * scales[:, None]).view(target.shape))


def _check_wire(entry: Entry) -> None:
    if entry.wire not in ("raw", BF16, FP8):
        raise ValueError(f"unknown wire kind {entry.wire!r}")


def bucket_packer(
    buf_u8: torch.Tensor,
    bucket: Bucket,
    locals_: dict[str, tuple[torch.Tensor, tuple[int, ...]]],
) -> BucketCopies:
    """The copies that fill ``buf_u8[:bucket.payload_bytes]`` from the source's ``{name: (local tensor,
    box offsets)}``, casting for the wire. Valid while those tensors and the buffer stay in place."""
    copies = BucketCopies()
    for entry in bucket.entries:
        _check_wire(entry)
        local, offsets = locals_[entry.src_name]
        region = _source_region(entry, local, offsets)
        if entry.wire == FP8:
            copies.calls.append(functools.partial(_pack_fp8, *_fp8_views(buf_u8, entry), region))
        else:
            copies.pairs.append((_wire_view(buf_u8, entry), region))
        copies.gaps += _gap(buf_u8, entry)
    return copies


def bucket_unpacker(
    buf_u8: torch.Tensor, bucket: Bucket, dst_tensors: dict[str, torch.Tensor]
) -> BucketCopies:
    """The copies that scatter a received bucket in ``buf_u8`` into the destination tensors ``{engine
    name: local tensor}``, in place. Valid while those tensors and the buffer stay in place."""
    copies = BucketCopies()
    for entry in bucket.entries:
        _check_wire(entry)
        target = dst_tensors[entry.dst_name][_box(entry.dst_offsets, entry.sizes)]
        if entry.wire == FP8:
            copies.calls.append(functools.partial(_unpack_fp8, target, *_fp8_views(buf_u8, entry)))
        else:
            copies.pairs.append((target, _wire_view(buf_u8, entry)))
    return copies


def holds_exactly(wire: torch.dtype, dtype: torch.dtype) -> bool:
    """Whether a tensor of ``dtype`` holds every value of ``wire`` exactly (its bits come back on a cast
    back): the same dtype, or a wider float of the same family (bf16 / fp16 in float32 or float64)."""
    wider = {torch.bfloat16: (torch.float32, torch.float64), torch.float16: (torch.float32, torch.float64)}
    return dtype == wire or dtype in wider.get(wire, ()) or (wire, dtype) == (torch.float32, torch.float64)


def bucket_repacker(
    buf_u8: torch.Tensor, bucket: Bucket, dst_tensors: dict[str, torch.Tensor]
) -> BucketCopies | None:
    """The copies that rebuild a bucket's wire bytes in ``buf_u8`` from the destination tensors it was
    unpacked into (the inverse of ``bucket_unpacker``, bit for bit), or None when a destination cannot
    give its wire values back (fp8 entries, a narrower dtype). Valid while tensors and buffer stay."""
    copies = BucketCopies()
    for entry in bucket.entries:
        _check_wire(entry)
        target = dst_tensors[entry.dst_name][_box(entry.dst_offsets, entry.sizes)]
        if entry.wire == FP8:
            return None
        wire = _wire_view(buf_u8, entry)
        if not holds_exactly(wire.dtype, target.dtype):
            return None
        copies.pairs.append((wire, target))
        copies.gaps += _gap(buf_u8, entry)
    return copies


def pack_bucket(
    buf_u8: torch.Tensor,
    bucket: Bucket,
    locals_: dict[str, tuple[torch.Tensor, tuple[int, ...]]],
) -> None:
    """Fill ``buf_u8[:bucket.payload_bytes]`` from the source's ``{name: (local tensor, box offsets)}``."""
    bucket_packer(buf_u8, bucket, locals_).run()


def unpack_bucket(buf_u8: torch.Tensor, bucket: Bucket, dst_tensors: dict[str, torch.Tensor]) -> None:
    """Scatter a received bucket into the destination tensors ``{engine name: local tensor}``."""
    bucket_unpacker(buf_u8, bucket, dst_tensors).run()


Trailer = tuple[int, int, int, int, int]  # (checksum, policy_version, sync_index, stream_id, bucket_index)


def trailers_bytes(
    sums: list[torch.Tensor] | None,
    ids: list[tuple[int, int]],
    *,
    policy_version: int,
    sync_index: int,
    device: torch.device,
) -> torch.Tensor:
    """32-byte trailers, one per ``(stream_id, bucket_index)`` in ``ids``, as one uint8 tensor on
    ``device`` (a stream's manifest, or one bucket's trailer). ``sums``: the buckets' ``checksum_tensor``
    values (None: no checksum); they are stacked on the device, with no host sync per bucket."""
    words = torch.tensor(
        [[0, policy_version, sync_index, (stream_id << 32) | index] for stream_id, index in ids],
        dtype=torch.int64,
        device=device,
    )
    if sums:
        words[:, 0] = torch.stack(sums)
    return words.view(torch.uint8).reshape(-1)


def write_trailer(
    out_u8: torch.Tensor,
    payload_u8: torch.Tensor,
    *,
    stream_id: int,
    bucket_index: int,
    policy_version: int,
    sync_index: int,
    checksum: int,
    bucket_sum: torch.Tensor | None = None,
) -> None:
    """Write the 32-byte trailer of ``payload_u8`` into ``out_u8``. ``checksum`` is the word stride of
    the checksum (1: every word), 0 for none; its phase is ``sync_index % checksum``. ``bucket_sum``:
    the payload's checksum already computed (e.g. by a cached ``Checksummer``)."""
    if checksum and bucket_sum is None:
        bucket_sum = checksum_tensor(payload_u8, checksum, sync_index)
    trailer = trailers_bytes(
        [bucket_sum] if checksum and bucket_sum is not None else None,
        [(stream_id, bucket_index)],
        policy_version=policy_version,
        sync_index=sync_index,
        device=out_u8.device,
    )
    out_u8[:TRAILER_BYTES].copy_(trailer)


def read_trailers(trailers_u8: torch.Tensor) -> list[Trailer]:
    """The trailers in a run of 32-byte trailers (one bucket's, or a stream's manifest)."""
    words = trailers_u8.view(torch.int64).view(-1, 4).tolist()
    return [(t, v, n, ident >> 32, ident & 0xFFFFFFFF) for t, v, n, ident in words]


def read_trailer(trailer_u8: torch.Tensor) -> Trailer:
    """``(checksum, policy_version, sync_index, stream_id, bucket_index)`` from a 32-byte trailer."""
    return read_trailers(trailer_u8[:TRAILER_BYTES])[0]
