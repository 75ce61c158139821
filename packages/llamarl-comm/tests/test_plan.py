"""Transfer plans without processes: coverage, no gathering, load spread, replica relays, buckets,
precision on the wire. ``_simulate`` runs a plan in one process by copying each bucket buffer."""

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
from llamarl.comm.buckets import TRAILER_BYTES, pack_bucket, read_trailer, unpack_bucket, write_trailer
from llamarl.comm.layouts import SourceTensor, chunk_range, dtype_to_str

pytestmark = pytest.mark.timeout(60)

H, D, HQ, HKV, INTER = 8, 2, 4, 2, 12  # hidden, head dim, query heads, kv heads, mlp width


def _weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = {
        "q.weight": (HQ * D, H),
        "k.weight": (HKV * D, H),
        "v.weight": (HKV * D, H),
        "gate.weight": (INTER, H),
        "up.weight": (INTER, H),
        "down.weight": (H, INTER),
        "norm.weight": (H,),
    }
    return {name: torch.randn(shape, generator=g) for name, shape in shapes.items()}


def _sharded_sources(full: dict[str, torch.Tensor], num_ranks: int, *, wire_dtype: str | None = None):
    """FSDP2-like: every parameter Shard(0) over ``num_ranks`` (torch.chunk sizes, last may be short)."""
    layouts, locals_ = {}, {}
    for rank in range(num_ranks):
        layout = SourceLayout(wire_dtype=wire_dtype)
        local = {}
        for name, t in full.items():
            start, length = chunk_range(t.shape[0], num_ranks, rank)
            offsets = (start,) + (0,) * (t.dim() - 1)
            sizes = (length, *t.shape[1:])
            layout.tensors[name] = SourceTensor(
                name=name,
                full_shape=tuple(t.shape),
                dtype=dtype_to_str(t.dtype),
                offsets=offsets,
                sizes=sizes,
            )
            local[name] = (t[start : start + length].clone(), offsets)
        layouts[rank] = layout
        locals_[rank] = local
    return layouts, locals_


def _tp_dest(tp_rank: int, tp_size: int, dtype=torch.float32) -> DestLayout:
    """vLLM-like Llama layer: fused qkv and gate_up (column parallel), row-parallel down, replicated norm."""
    return DestLayout.of(
        [
            fused(
                "qkv_proj.weight",
                [("q.weight", (HQ * D, H)), ("k.weight", (HKV * D, H)), ("v.weight", (HKV * D, H))],
                dtype,
                tp_rank=tp_rank,
                tp_size=tp_size,
            ),
            fused(
                "gate_up_proj.weight",
                [("gate.weight", (INTER, H)), ("up.weight", (INTER, H))],
                dtype,
                tp_rank=tp_rank,
                tp_size=tp_size,
            ),
            tp_shard(
                "down_proj.weight",
                (H, INTER),
                dtype,
                dim=1,
                tp_rank=tp_rank,
                tp_size=tp_size,
                src_name="down.weight",
            ),
            tp_shard("norm.weight", (H,), dtype, dim=0, tp_rank=0, tp_size=1),
        ]
    )


def _expected_tp(full: dict[str, torch.Tensor], tp_rank: int, tp_size: int) -> dict[str, torch.Tensor]:
    def rows(t: torch.Tensor) -> torch.Tensor:
        return t.chunk(tp_size, dim=0)[tp_rank]

    return {
        "qkv_proj.weight": torch.cat(
            [rows(full["q.weight"]), rows(full["k.weight"]), rows(full["v.weight"])]
        ),
        "gate_up_proj.weight": torch.cat([rows(full["gate.weight"]), rows(full["up.weight"])]),
        "down_proj.weight": full["down.weight"].chunk(tp_size, dim=1)[tp_rank],
        "norm.weight": full["norm.weight"],
    }


def _simulate(plan, src_locals, dst_layouts) -> dict[int, dict[str, torch.Tensor]]:
    """Run a plan in-process: pack each bucket at its source, then unpack it at every chain member."""
    out = {
        r: {
            n: torch.full(t.shape, float("nan"), dtype=getattr(torch, t.dtype))
            for n, t in lay.tensors.items()
        }
        for r, lay in dst_layouts.items()
    }
    for stream in plan.streams:
        for bucket in stream.buckets:
            buf = torch.empty(bucket.payload_bytes + TRAILER_BYTES, dtype=torch.uint8)
            pack_bucket(buf, bucket, src_locals[stream.src])
            n = bucket.payload_bytes
            stamp = {"stream_id": stream.stream_id, "bucket_index": bucket.index, "sync_index": 1}
            write_trailer(buf[n:], buf[:n], policy_version=5, checksum=1, **stamp)
            assert read_trailer(buf[n:])[1:] == (5, 1, stream.stream_id, bucket.index)
            for rank in stream.chain:
                unpack_bucket(buf, bucket, out[rank])
    return out


