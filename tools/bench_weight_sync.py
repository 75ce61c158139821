"""Benchmark llamarl-comm weight sync on gloo over loopback (prints figures; not a timed test).

Two benchmarks. The default one times full syncs of synthetic weights against the transport (below).
``--delta`` measures changed-only syncs on a real RL run's consecutive weights (see ``delta_main``):
SmolLM2-135M-Instruct trained a few policy-gradient steps per learning rate, then each step's weights
synced full and as a delta, side by side, for 1->1, FSDP2 2->TP 2 and two replicas, 50 syncs each
(the steps walked back and forth), ending with a bitwise comparison of the generators.

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
import contextlib
import math
import os
import platform
import tempfile
import time
import zlib
from pathlib import Path

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
from llamarl.comm.testing import free_port, run_distributed

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
            delta=False,  # the same weights every round: this one times full syncs (--delta: the other)
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
    parser.add_argument("--delta", action="store_true", help="changed-only syncs of a real RL run (below)")
    parser.add_argument("--lrs", default="1e-6,3e-6,1e-5", help="--delta: learning rates to train at")
    parser.add_argument("--steps", type=int, default=5, help="--delta: policy-gradient steps per rate")
    parser.add_argument(
        "--syncs", type=int, default=50, help="--delta: syncs per layout (steps walked back and forth)"
    )
    args = parser.parse_args()
    if args.delta:
        delta_main(args)
        return
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


# --------------------------------------------------------------------------------------------------
# --delta: changed-only syncs of a real RL run's consecutive weights


def cpu_name() -> str:
    """The CPU's model name, family and model (a hypervisor may hide the name: "AMD EPYC" family 25
    model 17 is a Zen 4 Genoa), whether it runs under a hypervisor, and how many CPUs this process sees."""
    info: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            info.setdefault(key.strip(), value.strip())
    name = info.get("model name") or platform.processor() or "unknown CPU"
    family = f" (family {info['cpu family']} model {info['model']})" if "cpu family" in info else ""
    virtual = ", under a hypervisor" if "hypervisor" in info.get("flags", "").split() else ""
    return f"{name}{family}{virtual}, {os.cpu_count()} logical CPUs"


def rollouts(model_dir: str, steps: int, seed: int = 0) -> list:
    """One batch per step: 4 GSM8K questions x 4 samples of 48 tokens from the model itself. Rewards are
    seeded coin flips: the step is a real policy gradient of a real size, whose direction does not
    matter for how many weights change."""
    from transformers import AutoTokenizer

    from llamarl.exec import HFGenerator, SamplingConfig
    from llamarl.exec.testing import read_jsonl, shared_data_dir

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows = read_jsonl(shared_data_dir(__file__) / "gsm8k" / "train.jsonl", 4 * steps)
    generator = HFGenerator(model_dir, SamplingConfig(temperature=1.0), seed=seed)
    generator.setup()
    batches = []
    for step in range(steps):
        chats = [[{"role": "user", "content": r["question"]}] for r in rows[4 * step : 4 * step + 4]]
        prompts = [
            tokenizer.apply_chat_template(c, add_generation_prompt=True, return_dict=False) for c in chats
        ]
        batch = generator.generate(prompts, samples_per_prompt=4, max_new_tokens=48)
        g = torch.Generator().manual_seed(seed + step)
        batch.rewards_B = torch.rand(batch.num_sequences, generator=g).round()
        batches.append(batch)
    generator.close()
    return batches


def train_snapshots(model_dir: str, lr: float, batches: list, out_dir: Path) -> list[Path]:
    """``PolicyTrainer`` steps at ``lr`` (AdamW, bf16 compute, float32 master weights, as the trainer
    runs), saving the masters' bf16 wire values before the first step and after each step (a bf16 wire
    value cast back to float32 and to bf16 again is itself: the sync bench's senders hold them so)."""
    from llamarl.exec.testing import build_trainer

    trainer = build_trainer(model_dir, lr=lr, compute_dtype="bfloat16", seed=0)
    trainer.setup()
    paths = []
    for step in range(len(batches) + 1):
        if step:
            trainer.train_step(batches[step - 1])
        path = out_dir / f"lr{lr:g}-step{step}.pt"
        torch.save({n: p.detach().to(DTYPE) for n, p in trainer.model.named_parameters()}, path)
        paths.append(path)
    trainer.close()
    return paths


