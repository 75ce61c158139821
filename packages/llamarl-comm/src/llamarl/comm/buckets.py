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

import math

import torch

from llamarl.comm.layouts import dtype_from_str
from llamarl.comm.plan import BF16, FP8, Bucket, Entry

__all__ = [
    "FP8_MAX",
    "TRAILER_BYTES",
    "Trailer",
    "box_bytes",
    "bucket_checksum",
    "manifest_bytes",
    "pack_bucket",
    "read_trailer",
    "read_trailers",
    "trailer_words",
    "unpack_bucket",
    "write_trailer",
]

TRAILER_BYTES = 32
FP8_MAX = 448.0  # largest finite float8_e4m3fn


def _box(offsets: tuple[int, ...], sizes: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))


def bucket_checksum(payload_u8: torch.Tensor, stride: int = 1, phase: int = 0) -> int:
    """Wrapping int64 sum of a payload (uint8) read as int64 words; a ragged tail adds its bytes.

    ``stride > 1`` sums every ``stride``-th word starting at word ``phase``, plus the last one: a cheaper
    spot check (a fraction of the memory traffic) that still catches stale, shifted, misrouted or
    truncated buckets. Senders rotate ``phase`` with the sync index, so every word is checked once
    every ``stride`` syncs.
    """
    if payload_u8.data_ptr() % 8:
        # A box landing at an odd place in a tensor: sum an aligned copy, so both sides agree whatever
        # the alignment of their own memory.
        payload_u8 = payload_u8.clone()
    n = payload_u8.numel()
    whole = n - n % 8
    total = 0
    if whole:
        words = payload_u8[:whole].view(torch.int64)
        sampled = words if stride <= 1 else words[phase % stride :: stride]
        total = int(sampled.sum()) + (int(words[-1]) if stride > 1 else 0)
    if whole != n:
        total += int(payload_u8[whole:].sum(dtype=torch.int64))
    return (total + 2**63) % 2**64 - 2**63  # wrap like the int64 sum, so it fits the trailer


