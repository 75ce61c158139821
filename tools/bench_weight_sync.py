"""Benchmark llamarl-comm weight sync on gloo over loopback (prints figures; not a timed test).

For each model (SmolLM2-135M shapes; a synthetic ~1.1B Llama-like set, TinyLlama shapes) and each
layout (1->1 and 1->2 replicated engines; 2->2: an FSDP2-sharded trainer (DTensor Shard(0)) to a
tensor-parallel engine with fused qkv / gate_up), all in bf16, it measures:

- sync: ``WeightSender.send`` / ``WeightReceiver.receive`` of the whole model, from a store barrier to
  the last rank done;
- (a) the transport's own limit: the same bytes per link as ONE large gloo send per (source,
  destination) link of the plan, between the same processes, all links at once (for replicas that is
  one send per replica: what the plan's relay chain avoids);
- (b) the naive way: one gloo broadcast per parameter, whole, from rank 0 to every other rank (an
  FSDP2 trainer first gathers each parameter with ``full_tensor()``; a TP engine keeps its slices).

After a warm-up, ``--repeats`` rounds each run sync, (a) and (b) once, so all three see the same
machine; each figure is the best round. GB/s is the model's size (bytes of every full parameter)
over the time. Usage:

    uv run --frozen python tools/bench_weight_sync.py [--models smollm2-135m,synthetic-1b]
        [--layouts 1-1,1-2,2-2] [--repeats 2] [--bucket-mb 64] [--no-checksum | --checksum-stride N]
        [--direct-min-mb 0.25]
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from llamarl.comm import (
    DestLayout,
    WeightReceiver,
    WeightSender,
    WeightSyncEndpoint,
    WeightSyncGroup,
    fused,
    replicated,
    tp_shard,
)
from llamarl.comm.layouts import chunk_range
from llamarl.comm.testing import run_distributed

DTYPE = torch.bfloat16


# Llama-like configs: SmolLM2-135M's, and TinyLlama's shapes (~1.1B parameters).
MODEL_CONFIGS = {
    "smollm2-135m": {
        "vocab": 49152,
        "hidden": 576,
        "inter": 1536,
        "layers": 30,
        "heads": 9,
        "kv_heads": 3,
        "tied": 1,
    },
    "synthetic-1b": {
        "vocab": 32000,
        "hidden": 2048,
        "inter": 5632,
        "layers": 22,
        "heads": 32,
        "kv_heads": 4,
        "tied": 0,
    },
}


def model_shapes(name: str) -> tuple[dict[str, tuple[int, ...]], dict[str, int]]:
    """Trainer (Hugging Face) parameter names and shapes of a Llama-like model, and its config."""
    if name not in MODEL_CONFIGS:
        raise ValueError(f"unknown model {name!r}; choose from {sorted(MODEL_CONFIGS)}")
    cfg = MODEL_CONFIGS[name]
    h, d = cfg["hidden"], cfg["hidden"] // cfg["heads"]
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg["vocab"], h)}
    for i in range(cfg["layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (cfg["heads"] * d, h),
            p + "self_attn.k_proj.weight": (cfg["kv_heads"] * d, h),
            p + "self_attn.v_proj.weight": (cfg["kv_heads"] * d, h),
            p + "self_attn.o_proj.weight": (h, cfg["heads"] * d),
            p + "mlp.gate_proj.weight": (cfg["inter"], h),
            p + "mlp.up_proj.weight": (cfg["inter"], h),
            p + "mlp.down_proj.weight": (h, cfg["inter"]),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        }
    shapes["model.norm.weight"] = (h,)
    if not cfg["tied"]:
        shapes["lm_head.weight"] = (cfg["vocab"], h)
    return shapes, cfg


def tp_engine_layout(
    shapes: dict[str, tuple[int, ...]], cfg: dict[str, int], tp_rank: int, tp_size: int
) -> DestLayout:
    """A vLLM-like tensor-parallel engine: fused qkv and gate_up, row-parallel o/down, vocab-parallel
    embedding and head, replicated norms."""
    tensors = []
    for i in range(cfg["layers"]):
        p = f"model.layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        qkv = [(a + f"{x}_proj.weight", shapes[a + f"{x}_proj.weight"]) for x in "qkv"]
        tensors.append(fused(a + "qkv_proj.weight", qkv, DTYPE, tp_rank=tp_rank, tp_size=tp_size))
        gu = [(m + f"{x}_proj.weight", shapes[m + f"{x}_proj.weight"]) for x in ("gate", "up")]
        tensors.append(fused(m + "gate_up_proj.weight", gu, DTYPE, tp_rank=tp_rank, tp_size=tp_size))
        for row_parallel in (a + "o_proj.weight", m + "down_proj.weight"):
            tensors.append(
                tp_shard(row_parallel, shapes[row_parallel], DTYPE, dim=1, tp_rank=tp_rank, tp_size=tp_size)
            )
        for norm in (p + "input_layernorm.weight", p + "post_attention_layernorm.weight"):
            tensors.append(tp_shard(norm, shapes[norm], DTYPE, dim=0, tp_rank=0, tp_size=1))
    tensors.append(
        tp_shard("model.norm.weight", shapes["model.norm.weight"], DTYPE, dim=0, tp_rank=0, tp_size=1)
    )
    for vocab in ("model.embed_tokens.weight", "lm_head.weight"):
        if vocab in shapes:
            tensors.append(tp_shard(vocab, shapes[vocab], DTYPE, dim=0, tp_rank=tp_rank, tp_size=tp_size))
    return DestLayout.of(tensors)


def carve(shapes: dict[str, tuple[int, ...]]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One flat buffer per rank, parameters as views into it (so (a) can send the same memory)."""
    flat = torch.empty(sum(math.prod(s) for s in shapes.values()), dtype=DTYPE)
    out, at = {}, 0
    for name, shape in shapes.items():
        n = math.prod(shape)
        out[name] = flat[at : at + n].view(shape)
        at += n
    return flat, out