def encodings(prev: dict[str, torch.Tensor], cur: dict[str, torch.Tensor]) -> dict[str, float]:
    """The changed share of bf16 values between two snapshots, and the bytes each encoding of the change
    would put on the wire, as a share of the full bf16 bytes: (int32 index, value) pairs; a bitmap of
    changed values plus the values; XOR with the previous bytes, zlib-compressed (level 1, with the
    seconds it took); llamarl.comm.delta's (16-bit positions of changed bytes in 64 KiB blocks, plus
    their values, per 64 MiB bucket)."""
    from llamarl.comm.delta import encode_delta

    a = torch.cat([t.reshape(-1) for t in prev.values()]).view(torch.int16)
    b = torch.cat([cur[n].reshape(-1) for n in prev]).view(torch.int16)
    n, changed = a.numel(), int((a != b).sum())
    full = 2 * n
    start = time.perf_counter()
    xor = zlib.compress((a ^ b).numpy().tobytes(), 1)
    zlib_s = time.perf_counter() - start
    ours, bucket = 0, (64 << 20) // 2
    for i in range(0, n, bucket):
        cur_u8, shadow = b[i : i + bucket].view(torch.uint8), a[i : i + bucket].view(torch.uint8).clone()
        ours += encode_delta(cur_u8, shadow, torch.empty_like(cur_u8)).nbytes
    return {
        "changed": changed / n,
        "index+value": 6 * changed / full,
        "bitmap+values": (n / 8 + 2 * changed) / full,
        "xor+zlib": len(xor) / full,
        "zlib_s": zlib_s,
        "ours": ours / full,
    }


def _delta_sender(
    rank: int, num_src: int, shapes: dict[str, tuple[int, ...]], rdv
) -> dict[str, torch.Tensor]:
    """A source's float32 tensors: whole (1 source), or FSDP2-style Shard(0) DTensors over 2 ranks."""
    if num_src == 1:
        return {n: torch.empty(s) for n, s in shapes.items()}
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    dist.init_process_group("gloo", init_method=f"file://{rdv.tmpdir}/fsdp", rank=rank, world_size=num_src)
    mesh = init_device_mesh("cpu", (num_src,))
    out = {}
    for name, shape in shapes.items():
        _, length = chunk_range(shape[0], num_src, rank)
        out[name] = DTensor.from_local(
            torch.empty(length, *shape[1:]), mesh, [Shard(0)], run_check=False,
            shape=torch.Size(shape), stride=torch.empty(shape, device="meta").stride(),
        )  # fmt: skip
    return out


def _load_step(tensors: dict[str, torch.Tensor], path: str, rank: int, num_src: int) -> None:
    """Puts a snapshot's values in the sender's tensors, in place (as an optimizer step does)."""
    snapshot = torch.load(path)
    for name, t in tensors.items():
        full = snapshot[name].float()
        if num_src == 1:
            t.copy_(full)
        else:
            start, length = chunk_range(full.shape[0], num_src, rank)
            t.to_local().copy_(full[start : start + length])


