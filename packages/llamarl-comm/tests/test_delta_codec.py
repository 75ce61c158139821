"""The changed-only encoding (`llamarl.comm.delta`) on its own: exact for any bytes, the smallest kind,
refusals of payloads that do not fit; and the repacking a receiver rebuilds its base with."""

from __future__ import annotations

import pytest
import torch

from llamarl.comm.buckets import bucket_packer, bucket_repacker, bucket_unpacker
from llamarl.comm.delta import (
    BITMAP,
    BLOCK_BYTES,
    FULL,
    SPARSE,
    apply_delta,
    changed_positions,
    encode_delta,
    encoded_nbytes,
)
from llamarl.comm.plan import Bucket, Entry, entry_nbytes


def _changed(base: torch.Tensor, density: float, seed: int) -> torch.Tensor:
    """A copy of ``base`` (uint8) with about ``density`` of its bytes given new values."""
    g = torch.Generator().manual_seed(seed)
    cur = base.clone()
    mask = torch.rand(base.numel(), generator=g) < density
    cur[mask] ^= torch.randint(1, 256, (int(mask.sum()),), generator=g, dtype=torch.uint8)
    return cur


@pytest.mark.parametrize(
    ("density", "kind"), [(0.0, SPARSE), (0.01, SPARSE), (0.2, BITMAP), (0.95, FULL)], ids=str
)
@pytest.mark.parametrize("n", [8, 1001, 3 * BLOCK_BYTES + 5])
def test_round_trip_is_exact_and_picks_the_smallest_kind(n: int, density: float, kind: int) -> None:
    g = torch.Generator().manual_seed(n)
    base = torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8)
    cur = _changed(base, density, seed=1)
    shadow, receiver = base.clone(), base.clone()
    out = torch.empty(n, dtype=torch.uint8)
    encoded = encode_delta(cur, shadow, out)
    assert torch.equal(shadow, cur)  # the sender's shadow moved on
    assert encoded.changed == int((cur != base).sum())
    sizes = {k: encoded_nbytes(k, n, encoded.changed) for k in (FULL, SPARSE, BITMAP)}
    assert encoded.nbytes == min(sizes.values()) == sizes[encoded.kind]
    if n > 1000:  # (8 bytes are cheapest sent whole, whatever changed)
        assert encoded.kind == kind, (encoded, sizes)
    payload = shadow if encoded.kind == FULL else out[: encoded.nbytes]
    apply_delta(encoded.kind, payload, encoded.changed, receiver)
    assert torch.equal(receiver, cur)


def test_bit_patterns_of_any_dtype_are_rebuilt_exactly() -> None:
    """Compared as bytes: NaN payloads, -0.0, fp8 and integers come back bit for bit."""
    odd = torch.tensor([float("nan"), -0.0, 0.0, float("inf"), 1e-40, -3.5])
    tensors = {
        "bfloat16": odd.to(torch.bfloat16),
        "float8_e4m3fn": odd.clamp(-448, 448).nan_to_num(0.0).to(torch.float8_e4m3fn),
        "float32": odd,
        "int64": torch.tensor([-1, 0, 2**62, 7]),
    }
    for name, t in tensors.items():
        before = t.view(torch.uint8).clone()
        after = before.clone()
        after[::3] ^= 0x81  # sign bits and low bits
        shadow, receiver, out = before.clone(), before.clone(), torch.empty_like(before)
        encoded = encode_delta(after, shadow, out)
        payload = shadow if encoded.kind == FULL else out[: encoded.nbytes]
        apply_delta(encoded.kind, payload, encoded.changed, receiver)
        assert torch.equal(receiver, after), name


def test_the_payload_may_be_written_over_the_new_bytes() -> None:
    """A sender packs a bucket into its send slot and encodes it into the same slot."""
    base = torch.randint(
        0, 256, (4 * BLOCK_BYTES,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)
    )
    cur = _changed(base, 0.02, seed=2)
    slot, shadow, receiver = cur.clone(), base.clone(), base.clone()
    encoded = encode_delta(slot, shadow, slot)
    assert encoded.kind == SPARSE
    apply_delta(encoded.kind, slot[: encoded.nbytes], encoded.changed, receiver)
    assert torch.equal(receiver, cur) and torch.equal(shadow, cur)


@pytest.mark.parametrize("offset", [0, 3])
def test_changed_positions_word_and_byte_paths_agree(offset: int) -> None:
    """Aligned memory is compared as int64 words first; a box at an odd address byte by byte."""
    g = torch.Generator().manual_seed(offset)
    storage_a = torch.randint(0, 256, (2 * BLOCK_BYTES + 13,), generator=g, dtype=torch.uint8)
    storage_b = _changed(storage_a, 0.03, seed=3)
    for pos in (0, 7, 8, BLOCK_BYTES - 1, BLOCK_BYTES, storage_a.numel() - 1):  # edges of words and blocks
        storage_b[pos] ^= 1
    a, b = storage_a[offset:], storage_b[offset:]
    want = (a != b).nonzero().squeeze(1)
    assert torch.equal(changed_positions(a, b), want)


