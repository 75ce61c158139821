"""Transfer plans, buckets and layouts to the byte: the exact streams, chains, buckets and boxes a small
plan holds, each rank's schedule, the errors word for word, the checksum against a reference written
from its definition, and the layouts' round trips. In one process and fast: these are the tests that
mutation testing (tools/mutation_test.py comm) runs against every planted bug in plan.py, buckets.py and
layouts.py, so they pin values, not only properties."""

from __future__ import annotations

import math

import pytest
import torch

from llamarl.comm import (
    DestLayout,
    DestTensor,
    PlanError,
    SourceLayout,
    fused,
    make_plan,
    replicated,
    tp_shard,
)
from llamarl.comm import plan as plan_module
from llamarl.comm.buckets import (
    TRAILER_BYTES,
    Checksummer,
    box_bytes,
    bucket_checksum,
    checksum_tensor,
    pack_bucket,
    read_trailer,
    trailers_bytes,
    unpack_bucket,
    write_trailer,
)
from llamarl.comm.layouts import (
    Piece,
    SourceTensor,
    chunk_range,
    dtype_from_str,
    dtype_to_str,
    named_tensors_of,
    source_layout,
)
from llamarl.comm.plan import Bucket, Entry, entry_nbytes, is_contiguous_box, plan_summary, wire_kind

pytestmark = pytest.mark.timeout(60)

FP8, BF16 = "float8_e4m3fn", "bfloat16"


def rows_held(holdings: dict[int, tuple[int, int]], shape=(8, 3), name="w", dtype="float32", wire=None):
    """Source layouts where rank r holds rows [start, start + n) of `name` (FSDP2-like)."""
    return {
        r: SourceLayout(
            wire_dtype=wire,
            tensors={
                name: SourceTensor(
                    name=name,
                    full_shape=shape,
                    dtype=dtype,
                    offsets=(start,) + (0,) * (len(shape) - 1),
                    sizes=(n, *shape[1:]),
                )
            },
        )
        for r, (start, n) in holdings.items()
    }


def whole(
    name: str, shape: tuple[int, ...], dtype: str = "float32", rank: int = 0
) -> dict[int, SourceLayout]:
    """One source rank holding the whole `name`."""
    return rows_held({rank: (0, shape[0])}, shape=shape, name=name, dtype=dtype)


def boxes(plan) -> list[list[list[tuple]]]:
    """Per stream, per bucket: (src_offsets, sizes, byte_offset) of each entry."""
    return [
        [[(e.src_offsets, e.sizes, e.byte_offset) for e in b.entries] for b in s.buckets]
        for s in plan.streams
    ]


# --------------------------------------------------------------------------------------------------
# A plan, all of it