def _delta_worker(rank: int, world_size: int, rdv, layout_kind: str, paths: list[str]):
    """Two groups between the same processes: A sends every sync in full, B changed-only (after its
    first sync; default anchors). Each sync: the senders load the weights of ``paths``' next entry,
    then A syncs, then B. Returns each sync's seconds and stats on this rank, and (receivers) whether
    B's tensors equal A's bitwise at the end."""
    num_src = 2 if layout_kind == "2-2" else 1
    shapes = {n: tuple(t.shape) for n, t in torch.load(paths[0]).items()}
    groups = {
        kind: WeightSyncGroup(
            WeightSyncEndpoint(host=rdv.host, port=port, rank=rank, world_size=world_size, timeout_s=600)
        )
        for kind, port in (("full", rdv.port), ("delta", int(Path(rdv.tmpdir, "port").read_text())))
    }
    if rank < num_src:
        tensors = _delta_sender(rank, num_src, shapes, rdv)
        _load_step(tensors, paths[0], rank, num_src)
        ends = {k: WeightSender(g, tensors, wire_dtype=DTYPE, delta=k == "delta") for k, g in groups.items()}
    else:
        if num_src == 1:
            layout = replicated({n: (s, DTYPE) for n, s in shapes.items()})
        else:
            layout = tp_engine_layout(
                shapes, MODEL_CONFIGS["smollm2-135m"], rank - num_src, world_size - num_src
            )
        dsts = {k: carve({n: t.shape for n, t in layout.tensors.items()})[1] for k in groups}
        ends = {k: WeightReceiver(g, dsts[k], layout=layout) for k, g in groups.items()}
    rows = []
    for step, path in enumerate(paths):
        if rank < num_src and step and path != paths[step - 1]:
            _load_step(tensors, path, rank, num_src)
        row = {}
        for kind, end in ends.items():
            barrier(groups["full"], f"{kind}{step}")
            start = time.perf_counter()
            if rank < num_src:
                stats = end.send(step)
            else:
                end.receive(timeout_s=600)
                stats = end.last_stats
            row[kind] = {"seconds": time.perf_counter() - start, "bytes": stats.bytes, "delta": stats.delta}
        rows.append(row)
    out = {"rows": rows}
    if rank >= num_src:
        out["equal"] = all(torch.equal(dsts["full"][n], dsts["delta"][n]) for n in dsts["full"])
    barrier(groups["full"], "end")
    for g in reversed(list(groups.values())):
        g.close()
    return out