def test_payloads_that_do_not_fit_the_bucket_are_refused() -> None:
    n = 2 * BLOCK_BYTES
    base = torch.zeros(n, dtype=torch.uint8)
    cur = base.clone()
    cur[[5, BLOCK_BYTES + 9]] = 1
    out = torch.empty(n, dtype=torch.uint8)
    encoded = encode_delta(cur, base.clone(), out)
    assert encoded.kind == SPARSE and encoded.changed == 2
    payload = out[: encoded.nbytes]
    with pytest.raises(ValueError, match="payload of 3 changes"):
        apply_delta(SPARSE, payload, 3, base.clone())
    wrong_counts = payload.clone()
    wrong_counts[:8].view(torch.int32).copy_(torch.tensor([2, 1], dtype=torch.int32))
    with pytest.raises(ValueError, match="block counts sum to 3"):
        apply_delta(SPARSE, wrong_counts, 2, base.clone())
    short = BLOCK_BYTES + 100  # two blocks, the second one short
    past_the_end = torch.zeros(encoded_nbytes(SPARSE, short, 2), dtype=torch.uint8)
    past_the_end[:8].view(torch.int32).copy_(torch.tensor([0, 2], dtype=torch.int32))
    past_the_end[8:12].view(torch.int16).copy_(torch.tensor([5, -1], dtype=torch.int16))  # offset 0xFFFF
    with pytest.raises(ValueError, match="a change at byte"):
        apply_delta(SPARSE, past_the_end, 2, torch.zeros(short, dtype=torch.uint8))


def _bucket(entries: list[tuple[str, tuple[int, ...], str, str]]) -> Bucket:
    out, at = [], 0
    for name, sizes, src_dtype, wire in entries:
        nbytes = entry_nbytes(sizes, src_dtype, wire)
        out.append(
            Entry(
                src_name=name,
                src_offsets=(0,) * len(sizes),
                sizes=sizes,
                src_dtype=src_dtype,
                wire=wire,
                dst_name=name,
                dst_offsets=(0,) * len(sizes),
                byte_offset=at,
                nbytes=nbytes,
            )
        )
        at += nbytes
    return Bucket(index=0, entries=tuple(out), payload_bytes=at)


@pytest.mark.parametrize("dst_dtype", [torch.bfloat16, torch.float32])
def test_a_receiver_rebuilds_bf16_wire_bytes_from_its_tensors(dst_dtype: torch.dtype) -> None:
    """bf16 on the wire into bf16 or float32 tensors: repacking them gives the wire bytes back exactly."""
    bucket = _bucket([("w", (5, 3), "float32", "bfloat16"), ("b", (5,), "float32", "bfloat16")])
    src = {"w": (torch.randn(5, 3), (0, 0)), "b": (torch.randn(5), (0,))}
    wire = torch.empty(bucket.payload_bytes, dtype=torch.uint8)
    bucket_packer(wire, bucket, src).run()
    dst = {"w": torch.zeros(5, 3, dtype=dst_dtype), "b": torch.zeros(5, dtype=dst_dtype)}
    bucket_unpacker(wire, bucket, dst).run()
    rebuilt = torch.zeros_like(wire)
    repack = bucket_repacker(rebuilt, bucket, dst)
    assert repack is not None
    repack.run()
    assert torch.equal(rebuilt, wire)


def test_fp8_wire_bytes_cannot_be_rebuilt_from_the_tensors() -> None:
    """fp8 values times their row scale, rounded into the destination, do not give the fp8 bytes back:
    such buckets keep a shadow on the receiver."""
    bucket = _bucket([("w", (4, 8), "float32", "float8_e4m3fn")])
    assert (
        bucket_repacker(
            torch.empty(bucket.payload_bytes, dtype=torch.uint8), bucket, {"w": torch.zeros(4, 8)}
        )
        is None
    )
    narrower = _bucket([("w", (4, 8), "float32", "bfloat16")])
    dst = {"w": torch.zeros(4, 8, dtype=torch.float16)}  # bf16 values do not all fit in fp16
    assert bucket_repacker(torch.empty(narrower.payload_bytes, dtype=torch.uint8), narrower, dst) is None


def test_changed_only_syncs_are_on_by_default_where_values_travel_in_two_bytes_or_fewer() -> None:
    """A float32 weight changes its bits at almost every step: whole syncs are cheaper there."""
    from llamarl.comm.sender import narrow_on_the_wire

    fp32 = {"w": torch.zeros(64, 64), "b": torch.zeros(64)}
    assert not narrow_on_the_wire(fp32, None)
    assert narrow_on_the_wire(fp32, torch.bfloat16) and narrow_on_the_wire(fp32, torch.float8_e4m3fn)
    mostly_bf16 = {"w": torch.zeros(64, 64, dtype=torch.bfloat16), "norm": torch.zeros(64)}
    assert narrow_on_the_wire(mostly_bf16, None)
    assert not narrow_on_the_wire({"steps": torch.zeros(8, dtype=torch.int64)}, None)  # nothing to narrow