def test_a_sharded_source_to_three_replicas_is_planned_to_the_byte():
    # Rank 0 holds rows 0-5 of w [8, 8] (32 B a row), rank 1 rows 6-7; ranks 2-4 are one replica class.
    sources = rows_held({0: (0, 6), 1: (6, 2)}, shape=(8, 8))
    dests = {r: replicated({"w": torch.zeros(8, 8)}) for r in (2, 3, 4)}
    plan = make_plan(sources, dests, bucket_bytes=64, direct_min_bytes=1 << 30)
    assert (plan.source_ranks, plan.dest_ranks, plan.bucket_bytes) == ((0, 1), (2, 3, 4), 64)
    # One stream per source, relayed along the class; the second chain starts one member later.
    assert [(s.stream_id, s.src, s.chain) for s in plan.streams] == [(0, 0, (2, 3, 4)), (1, 1, (3, 4, 2))]
    # Two rows (64 B) a bucket, each box where it sits in w, on both sides.
    assert boxes(plan) == [
        [[((0, 0), (2, 8), 0)], [((2, 0), (2, 8), 0)], [((4, 0), (2, 8), 0)]],
        [[((6, 0), (2, 8), 0)]],
    ]
    for stream in plan.streams:
        assert [b.index for b in stream.buckets] == list(range(len(stream.buckets)))
        assert stream.num_direct == 0 and not any(b.direct or b.src_copy for b in stream.buckets)
        for bucket in stream.buckets:
            assert bucket.payload_bytes == 64
            (entry,) = bucket.entries
            assert entry == Entry(
                src_name="w", src_offsets=entry.src_offsets, sizes=(2, 8), src_dtype="float32", wire="raw",
                dst_name="w", dst_offsets=entry.src_offsets, byte_offset=0, nbytes=64,
            )  # fmt: skip
    # Who relays to whom.
    first, second = plan.streams
    assert [first.upstream(r) for r in (2, 3, 4)] == [0, 2, 3]
    assert [first.downstream(r) for r in (0, 2, 3, 4)] == [2, 3, 4, None]
    assert [second.upstream(r) for r in (3, 4, 2)] == [1, 3, 4]
    assert [second.downstream(r) for r in (1, 3, 4, 2)] == [3, 4, 2, None]

    # Every rank's part in the global order: bucket index first, then stream id.
    def order(rank: int) -> list[tuple[int, int]]:
        return [(s.stream_id, b.index) for s, b in plan.schedule(rank)]

    assert order(2) == order(3) == order(4) == [(0, 0), (1, 0), (0, 1), (0, 2)]
    assert order(0) == [(0, 0), (0, 1), (0, 2)] and order(1) == [(1, 0)] and order(9) == []
    assert plan.bytes_sent_by() == {0: 192, 1: 64} and plan.num_buckets() == 4
    assert first.nbytes == 192 and second.nbytes == 64
    assert plan_summary(plan) == {"num_streams": 2, "num_buckets": 4, "payload_bytes": 256}
    assert plan.describe() == (
        "plan: 2 streams, 4 buckets of <= 64 B\n"
        "  stream 0: 0 -> 2 -> 3 -> 4: 192 B in 3 buckets\n"
        "  stream 1: 1 -> 3 -> 4 -> 2: 64 B in 1 buckets"
    )


def test_replicated_sources_share_the_work_by_bytes_not_by_count():
    # Both sources hold everything; a (float64, 64 B) goes to rank 0, then b and c (float32, 32 B each)
    # to rank 1, the less loaded one, so each sends 64 B.
    specs = {"a": ((8,), "float64"), "b": ((8,), "float32"), "c": ((8,), "float32")}
    layout = SourceLayout(
        tensors={
            n: SourceTensor(name=n, full_shape=shape, dtype=dtype, offsets=(0,), sizes=shape)
            for n, (shape, dtype) in specs.items()
        }
    )
    dest = replicated({n: (shape, dtype_from_str(dtype)) for n, (shape, dtype) in specs.items()})
    plan = make_plan({0: layout, 1: layout}, {2: dest}, bucket_bytes=1024, direct_min_bytes=1 << 30)
    assert plan.bytes_sent_by() == {0: 64, 1: 64}
    assert [(s.src, [e.src_name for b in s.buckets for e in b.entries]) for s in plan.streams] == [
        (0, ["a"]),
        (1, ["b", "c"]),
    ]


@pytest.mark.parametrize(
    ("shape", "bucket_bytes", "expected"),
    [
        # A box that fills the bucket exactly stays whole.
        ((4, 4), 64, [[((0, 0), (4, 4), 0)]]),
        # As many whole rows as fit (5 rows of 12 B: 60 B, aligned to 64), the rest in the next bucket.
        ((8, 3), 64, [[((0, 0), (5, 3), 0)], [((5, 0), (3, 3), 0)]]),
        ((8, 4), 64, [[((0, 0), (4, 4), 0)], [((4, 0), (4, 4), 0)]]),
        # Two rows of 160 B: each row is cut along its columns; a bucket's rest takes the next piece.
        (
            (2, 40),
            64,
            [
                [((0, 0), (1, 16), 0)],
                [((0, 16), (1, 16), 0)],
                [((0, 32), (1, 8), 0), ((1, 0), (1, 8), 32)],
                [((1, 8), (1, 16), 0)],
                [((1, 24), (1, 16), 0)],
            ],
        ),
    ],
)
def test_boxes_are_cut_to_fill_each_bucket(shape, bucket_bytes, expected):
    dests = {1: replicated({"w": torch.zeros(shape)})}
    plan = make_plan(whole("w", shape), dests, bucket_bytes=bucket_bytes, direct_min_bytes=1 << 30)
    assert boxes(plan) == [expected]
    for bucket in plan.streams[0].buckets:
        assert bucket.payload_bytes == sum(e.nbytes for e in bucket.entries) <= bucket_bytes
        assert all(e.nbytes == entry_nbytes(e.sizes, "float32", "raw") for e in bucket.entries)