def delta_main(args: argparse.Namespace) -> None:
    """Train, snapshot, sync: prints densities, encodings and full vs delta syncs (see the module doc)."""
    from llamarl.exec import smollm2_path
    from llamarl.exec.config import TrainerConfig

    torch.set_num_threads(1)  # as every process of the sync bench (and the tests) runs: a shared machine
    print(f"CPU: {cpu_name()}; torch {torch.__version__}, one thread per process", flush=True)
    model_dir = str(smollm2_path())
    lrs = [float(x) for x in args.lrs.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        batches = rollouts(model_dir, args.steps)
        print(f"rollouts: {len(batches)} batches in {time.perf_counter() - start:.0f}s", flush=True)
        for lr in lrs:
            paths = train_snapshots(model_dir, lr, batches, Path(tmp))
            _print_encodings(lr, paths)
            for layout in args.layouts.split(","):
                _print_syncs(lr, layout, paths[1:], args.syncs)  # a run's first sync follows step 1
            for path in paths:
                path.unlink()
    print(
        "\nchanged: share of bf16 values whose bits changed in the step (step 1: AdamW's first step moves "
        "every weight by about lr); full / delta MB: bytes on the wire (summed over the senders); s: the "
        "sync's wall time (slowest rank), gloo over loopback; gen pause: the generator's pause per sync, "
        "measured by the engine adapters (not here). As in a run, the first sync follows step 1 (the "
        "generators start from the checkpoint) and is full in both groups; deltas start at step 2. After "
        "the last step the syncs walk the steps back and forth (each move one real step's change, done or "
        f"undone) to --syncs syncs. The trainer's default lr: {TrainerConfig().lr:g}."
    )


def _print_encodings(lr: float, paths: list[Path]) -> None:
    print(f"\nlr {lr:g}: changed values and encodings, % of a full bf16 sync", flush=True)
    print(
        f"{'step':>4} {'changed':>8} {'idx+val':>8} {'bitmap':>8} {'xor+zlib':>9} {'(zlib s)':>8} {'ours':>6}"
    )
    prev = torch.load(paths[0])
    for step, path in enumerate(paths[1:], 1):
        cur = torch.load(path)
        e = encodings(prev, cur)
        shares = " ".join(f"{100 * e[k]:7.2f}%" for k in ("changed", "index+value", "bitmap+values"))
        print(f"{step:>4} {shares} {100 * e['xor+zlib']:8.2f}% {e['zlib_s']:8.2f} {100 * e['ours']:5.2f}%")
        prev = cur


def zigzag(items: list, count: int) -> list:
    """``count`` items walking ``items`` forth and back (1 2 3 2 1 2 ...): every move between two
    neighbours is one real step's change, forward or undone."""
    if len(items) < 2:
        return items[:1] * count
    cycle = items + items[-2:0:-1]
    return [cycle[i % len(cycle)] for i in range(count)]


def _print_syncs(lr: float, layout: str, paths: list[Path], syncs: int) -> None:
    """Syncs the steps' weights (then walks them back and forth, to ``syncs`` syncs): a row per real
    step, a line for all of them, and whether the changed-only group's generators end bitwise equal."""
    num_src, num_dst = (int(x) for x in layout.split("-"))
    order = [str(p) for p in zigzag(paths, max(syncs, len(paths)))]
    res = run_distributed(_delta_worker_with_port, num_src + num_dst, layout, order, timeout_s=3000)
    name = {"1-1": "1->1", "2-2": "FSDP2 2->TP 2", "1-2": "1->2 replicas"}[layout]
    print(f"\nlr {lr:g}, {name}: full vs delta sync per step", flush=True)
    columns = ("full MB", 8), ("delta MB", 9), ("delta %", 8), ("full s", 7), ("delta s", 8), ("gen pause", 9)
    print(f"{'step':>4} " + " ".join(f"{c:>{w}}" for c, w in columns))
    figures = []
    for i in range(len(order)):
        rows = [r["rows"][i] for r in res]
        secs = {k: max(r[k]["seconds"] for r in rows) for k in ("full", "delta")}
        sent = {k: sum(r[k]["bytes"] for r in rows[:num_src]) for k in ("full", "delta")}
        share = 100 * sent["delta"] / sent["full"]
        if rows[0]["delta"]["delta"]:
            figures.append((share, secs["full"], secs["delta"]))
        if i < len(paths):
            kind = "delta" if rows[0]["delta"]["delta"] else "full"
            print(
                f"{i + 1:>4} {sent['full'] / 1e6:8.1f} {sent['delta'] / 1e6:9.2f} {share:7.2f}% "
                f"{secs['full']:7.3f} {secs['delta']:8.3f} {'-':>9}  ({kind})",
                flush=True,
            )
    equal = "bitwise equal" if all(r["equal"] for r in res[num_src:]) else "DIFFER"
    shares, fulls, deltas = (sorted(x) for x in zip(*figures, strict=True))
    print(
        f"{len(order)} syncs ({len(figures)} deltas, the steps walked back and forth): delta "
        f"{sum(shares) / len(shares):.2f}% of a full sync's bytes ({shares[0]:.2f}-{shares[-1]:.2f}%), "
        f"median {fulls[len(fulls) // 2]:.3f} s full, {deltas[len(deltas) // 2]:.3f} s delta; the "
        f"generators after {len(order)} syncs: {equal}"
    )


def _delta_worker_with_port(rank: int, world_size: int, rdv, layout_kind: str, paths: list[str]):
    """``_delta_worker`` with a second free port (for group B) agreed through the shared directory."""
    port_file = Path(rdv.tmpdir, "port")
    if rank == 0:
        tmp = Path(rdv.tmpdir, "port.tmp")
        tmp.write_text(str(free_port()))
        tmp.rename(port_file)
    else:
        deadline = time.monotonic() + 60
        while not port_file.exists():
            if time.monotonic() > deadline:
                raise TimeoutError("rank 0 never wrote the second group's port")
            time.sleep(0.05)
    return _delta_worker(rank, world_size, rdv, layout_kind, paths)


if __name__ == "__main__":
    main()