@pytest.mark.parametrize("num_src", [1, 2, 3])
@pytest.mark.parametrize("bucket_bytes", [64 << 20, 200])
@pytest.mark.parametrize("direct_min_bytes", [0, 1 << 30])
def test_fsdp_shards_to_tp_fused_bitwise(num_src: int, bucket_bytes: int, direct_min_bytes: int) -> None:
    full = _weights()
    sources, src_locals = _sharded_sources(full, num_src)
    tp_size = 2
    dests = {num_src + r: _tp_dest(r, tp_size) for r in range(tp_size)}
    plan = make_plan(sources, dests, bucket_bytes=bucket_bytes, direct_min_bytes=direct_min_bytes)
    num_direct = sum(b.direct for s in plan.streams for b in s.buckets)
    # When allowed, every slice lands in place (each is contiguous in the engine's tensor); row slices
    # (qkv, gate_up, norm) are also sent from the shard's memory, column slices (down) are packed first.
    assert (num_direct > 0) == (direct_min_bytes == 0)
    for b in (b for s in plan.streams for b in s.buckets if b.direct):
        assert b.src_copy == (b.entries[0].src_name == "down.weight"), b
    got = _simulate(plan, src_locals, dests)
    for r in range(tp_size):
        for name, want in _expected_tp(full, r, tp_size).items():
            assert torch.equal(got[num_src + r][name], want), (r, name)
    # No gather: each source sends only slices of its own shard; every bucket respects the size.
    for stream in plan.streams:
        for bucket in stream.buckets:
            assert bucket.payload_bytes <= bucket_bytes
            for e in bucket.entries:
                box = sources[stream.src].tensors[e.src_name]
                assert (
                    box.offsets[0] <= e.src_offsets[0]
                    and e.src_offsets[0] + e.sizes[0] <= box.offsets[0] + box.sizes[0]
                )
    # Load: bytes sent by each source within the largest shard's worth of imbalance.
    sent = plan.bytes_sent_by()
    total = sum(t.numel() * 4 for t in full.values())
    assert sum(sent.values()) >= total
    assert max(sent.values()) <= math.ceil(total / num_src) * 1.6 + 64 * len(plan.streams)


def test_replicated_sources_spread_load_and_replicas_relay() -> None:
    full = {f"layer{i}.weight": torch.randn(16, 8) for i in range(8)}
    sources = {}
    for rank in (0, 1):
        layout = SourceLayout()
        for name in full:
            layout.tensors[name] = SourceTensor(
                name=name, full_shape=(16, 8), dtype="float32", offsets=(0, 0), sizes=(16, 8)
            )
        sources[rank] = layout
    dests = {r: replicated(full) for r in (2, 3, 4)}  # three data-parallel replicas
    plan = make_plan(sources, dests, bucket_bytes=1024)
    sent = plan.bytes_sent_by()
    assert sent[0] == sent[1] == sum(t.numel() * 4 for t in full.values()) // 2  # load spread evenly
    # Replicas form one class: each source sends its half once, along a chain through all replicas.
    assert len(plan.streams) == 2
    assert all(sorted(s.chain) == [2, 3, 4] for s in plan.streams)
    assert plan.streams[0].chain[0] != plan.streams[1].chain[0]  # relay work rotates
    locals_ = {r: {n: (t, (0, 0)) for n, t in full.items()} for r in (0, 1)}
    got = _simulate(plan, locals_, dests)
    for r in (2, 3, 4):
        for name, t in full.items():
            assert torch.equal(got[r][name], t)


def test_big_tensor_is_split_across_buckets_even_within_a_row() -> None:
    full = {"w": torch.randn(3, 100), "tiny": torch.randn(1)}
    sources = {
        0: SourceLayout(
            tensors={
                "w": SourceTensor(
                    name="w", full_shape=(3, 100), dtype="float32", offsets=(0, 0), sizes=(3, 100)
                ),
                "tiny": SourceTensor(name="tiny", full_shape=(1,), dtype="float32", offsets=(0,), sizes=(1,)),
            }
        )
    }
    dests = {1: replicated(full)}
    plan = make_plan(sources, dests, bucket_bytes=96)  # a row (400 B) needs five buckets
    assert all(b.payload_bytes <= 96 for s in plan.streams for b in s.buckets)
    got = _simulate(plan, {0: {n: (t, (0,) * t.dim()) for n, t in full.items()}}, dests)
    assert torch.equal(got[1]["w"], full["w"]) and torch.equal(got[1]["tiny"], full["tiny"])


def test_mismatches_are_clear_errors() -> None:
    sources = {
        0: SourceLayout(
            tensors={
                "a": SourceTensor(name="a", full_shape=(4,), dtype="float32", offsets=(0,), sizes=(4,)),
            }
        )
    }
    with pytest.raises(PlanError, match="needs 'b'"):
        make_plan(sources, {1: replicated({"b": torch.zeros(4)})})
    with pytest.raises(PlanError, match="no destination wants"):
        make_plan(sources, {1: DestLayout()})
    with pytest.raises(PlanError, match="dtype mismatch"):
        make_plan(sources, {1: replicated({"a": torch.zeros(4, dtype=torch.float16)})})
    half = tp_shard("a", (4,), torch.float32, dim=0, tp_rank=0, tp_size=2)  # 2 elements...
    whole_but_half = DestTensor(name="a", shape=(4,), dtype="float32", pieces=half.pieces)  # ...of 4
    with pytest.raises(PlanError, match="cover 2 of 4"):
        make_plan(sources, {1: DestLayout.of([whole_but_half])})