def test_direct_buckets_start_at_direct_min_bytes_and_come_first():
    # w: 16 floats (64 B) whole at the destination; its column slice of a [4, 8] tensor is not one run of
    # the source's memory (sent from a staging copy); n: 15 floats (60 B), under the threshold.
    sources = {
        0: SourceLayout(
            tensors={
                "n": SourceTensor(name="n", full_shape=(15,), dtype="float32", offsets=(0,), sizes=(15,)),
                "m": SourceTensor(name="m", full_shape=(4, 8), dtype="float32", offsets=(0, 0), sizes=(4, 8)),
                "w": SourceTensor(name="w", full_shape=(16,), dtype="float32", offsets=(0,), sizes=(16,)),
            }
        )
    }
    cols = tp_shard("m", (4, 8), torch.float32, dim=1, tp_rank=0, tp_size=2)  # [4, 4]: 64 B
    dests = {
        1: DestLayout.of([*replicated({"n": torch.zeros(15), "w": torch.zeros(16)}).tensors.values(), cols])
    }
    plan = make_plan(sources, dests, bucket_bytes=1024, direct_min_bytes=64)
    (stream,) = plan.streams
    kinds = [(b.index, b.direct, b.src_copy, [e.src_name for e in b.entries]) for b in stream.buckets]
    assert kinds == [(0, True, False, ["w"]), (1, True, True, ["m"]), (2, False, False, ["n"])]
    assert stream.num_direct == 2
    plan = make_plan(sources, dests, bucket_bytes=1024, direct_min_bytes=65)
    assert [b.direct for b in plan.streams[0].buckets] == [False]  # all three packed together


def test_a_stream_holds_at_most_max_buckets(monkeypatch):
    monkeypatch.setattr(plan_module, "MAX_BUCKETS_PER_STREAM", 3)
    dests = {1: replicated({"w": torch.zeros(12, 4)})}  # 16 B a row: four rows a 64 B bucket
    assert make_plan(whole("w", (12, 4)), dests, bucket_bytes=64).num_buckets() == 3
    dests = {1: replicated({"w": torch.zeros(13, 4)})}
    with pytest.raises(PlanError) as error:
        make_plan(whole("w", (13, 4)), dests, bucket_bytes=64)
    assert str(error.value) == (
        "4 buckets from source rank 0 to ranks (1,): at most 3 per stream (raise bucket_bytes or "
        "direct_min_bytes)"
    )


# --------------------------------------------------------------------------------------------------
# Errors, word for word


def plan_error(*args, **kwargs) -> str:
    with pytest.raises(PlanError) as error:
        make_plan(*args, **kwargs)
    return str(error.value)


def test_bad_groups_and_sizes_are_refused():
    dests = {1: replicated({"w": torch.zeros(2, 3)})}
    assert plan_error(whole("w", (2, 3)), dests, bucket_bytes=63) == "bucket_bytes=63 is too small"
    assert make_plan(whole("w", (2, 3)), dests, bucket_bytes=64).num_buckets() == 1
    assert plan_error({}, dests) == "no source rank in the group"
    two = whole("w", (2, 3)) | whole("w", (2, 3), rank=1)
    both_sides = dests | {2: replicated({"w": torch.zeros(2, 3)})}
    assert plan_error(two, both_sides) == "ranks [1] are both source and destination"


def test_sources_must_agree():
    both = rows_held({0: (0, 1), 1: (1, 1)}, shape=(2, 3))
    both[1].wire_dtype = BF16
    dests = {2: replicated({"w": torch.zeros(2, 3)})}
    assert plan_error(both, dests) == "source ranks disagree on the wire dtype: ['None', 'bfloat16']"
    outside = rows_held({0: (1, 2)}, shape=(2, 3))
    assert plan_error(outside, dests) == "source rank 0: w box (1, 0)+(2, 3) outside (2, 3)"
    other_shape = rows_held({0: (0, 1)}, shape=(2, 3)) | rows_held({1: (1, 1)}, shape=(2, 4))
    assert plan_error(other_shape, dests) == (
        "source ranks disagree on w: ((2, 3), 'float32') vs ((2, 4), 'float32') (rank 1)"
    )