def box_bytes(tensor: torch.Tensor, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor | None:
    """The bytes of a box of ``tensor`` as one uint8 view, if the tensor is contiguous and the box is one
    run of memory there (see ``plan.is_contiguous_box``); None otherwise."""
    if not tensor.is_contiguous():
        return None
    start = sum(o * st for o, st in zip(offsets, tensor.stride(), strict=True))
    return tensor.reshape(-1)[start : start + math.prod(sizes)].view(torch.uint8)


def _fp8_rows(sizes: tuple[int, ...]) -> int:
    return sizes[0] if sizes else 1


def pack_entry(
    buf_u8: torch.Tensor, entry: Entry, local: torch.Tensor, local_offsets: tuple[int, ...]
) -> None:
    """Copy ``entry``'s box out of ``local`` (a source rank's tensor whose box starts at ``local_offsets``
    in the full parameter) into the bucket, casting for the wire."""
    region = local[
        _box(tuple(o - lo for o, lo in zip(entry.src_offsets, local_offsets, strict=True)), entry.sizes)
    ]
    numel = math.prod(entry.sizes)
    at = entry.byte_offset
    if entry.wire == "raw":
        dtype = dtype_from_str(entry.src_dtype)
        buf_u8[at : at + numel * dtype.itemsize].view(dtype).view(entry.sizes).copy_(region)
    elif entry.wire == BF16:
        buf_u8[at : at + numel * 2].view(torch.bfloat16).view(entry.sizes).copy_(region)
    elif entry.wire == FP8:
        rows = _fp8_rows(entry.sizes)
        rows_x = region.reshape(rows, -1).float()
        scale_r = (rows_x.abs().amax(dim=1) / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
        buf_u8[at : at + 4 * rows].view(torch.float32).copy_(scale_r)
        data = buf_u8[at + 4 * rows : at + 4 * rows + numel].view(torch.float8_e4m3fn).view(rows, -1)
        data.copy_((rows_x / scale_r[:, None]).clamp_(-FP8_MAX, FP8_MAX))
    else:
        raise ValueError(f"unknown wire kind {entry.wire!r}")


def unpack_entry(buf_u8: torch.Tensor, entry: Entry, dst: torch.Tensor) -> None:
    """Copy ``entry``'s box from the bucket into the local destination tensor ``dst``, in place."""
    target = dst[_box(entry.dst_offsets, entry.sizes)]
    numel = math.prod(entry.sizes)
    at = entry.byte_offset
    if entry.wire == "raw":
        dtype = dtype_from_str(entry.src_dtype)
        target.copy_(buf_u8[at : at + numel * dtype.itemsize].view(dtype).view(entry.sizes))
    elif entry.wire == BF16:
        target.copy_(buf_u8[at : at + numel * 2].view(torch.bfloat16).view(entry.sizes))
    elif entry.wire == FP8:
        rows = _fp8_rows(entry.sizes)
        scale_r = buf_u8[at : at + 4 * rows].view(torch.float32)
        data = buf_u8[at + 4 * rows : at + 4 * rows + numel].view(torch.float8_e4m3fn).view(rows, -1)
        target.copy_((data.float() * scale_r[:, None]).view(entry.sizes))
    else:
        raise ValueError(f"unknown wire kind {entry.wire!r}")


def pack_bucket(
    buf_u8: torch.Tensor,
    bucket: Bucket,
    locals_: dict[str, tuple[torch.Tensor, tuple[int, ...]]],
) -> None:
    """Fill ``buf_u8[:bucket.payload_bytes]`` from the source's ``{name: (local tensor, box offsets)}``."""
    for entry in bucket.entries:
        local, offsets = locals_[entry.src_name]
        pack_entry(buf_u8, entry, local, offsets)


def unpack_bucket(buf_u8: torch.Tensor, bucket: Bucket, dst_tensors: dict[str, torch.Tensor]) -> None:
    """Scatter a received bucket into the destination tensors ``{engine name: local tensor}``."""
    for entry in bucket.entries:
        unpack_entry(buf_u8, entry, dst_tensors[entry.dst_name])


Trailer = tuple[int, int, int, int, int]  # (checksum, policy_version, sync_index, stream_id, bucket_index)


def trailer_words(
    payload_u8: torch.Tensor,
    *,
    stream_id: int,
    bucket_index: int,
    policy_version: int,
    sync_index: int,
    checksum: int,
) -> list[int]:
    """The four int64 words of ``payload_u8``'s trailer. ``checksum`` is the word stride of the checksum
    (1: every word), 0 for none; its phase is ``sync_index % checksum``."""
    total = bucket_checksum(payload_u8, checksum, sync_index) if checksum else 0
    return [total, policy_version, sync_index, (stream_id << 32) | bucket_index]


def write_trailer(out_u8: torch.Tensor, payload_u8: torch.Tensor, **stamp: int) -> None:
    """Write the 32-byte trailer of ``payload_u8`` into ``out_u8`` (``stamp``: see ``trailer_words``)."""
    words = torch.tensor(trailer_words(payload_u8, **stamp), dtype=torch.int64)
    out_u8[:TRAILER_BYTES].view(torch.int64).copy_(words)


def manifest_bytes(rows: list[list[int]], device: torch.device) -> torch.Tensor:
    """Trailer words (one ``trailer_words`` row per bucket) as one uint8 message."""
    return torch.tensor(rows, dtype=torch.int64, device=device).view(torch.uint8).reshape(-1)


def read_trailers(trailers_u8: torch.Tensor) -> list[Trailer]:
    """The trailers in a run of 32-byte trailers (one bucket's, or a stream's manifest)."""
    words = trailers_u8.view(torch.int64).view(-1, 4).tolist()
    return [(t, v, n, ident >> 32, ident & 0xFFFFFFFF) for t, v, n, ident in words]


def read_trailer(trailer_u8: torch.Tensor) -> Trailer:
    """``(checksum, policy_version, sync_index, stream_id, bucket_index)`` from a 32-byte trailer."""
    return read_trailers(trailer_u8[:TRAILER_BYTES])[0]