def barrier(group: WeightSyncGroup, key: str) -> None:
    """A store barrier: the last rank to arrive releases everyone."""
    if group.add(f"bench/{key}/arrived", 1) == group.world_size:
        group.put(f"bench/{key}/go", True)
    group.get(f"bench/{key}/go", timeout_s=600)


def _worker(
    rank: int,
    world_size: int,
    rdv,
    model: str,
    layout_kind: str,
    repeats: int,
    bucket_bytes: int,
    checksum: int,
    direct_min_bytes: int,
):
    torch.manual_seed(rank)
    shapes, cfg = model_shapes(model)
    num_src = 2 if layout_kind == "2-2" else 1
    group = WeightSyncGroup(
        WeightSyncEndpoint(host=rdv.host, port=rdv.port, rank=rank, world_size=world_size, timeout_s=300)
    )
    is_src = rank < num_src
    if is_src:
        if num_src == 1:
            flat, named = carve(shapes)
            flat.normal_()
            tensors = named
        else:  # FSDP2-style: Shard(0) DTensors over the trainer ranks' own default group
            import torch.distributed as dist
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.tensor import DTensor, Shard

            dist.init_process_group(
                "gloo", init_method=f"file://{rdv.tmpdir}/fsdp", rank=rank, world_size=num_src
            )
            mesh = init_device_mesh("cpu", (num_src,))
            local_shapes = {}
            for name, shape in shapes.items():
                _, length = chunk_range(shape[0], num_src, rank)
                local_shapes[name] = (length, *shape[1:])
            flat, local = carve(local_shapes)
            flat.normal_()
            tensors = {
                name: DTensor.from_local(
                    local[name],
                    mesh,
                    [Shard(0)],
                    run_check=False,
                    shape=torch.Size(shape),
                    stride=torch.empty(shape, device="meta").stride(),
                )
                for name, shape in shapes.items()
            }
        endpoint = WeightSender(
            group,
            tensors,
            bucket_bytes=bucket_bytes,
            checksum=checksum > 0,
            checksum_stride=checksum,
            direct_min_bytes=direct_min_bytes,
        )
    else:
        if num_src == 1:
            dest_layout = replicated({n: (s, DTYPE) for n, s in shapes.items()})
        else:
            dest_layout = tp_engine_layout(shapes, cfg, rank - num_src, world_size - num_src)
        flat, tensors = carve({n: t.shape for n, t in dest_layout.tensors.items()})
        endpoint = WeightReceiver(group, tensors, layout=dest_layout)
    plan = endpoint.plan
    times: dict[str, list[float]] = {"sync": [], "limit": [], "naive": []}

    def timed(kind: str, fn) -> None:
        barrier(group, f"{kind}{len(times[kind])}")
        start = time.perf_counter()
        fn()
        times[kind].append(time.perf_counter() - start)

    # Sync (the first one, untimed, allocates buffers).
    version = 0

    def sync() -> None:
        nonlocal version
        version += 1
        if is_src:
            endpoint.send(version)
        else:
            assert endpoint.receive(timeout_s=600) == version

    # (a) One large send per link, the same bytes per link as the plan, all links at once.
    flat_u8 = flat.view(torch.uint8)

    def limit() -> None:
        works, send_at, recv_at = [], 0, 0
        for s in plan.streams:
            if rank == s.src:
                send_at = 0 if send_at + s.nbytes > flat_u8.numel() else send_at
                for dst in s.chain:
                    works.append(
                        group.send(flat_u8[send_at : send_at + s.nbytes], dst, 1 << 20 | s.stream_id)
                    )
                send_at += s.nbytes
            elif rank in s.chain:
                recv_at = 0 if recv_at + s.nbytes > flat_u8.numel() else recv_at
                works.append(group.recv(flat_u8[recv_at : recv_at + s.nbytes], s.src, 1 << 20 | s.stream_id))
                recv_at += s.nbytes
        for w in works:
            w.wait()

    # (b) Naive: one broadcast per parameter, whole, from rank 0 to every other rank. A sharded trainer
    # first gathers each parameter (DTensor.full_tensor, over its own group); a sharded engine receives
    # the whole parameter and keeps its slice (what an engine's weight loader does).
    # Sharded sides receive each whole parameter into a staging tensor first.
    scratch = torch.empty(max(math.prod(s) for s in shapes.values()) if num_src > 1 else 0, dtype=DTYPE)

    def naive() -> None:
        for name, shape in shapes.items():
            if num_src == 1:
                group.broadcast(tensors[name], 0).wait()  # whole on every rank: lands in place
                continue
            if is_src:
                full = tensors[name].full_tensor()
                group.broadcast(full, 0).wait()
            else:
                full = scratch[: math.prod(shape)].view(shape)
                group.broadcast(full, 0).wait()
                for src_box, target in dest_slices.get(name, []):
                    target.copy_(full[src_box])

    dest_slices: dict[str, list[tuple[tuple[slice, ...], torch.Tensor]]] = {}
    if num_src > 1 and not is_src:
        # The naive engine's slices of each full parameter: its rows (or columns) of the TP shard.
        for t in dest_layout.tensors.values():
            for p in t.pieces:
                src_box = tuple(slice(o, o + n) for o, n in zip(p.src_offsets, p.sizes, strict=True))
                dst_box = tuple(slice(o, o + n) for o, n in zip(p.dst_offsets, p.sizes, strict=True))
                dest_slices.setdefault(p.src_name, []).append((src_box, tensors[t.name][dst_box]))

    barrier(group, "warmup")
    sync()
    limit()
    # Rounds interleave the three so that they see the same machine (a shared machine drifts).
    for _ in range(repeats):
        for kind, fn in (("sync", sync), ("limit", limit), ("naive", naive)):
            timed(kind, fn)
    barrier(group, "end")
    group.close()  # (rank 0's store goes last: no heartbeat meets it closed)
    full_bytes = sum(math.prod(s) for s in shapes.values()) * DTYPE.itemsize
    return {
        "times": times,
        "full_bytes": full_bytes,
        "num_params": len(shapes),
        "streams": len(plan.streams),
        "buckets": plan.num_buckets(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", default="smollm2-135m,synthetic-1b")
    parser.add_argument("--layouts", default="1-1,1-2,2-2")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--bucket-mb", type=float, default=64)
    parser.add_argument("--no-checksum", action="store_true")
    parser.add_argument(
        "--checksum-stride", type=int, default=64, help="checksum every n-th int64 word (the default)"
    )
    parser.add_argument("--direct-min-mb", type=float, default=0.25, help="zero-copy slices from this size")
    args = parser.parse_args()
    rows = []
    header = (
        f"{'model':<14} {'layout':<6} {'GB':>5} {'sync s':>7} {'GB/s':>6} {'(a) s':>7} {'GB/s':>6} "
        f"{'% of (a)':>8} {'(b) s':>7} {'GB/s':>6} {'x (b)':>6}"
    )
    print(header, flush=True)
    for model in args.models.split(","):
        for layout in args.layouts.split(","):
            num_src, num_dst = (int(x) for x in layout.split("-"))
            res = run_distributed(
                _worker,
                num_src + num_dst,
                model,
                layout,
                args.repeats,
                int(args.bucket_mb * (1 << 20)),
                0 if args.no_checksum else args.checksum_stride,
                int(args.direct_min_mb * (1 << 20)),
                timeout_s=1800,
            )
            # A phase lasts until its slowest rank is done: max over ranks, best over repeats.
            best = {
                k: min(max(r["times"][k][i] for r in res) for i in range(len(res[0]["times"][k])))
                for k in ("sync", "limit", "naive")
            }
            gb = res[0]["full_bytes"] / 1e9
            row = (
                f"{model:<14} {layout:<6} {gb:5.2f} {best['sync']:7.3f} {gb / best['sync']:6.2f} "
                f"{best['limit']:7.3f} {gb / best['limit']:6.2f} {100 * best['limit'] / best['sync']:7.0f}% "
                f"{best['naive']:7.3f} {gb / best['naive']:6.2f} {best['naive'] / best['sync']:6.1f}"
            )
            rows.append(row)
            print(row, flush=True)
    checksums = "off" if args.no_checksum else f"on (every {args.checksum_stride}. int64 word)"
    print(f"\nbucket {args.bucket_mb} MB, checksums {checksums}, bf16, gloo over loopback")


if __name__ == "__main__":
    main()