def test_destinations_must_fit_the_sources():
    ten = {
        0: SourceLayout(
            tensors={
                f"p{i}": SourceTensor(
                    name=f"p{i}", full_shape=(2,), dtype="float32", offsets=(0,), sizes=(2,)
                )
                for i in range(10)
            }
        )
    }
    wants_q = {1: replicated({"q": torch.zeros(2)}), 2: replicated({"q": torch.zeros(2)})}
    assert plan_error(ten, wants_q) == (
        "destination rank 1: tensor 'q' needs 'q', which no source rank holds (source names: "
        "['p0', 'p1', 'p2', 'p3', 'p4', 'p5', 'p6', 'p7']...)"
    )
    src = whole("w", (4,))
    beyond = Piece(src_name="w", src_offsets=(2,), dst_offsets=(0,), sizes=(4,))
    too_far = DestTensor(name="w", shape=(4,), dtype="float32", pieces=(beyond,))
    pair = {1: DestLayout.of([too_far]), 2: DestLayout.of([too_far])}  # the class is named by its first
    assert plan_error(src, pair) == (
        "destination rank 1: 'w' wants w[(2,)+(4,)], outside its shape (4,) on the source"
    )
    spill = Piece(src_name="w", src_offsets=(0,), dst_offsets=(1,), sizes=(4,))
    spilled = DestTensor(name="w", shape=(4,), dtype="float32", pieces=(spill,))
    assert plan_error(src, {1: DestLayout.of([spilled]), 2: DestLayout.of([spilled])}) == (
        f"destination rank 1: piece {spill} falls outside w (4,)"
    )


def test_dtypes_change_only_between_floats_and_only_with_a_wire_dtype():
    half = {1: replicated({"w": torch.zeros(4, dtype=torch.float16)})}
    assert plan_error(whole("w", (4,)), half) == (
        "dtype mismatch for 'w' on destination rank 1: source w is float32, destination is float16 "
        "(set the sender's wire_dtype to cast floats)"
    )
    cast = rows_held({0: (0, 4)}, shape=(4,), wire=BF16)
    assert make_plan(cast, half).num_buckets() == 1  # floats cast on the wire
    ints = {1: replicated({"w": torch.zeros(4, dtype=torch.int32)})}
    assert "source w is float32, destination is int32" in plan_error(cast, ints)
    int_source = rows_held({0: (0, 4)}, shape=(4,), dtype="int32", wire=BF16)
    assert "source w is int32, destination is float16" in plan_error(int_source, half)


def test_every_element_needs_a_source_that_holds_it_whole():
    # Rank 0's box of w is empty (an FSDP2 shard of nothing); nobody else holds w.
    empty = rows_held({0: (0, 0)}, shape=(4, 2))
    dests = {1: replicated({"w": torch.zeros(4, 2)})}
    assert plan_error(empty, dests) == "w[(0, 0)+(4, 2)] (for w) is held whole by no source rank"
    half = tp_shard("w", (4, 2), torch.float32, dim=0, tp_rank=0, tp_size=2)
    short = DestTensor(name="w", shape=(4, 2), dtype="float32", pieces=half.pieces)
    assert plan_error(whole("w", (4, 2)), {1: DestLayout.of([short])}) == (
        "destination rank 1: the pieces of 'w' cover 4 of 8 elements"
    )


@pytest.mark.parametrize("num_unused", [8, 9])
def test_unwanted_source_parameters_are_named(num_unused):
    """The first eight are named, then "..." when there are more."""
    names = [f"p{i}" for i in range(num_unused)] + ["w"]
    layout = SourceLayout(
        tensors={
            n: SourceTensor(name=n, full_shape=(2,), dtype="float32", offsets=(0,), sizes=(2,)) for n in names
        }
    )
    dests = {1: replicated({"w": torch.zeros(2)})}
    shown = str([f"p{i}" for i in range(8)]) + ("..." if num_unused > 8 else "")
    assert plan_error({0: layout}, dests) == (
        f"source parameters no destination wants: {shown} (a name mismatch? pass strict=False to allow)"
    )
    assert make_plan({0: layout}, dests, strict=False).num_buckets() == 1


# --------------------------------------------------------------------------------------------------
# Wire kinds, sizes, contiguity


