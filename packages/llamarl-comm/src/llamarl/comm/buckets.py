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
    "checksum_tensor",
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


def checksum_tensor(payload_u8: torch.Tensor, stride: int = 1, phase: int = 0) -> torch.Tensor:
    """Wrapping int64 sum of a payload (uint8) read as int64 words, as a 0-d int64 tensor on the
    payload's device (no host sync, so a GPU keeps streaming); a ragged tail adds its bytes.

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
    total = torch.zeros((), dtype=torch.int64, device=payload_u8.device)
    if whole:
        words = payload_u8[:whole].view(torch.int64)
        total = words.sum() if stride <= 1 else words[phase % stride :: stride].sum() + words[-1]
    if whole != n:
        total = total + payload_u8[whole:].sum(dtype=torch.int64)
    return total


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
) -> None:
    """Write the 32-byte trailer of ``payload_u8`` into ``out_u8``. ``checksum`` is the word stride of
    the checksum (1: every word), 0 for none; its phase is ``sync_index % checksum``."""
    sums = [checksum_tensor(payload_u8, checksum, sync_index)] if checksum else None
    trailer = trailers_bytes(
        sums,
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