@pytest.mark.parametrize("wire", ["bfloat16", "float8_e4m3fn"])
def test_precision_on_the_wire_error_is_bounded(wire: str) -> None:
    """bf16 and fp8 (e4m3, one scale per row) on the wire: the error this introduces, measured."""
    full = _weights(seed=3)
    sources, src_locals = _sharded_sources(full, 2, wire_dtype=wire)
    dests = {2 + r: _tp_dest(r, 2, dtype=torch.bfloat16) for r in range(2)}  # served in bf16
    plan = make_plan(sources, dests, bucket_bytes=512)
    fp32_bytes = sum(t.numel() * 4 for t in full.values())
    wire_bytes = sum(s.nbytes for s in plan.streams)
    got = _simulate(plan, src_locals, dests)
    worst = 0.0
    for r in range(2):
        for name, want in _expected_tp(full, r, 2).items():
            have = got[2 + r][name].float()
            rel = ((have - want).abs() / want.abs().amax(dim=-1, keepdim=True)).amax().item()
            worst = max(worst, rel)
    print(f"wire={wire}: {wire_bytes}/{fp32_bytes} bytes, worst error relative to the row max {worst:.4f}")
    if wire == "bfloat16":
        assert wire_bytes <= fp32_bytes // 2 + 64 * plan.num_buckets()
        assert worst <= 2**-8  # bf16 keeps 8 significant bits
    else:
        assert wire_bytes < fp32_bytes // 2  # 1 byte per weight + a float32 per row (1-d norms as bf16)
        assert worst <= 2**-4 + 2**-8  # e4m3: 3 mantissa bits, then the bf16 destination rounds


def test_checksum_catches_flipped_stale_and_shifted_bytes() -> None:
    from llamarl.comm.buckets import bucket_checksum

    payload = torch.randint(0, 256, (4096 + 5,), dtype=torch.uint8)
    full = bucket_checksum(payload)
    flipped = payload.clone()
    flipped[1234] ^= 1
    assert bucket_checksum(flipped) != full  # full: any single changed byte
    shifted = torch.cat([payload[8:], payload[:8]])
    assert bucket_checksum(shifted[:-5], 64) != bucket_checksum(payload[:-5], 64)  # spot check: shifted
    assert bucket_checksum(torch.zeros_like(payload), 64) != bucket_checksum(payload, 64)  # stale / zeroed
    assert bucket_checksum(payload[:4096], 64) != bucket_checksum(payload[:4088], 64)  # truncated
    # Sums wrap like int64 (they must fit the trailer's int64 word), in every mode.
    big = torch.tensor([2**62, 2**62, 2**62], dtype=torch.int64).view(torch.uint8)
    assert -(2**63) <= bucket_checksum(big, 2) < 2**63 and -(2**63) <= bucket_checksum(big) < 2**63


def test_spot_checksum_rotates_over_every_word_and_ignores_alignment() -> None:
    from llamarl.comm.buckets import bucket_checksum

    payload = torch.randint(0, 256, (8 * 64 + 3,), dtype=torch.uint8)
    flipped = payload.clone()
    flipped[8 * 37 + 2] ^= 4  # in word 37: missed by most phases of a stride-8 spot check
    caught = [bucket_checksum(flipped, 8, phase) != bucket_checksum(payload, 8, phase) for phase in range(8)]
    assert caught == [phase == 37 % 8 for phase in range(8)]  # so 8 syncs check every word once
    # A box received at an odd address (a slice of a tensor) sums like the same bytes sent aligned.
    carrier = torch.zeros(payload.numel() + 3, dtype=torch.uint8)
    carrier[3:] = payload
    for stride in (1, 8):
        assert bucket_checksum(carrier[3:], stride, 5) == bucket_checksum(payload, stride, 5)


def test_manifest_carries_each_buckets_ids_and_checksum() -> None:
    from llamarl.comm.buckets import bucket_checksum, checksum_tensor, read_trailers, trailers_bytes

    payloads = [torch.randint(0, 256, (n,), dtype=torch.uint8) for n in (64, 1000, 13)]
    sums = [checksum_tensor(p, 8, 3) for p in payloads]  # stay tensors: no host sync per bucket
    ids = [(2, i) for i in range(3)]
    manifest = trailers_bytes(sums, ids, policy_version=7, sync_index=3, device=torch.device("cpu"))
    assert manifest.dtype == torch.uint8 and manifest.numel() == 3 * TRAILER_BYTES
    assert read_trailers(manifest) == [(bucket_checksum(p, 8, 3), 7, 3, 2, i) for i, p in enumerate(payloads)]
    unchecked = trailers_bytes(None, ids, policy_version=7, sync_index=3, device=torch.device("cpu"))
    assert [t[0] for t in read_trailers(unchecked)] == [0, 0, 0]