@pytest.mark.parametrize(
    ("dtype", "ndim", "wire", "kind"),
    [
        ("float32", 2, None, "raw"),
        ("int64", 2, BF16, "raw"),
        ("float32", 2, BF16, BF16),
        ("float64", 1, BF16, BF16),
        ("float16", 2, BF16, "raw"),  # no narrower than the wire type
        ("float32", 2, FP8, FP8),
        ("bfloat16", 2, FP8, FP8),
        ("float32", 1, FP8, BF16),  # 1-d tensors (norms, biases) go as bf16
        ("bfloat16", 1, FP8, "raw"),
        ("float8_e4m3fn", 2, FP8, "raw"),
    ],
)
def test_wire_kind(dtype, ndim, wire, kind):
    assert wire_kind(dtype, ndim, wire) == kind


def test_an_unknown_wire_dtype_or_kind_is_refused():
    with pytest.raises(PlanError) as error:
        wire_kind("float32", 2, "float16")
    assert str(error.value) == "unsupported wire dtype 'float16' (use bfloat16 or float8_e4m3fn)"
    with pytest.raises(PlanError) as error:
        entry_nbytes((2,), "float32", "fp4")
    assert str(error.value) == "unknown wire kind 'fp4'"


def test_entry_sizes_are_aligned_to_eight_bytes():
    assert entry_nbytes((3, 5), "float32", "raw") == 64  # 60
    assert entry_nbytes((1,), "uint8", "raw") == 8  # 1
    assert entry_nbytes((4, 2), "float64", "raw") == 64
    assert entry_nbytes((3, 5), "float32", BF16) == 32  # 30
    # fp8: one float32 scale per leading row, then a byte per value.
    assert entry_nbytes((8, 1), "float32", FP8) == 40  # 32 + 8
    assert entry_nbytes((3, 5), "float32", FP8) == 32  # 12 + 15
    assert entry_nbytes((), "float32", FP8) == 8  # 4 + 1


@pytest.mark.parametrize(
    ("sizes", "shape", "contiguous"),
    [
        ((1, 4), (3, 4), True),
        ((2, 4), (3, 4), True),
        ((2, 3), (3, 4), False),
        ((1, 3), (3, 4), True),  # a part of one row
        ((1, 1, 5), (2, 3, 5), True),
        ((1, 2, 4), (2, 3, 5), False),
        ((1, 1), (3, 4), True),
    ],
)
def test_is_contiguous_box(sizes, shape, contiguous):
    assert is_contiguous_box((0,) * len(shape), sizes, shape) == contiguous


# --------------------------------------------------------------------------------------------------
# Buckets: checksums, trailers, packing


def reference_checksum(payload: bytes, stride: int, phase: int) -> int:
    """The checksum by its definition: the int64 words (little-endian) of the payload cut into rows of
    `stride`; column `phase % stride` of every row but the last, all of the last row, plus every byte
    of a ragged tail, summed with int64 wrap-around."""
    whole = len(payload) - len(payload) % 8
    words = [int.from_bytes(payload[i : i + 8], "little", signed=True) for i in range(0, whole, 8)]
    rows = (len(words) - 1) // stride if stride > 1 else 0
    picked = [words[r * stride + phase % stride] for r in range(rows)] + words[rows * stride :]
    total = sum(picked) + sum(payload[whole:])
    return (total + 2**63) % 2**64 - 2**63


@pytest.mark.parametrize("size", [0, 5, 8, 16, 8 * 7, 8 * 9 + 1, 8 * 64 + 3])
@pytest.mark.parametrize("stride", [1, 2, 3, 8])
def test_checksum_is_its_definition(size, stride):
    g = torch.Generator().manual_seed(size * 10 + stride)
    payload = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g)
    raw = bytes(payload.tolist())
    for phase in (0, 1, 5):
        got = Checksummer(payload, stride)(phase)
        assert got.dtype == torch.int64 and got.dim() == 0
        assert int(got) == reference_checksum(raw, stride, phase), phase
        assert bucket_checksum(payload, stride, phase) == reference_checksum(raw, stride, phase)
    # Defaults: every word (stride 1), phase 0.
    assert bucket_checksum(payload) == int(checksum_tensor(payload)) == reference_checksum(raw, 1, 0)
    assert (
        int(Checksummer(payload, stride)())
        == int(checksum_tensor(payload, stride))
        == (reference_checksum(raw, stride, 0))
    )
    assert int(Checksummer(payload)(1)) == reference_checksum(raw, 1, 0)
    # At any address: a payload at an odd offset sums as the same bytes aligned.
    carrier = torch.zeros(size + 16, dtype=torch.uint8)
    for offset in range(1, 16):
        carrier[offset : offset + size] = payload
        assert bucket_checksum(carrier[offset : offset + size], stride, 5) == reference_checksum(
            raw, stride, 5
        )


def test_trailers_carry_the_checksum_asked_for():
    payload = torch.arange(40, dtype=torch.uint8)
    out = torch.zeros(TRAILER_BYTES, dtype=torch.uint8)
    stamp = {"stream_id": 3, "bucket_index": 7, "policy_version": 11, "sync_index": 5}
    write_trailer(out, payload, checksum=0, **stamp)  # checksums off
    assert read_trailer(out) == (0, 11, 5, 3, 7)
    write_trailer(out, payload, checksum=4, **stamp)  # a spot check at phase sync_index
    assert read_trailer(out) == (reference_checksum(bytes(payload.tolist()), 4, 5), 11, 5, 3, 7)
    write_trailer(out, payload, checksum=4, bucket_sum=torch.tensor(12345), **stamp)  # computed already
    assert read_trailer(out) == (12345, 11, 5, 3, 7)
    write_trailer(out, payload, checksum=0, bucket_sum=torch.tensor(12345), **stamp)  # off wins
    assert read_trailer(out) == (0, 11, 5, 3, 7)
    words = trailers_bytes(None, [(1, 2)], policy_version=3, sync_index=4, device=torch.device("cpu"))
    assert (
        words.dtype == torch.uint8
        and words.tolist()
        == torch.tensor([0, 3, 4, (1 << 32) | 2], dtype=torch.int64).view(torch.uint8).tolist()
    )


def test_box_bytes_is_the_box_in_memory_or_none():
    t = torch.arange(12, dtype=torch.int32).reshape(3, 4)
    assert box_bytes(t, (1, 0), (1, 4)).view(torch.int32).tolist() == [4, 5, 6, 7]
    assert box_bytes(t, (1, 0), (2, 4)).view(torch.int32).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert box_bytes(t, (2, 1), (1, 2)).view(torch.int32).tolist() == [9, 10]
    assert box_bytes(t.t(), (0, 0), (1, 3)) is None  # not contiguous: no view


def test_fp8_boxes_scale_each_row_on_its_own():
    # Rows a million times apart: one scale for the box would round the small row to zero.
    region = torch.tensor([[1000.0, -500.0, 250.0], [0.001, 0.002, -0.003]])
    entry = Entry(
        src_name="w", src_offsets=(0, 0), sizes=(2, 3), src_dtype="float32", wire=FP8, dst_name="w",
        dst_offsets=(0, 0), byte_offset=8, nbytes=entry_nbytes((2, 3), "float32", FP8),
    )  # fmt: skip
    bucket = Bucket(index=0, entries=(entry,), payload_bytes=8 + entry.nbytes)
    buf = torch.zeros(bucket.payload_bytes, dtype=torch.uint8)
    pack_bucket(buf, bucket, {"w": (region, (0, 0))})
    scales = buf[8:16].view(torch.float32)
    torch.testing.assert_close(scales, region.abs().amax(dim=1) / 448.0)
    out = {"w": torch.zeros(2, 3)}
    unpack_bucket(buf, bucket, out)
    assert ((out["w"] - region).abs() / region.abs().amax(dim=1, keepdim=True)).max() <= 2**-4


def test_only_raw_and_bf16_boxes_are_plain_views_of_a_bucket():
    from llamarl.comm.buckets import _wire_view

    entry = Entry(
        src_name="w", src_offsets=(0, 0), sizes=(1, 2), src_dtype="float32", wire=FP8, dst_name="w",
        dst_offsets=(0, 0), byte_offset=0, nbytes=8,
    )  # fmt: skip
    with pytest.raises(ValueError) as error:
        _wire_view(torch.zeros(8, dtype=torch.uint8), entry)
    assert str(error.value) == "wire kind 'float8_e4m3fn' is not a plain view"


def test_unknown_wire_kinds_are_refused_by_the_packer():
    entry = Entry(
        src_name="w", src_offsets=(0,), sizes=(2,), src_dtype="float32", wire="fp4", dst_name="w",
        dst_offsets=(0,), byte_offset=0, nbytes=8,
    )  # fmt: skip
    bucket = Bucket(index=0, entries=(entry,), payload_bytes=8)
    with pytest.raises(ValueError) as error:
        unpack_bucket(torch.zeros(8, dtype=torch.uint8), bucket, {"w": torch.zeros(2)})
    assert str(error.value) == "unknown wire kind 'fp4'"


# --------------------------------------------------------------------------------------------------
# Layouts


def test_dtype_names():
    assert dtype_to_str(torch.bfloat16) == "bfloat16" and dtype_from_str("bfloat16") is torch.bfloat16
    for name in ("nope", "Tensor"):
        with pytest.raises(ValueError) as error:
            dtype_from_str(name)
        assert str(error.value) == f"unknown dtype {name!r}"


def test_chunk_range_splits_like_torch_chunk():
    for size, chunks in ((10, 4), (3, 4), (8, 2), (1, 3)):
        lengths = [t.numel() for t in torch.arange(size).chunk(chunks)]
        lengths += [0] * (chunks - len(lengths))
        starts = [sum(lengths[:i]) for i in range(chunks)]
        assert [chunk_range(size, chunks, i) for i in range(chunks)] == list(
            zip(starts, lengths, strict=True)
        )
    assert chunk_range(0, 2, 1) == (0, 0)


def test_layouts_go_through_json_unchanged():
    source = SourceLayout(
        tensors={
            "a": SourceTensor(name="a", full_shape=(4, 2), dtype="float32", offsets=(2, 0), sizes=(2, 2)),
            "b": SourceTensor(
                name="b", full_shape=(3,), dtype="bfloat16", offsets=(0,), sizes=(3,), contiguous=False
            ),
        },
        wire_dtype=BF16,
        bucket_bytes=4096,
        checksum=8,
        direct_min_bytes=1024,
    )
    data = source.to_json()
    assert data["role"] == "source" and [t["name"] for t in data["tensors"]] == ["a", "b"]
    assert SourceLayout.from_json(data) == source
    dest = DestLayout.of(
        [
            fused("ab", [("a", (4, 2)), ("c", (2, 2))], torch.float32, tp_rank=1, tp_size=2),
            tp_shard("b", (3,), torch.bfloat16, dim=0, tp_rank=0, tp_size=1),
        ]
    )
    assert dest.to_json() == {
        "role": "dest",
        "tensors": [
            {
                "name": "ab",
                "shape": (3, 2),
                "dtype": "float32",
                "pieces": (
                    {"src_name": "a", "src_offsets": (2, 0), "dst_offsets": (0, 0), "sizes": (2, 2)},
                    {"src_name": "c", "src_offsets": (1, 0), "dst_offsets": (2, 0), "sizes": (1, 2)},
                ),
            },
            {
                "name": "b",
                "shape": (3,),
                "dtype": "bfloat16",
                "pieces": ({"src_name": "b", "src_offsets": (0,), "dst_offsets": (0,), "sizes": (3,)},),
            },
        ],
    }
    assert DestLayout.from_json(dest.to_json()) == dest
    # A source layout written without its optional fields reads back with their defaults.
    bare = {"tensors": [{k: v for k, v in data["tensors"][0].items() if k != "contiguous"}]}
    assert SourceLayout.from_json(bare) == SourceLayout(tensors={"a": source.tensors["a"]})
    with pytest.raises(ValueError) as error:
        DestLayout.of([*dest.tensors.values(), dest.tensors["b"]])
    assert str(error.value) == "destination tensor 'b' appears twice"


def test_destination_builders():
    assert fused("gu", [("g", (4, 3)), ("u", (4, 3))], torch.float32) == DestTensor(
        name="gu",
        shape=(8, 3),
        dtype="float32",
        pieces=(
            Piece(src_name="g", src_offsets=(0, 0), dst_offsets=(0, 0), sizes=(4, 3)),
            Piece(src_name="u", src_offsets=(0, 0), dst_offsets=(4, 0), sizes=(4, 3)),
        ),
    )
    # Along dim 1, rank 1 of 2: each part's second half of columns, side by side.
    assert fused("kv", [("k", (2, 4)), ("v", (2, 6))], torch.float32, dim=1, tp_rank=1, tp_size=2).pieces == (
        Piece(src_name="k", src_offsets=(0, 2), dst_offsets=(0, 0), sizes=(2, 2)),
        Piece(src_name="v", src_offsets=(0, 3), dst_offsets=(0, 2), sizes=(2, 3)),
    )
    with pytest.raises(AssertionError, match=r"^fused\(\) needs at least one part$"):
        fused("none", [], torch.float32)
    with pytest.raises(ValueError) as error:
        fused("qk", [("q", (4, 3)), ("k", (4, 5))], torch.float32)
    assert str(error.value) == "qk: part k has shape (4, 5), incompatible with the others"
    with pytest.raises(ValueError) as error:
        tp_shard("o", (3, 4), torch.float32, dim=0, tp_rank=0, tp_size=2)
    assert str(error.value) == "o: size 3 is not divisible by tensor-parallel size 2"
    with pytest.raises(ValueError) as error:
        fused("qk", [("q", (4, 3)), ("k", (3, 3))], torch.float32, tp_size=2)
    assert str(error.value) == "qk/k: size 3 is not divisible by tensor-parallel size 2"
    assert tp_shard("e", (6, 2), torch.float32, dim=1, tp_rank=1, tp_size=2, src_name="emb") == DestTensor(
        name="e",
        shape=(6, 1),
        dtype="float32",
        pieces=(Piece(src_name="emb", src_offsets=(0, 1), dst_offsets=(0, 0), sizes=(6, 1)),),
    )
    assert replicated({"a": ((2, 3), torch.int64), "b": torch.zeros(4, dtype=torch.bfloat16)}).tensors == {
        "a": DestTensor(name="a", shape=(2, 3), dtype="int64", pieces=(
            Piece(src_name="a", src_offsets=(0, 0), dst_offsets=(0, 0), sizes=(2, 3)),)),
        "b": DestTensor(name="b", shape=(4,), dtype="bfloat16", pieces=(
            Piece(src_name="b", src_offsets=(0,), dst_offsets=(0,), sizes=(4,)),)),
    }  # fmt: skip


class _Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(5, 2)
        self.head = torch.nn.Linear(2, 5, bias=False)
        self.head.weight = self.embed.weight
        self.inner = torch.nn.Module()
        self.inner.register_buffer("cache", torch.ones(2), persistent=False)
        self.inner.register_buffer("steps", torch.zeros(3, dtype=torch.int64))
        self.register_buffer("nothing", None)
        self.register_buffer("scale", torch.ones(1))
        self.head.register_buffer("steps_again", self.inner.steps)  # one tensor, two names
        self.last = torch.nn.Module()
        self.last.register_buffer("rope", torch.ones(2), persistent=False)  # skipped, and then...
        self.last.register_buffer("count", torch.zeros(1))  # ...the next one is still read


def test_a_modules_tensors_are_its_parameters_once_and_its_persistent_buffers():
    model = _Tied()
    named = named_tensors_of(model)
    assert list(named) == ["embed.weight", "scale", "head.steps_again", "last.count"]
    assert named["embed.weight"] is model.embed.weight and named["head.steps_again"] is model.inner.steps
    given = {"x": torch.zeros(2)}
    assert named_tensors_of(given) == given and named_tensors_of(given) is not given


def test_a_source_layout_of_plain_tensors_holds_them_whole():
    base = torch.arange(12.0).reshape(3, 4)
    layout, local = source_layout(
        {"w": base, "t": base.t(), "i": torch.zeros(2, dtype=torch.int32)}, wire_dtype=torch.bfloat16
    )
    assert layout.wire_dtype == "bfloat16"
    assert layout.tensors == {
        "w": SourceTensor(name="w", full_shape=(3, 4), dtype="float32", offsets=(0, 0), sizes=(3, 4)),
        "t": SourceTensor(
            name="t", full_shape=(4, 3), dtype="float32", offsets=(0, 0), sizes=(4, 3), contiguous=False
        ),
        "i": SourceTensor(name="i", full_shape=(2,), dtype="int32", offsets=(0,), sizes=(2,)),
    }
    assert local["w"] is not base and torch.equal(local["w"], base) and not local["w"].requires_grad
    assert source_layout({"w": base})[0].wire_dtype is None
    assert math.prod(layout.tensors["t"].sizes) == 12
