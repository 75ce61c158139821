"""One GPU, a few minutes: does llamarl's GPU path work, and how fast? Prints one table.

Run through `tools/gpu_check.sh` (it sets the import path, brings missing packages from carried wheels
and bounds the whole run). Checks, each on a model built from a config with random weights (no
download):

    fsdp     one FSDP2 bf16 training step (fp32 master weights, AdamW) on the GPU, the trainer group
             over NCCL (cpu:gloo,cuda:nccl, what the app uses on CUDA) against plain gloo
    sync     a weight sync trainer (FSDP2 on the GPU) -> HF generator (on the GPU, another process)
             through the app's weight channel (llamarl.comm); every tensor compared bitwise; GB/s
             against a device-to-device copy of the same bytes
    dcp      a checkpoint round trip of the trainer through DCP (llamarl.control.run.checkpoint): save,
             train on, load, compare model and optimizer bitwise
    app      the arith app, trainer and generator sharing the GPU (ranks.colocate), in async and in
             stream mode for a few steps
    moe      routing replay on a mixture of experts (Qwen3-MoE from a config): the HF generator samples
             in bf16 on the GPU and records each token's experts; the trainer's log-probs of those
             tokens with its own routing (off) and with the generator's replayed (r3): the share of
             sampled tokens routed differently in some layer and |log pi - log mu| of each
    trace    timings for the simulator's GPU calibration, written to OUT/gpu_trace.json: decoding steps
             of the model at a few batch sizes (eager, and with a CUDA graph where one can be captured)
             and timed training steps of the app's trainer; `tools/simulate.py from-run OUT` fits the
             decode bandwidth, eager launch cost and trainer MFU from it (llamarl.sim.gpu_calibration)

`--cpu` runs the same checks on the CPU (gloo only, smaller models): a dry run of the script's logic
for a machine without a GPU. Usage:

    tools/gpu_check.sh [--cpu] [--checks fsdp,sync,dcp,app,moe,trace] [--out DIR]
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
CHECKS = ("fsdp", "sync", "dcp", "app", "moe", "trace")

# Model sizes (Llama from a config): on the GPU big enough for bandwidth and step times to mean
# something (~200M parameters), on the CPU small enough for a dry run.
GPU_MODEL = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=12, num_attention_heads=16,
                 num_key_value_heads=8, vocab_size=32000)  # fmt: skip
CPU_MODEL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512)  # fmt: skip
APP_MODEL = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512)  # fmt: skip
# The MoE of the `moe` check (Qwen3-MoE): 16 experts, 4 per token on the GPU; 4 and 2 on the CPU.
GPU_MOE = dict(hidden_size=512, moe_intermediate_size=256, num_hidden_layers=8, num_attention_heads=8,
               num_key_value_heads=4, vocab_size=32000, num_experts=16, num_experts_per_tok=4)  # fmt: skip
CPU_MOE = dict(hidden_size=64, moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=512, num_experts=4, num_experts_per_tok=2)  # fmt: skip


# ------------------------------------------------------------------------------------------------
# a model and a tokenizer built in code


def build_tokenizer():
    """A byte-level BPE tokenizer trained here on digits and a few words, with a chat template (what the
    apps apply to every prompt): no download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    corpus = [f"What is {a} + {b}? The answer is {a + b}. #### {a + b}" for a in range(10) for b in range(10)]
    corpus += ["system user assistant Solve the problem and give the final answer as a number."]
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None
    )
    fast.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    return fast


def save_model(folder: Path, sizes: dict[str, int]) -> Path:
    """A random Llama of `sizes` (seed 0) with the tokenizer above, saved as a transformers folder."""
    from llamarl.exec.models import tiny_model

    tokenizer = build_tokenizer()
    model = tiny_model(
        max_position_embeddings=1024,
        bos_token_id=tokenizer.convert_tokens_to_ids("<|im_start|>"),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        seed=0,
        **sizes,
    )
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def random_batch(vocab: int, *, sequences: int, prompt_len: int, completion_len: int):
    """A RolloutBatch of random tokens (groups of 4, varied rewards, every token sampled by version 0)."""
    from llamarl.exec.types import RolloutBatch

    g = torch.Generator().manual_seed(0)
    B, P, C = sequences, prompt_len, completion_len
    return RolloutBatch(
        prompt_ids_BP=torch.randint(3, vocab, (B, P), generator=g),
        prompt_mask_BP=torch.ones(B, P, dtype=torch.int64),
        completion_ids_BC=torch.randint(3, vocab, (B, C), generator=g),
        completion_mask_BC=torch.ones(B, C, dtype=torch.int64),
        behavior_logprobs_BC=torch.full((B, C), -5.0),
        rewards_B=torch.rand(B, generator=g),
        policy_version_B=torch.zeros(B, dtype=torch.int64),
        group_size=4,
    )


# ------------------------------------------------------------------------------------------------
# the checks (each returns rows: check, result, figure, note)


def _device(cpu: bool) -> torch.device:
    return torch.device("cpu") if cpu else torch.device("cuda", 0)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _trainer(model_dir: Path, device: torch.device, group, *, steps: int = 4):
    from llamarl.control.launch.devices import trainer_compute_dtype
    from llamarl.exec.config import AlgorithmConfig, TrainerConfig
    from llamarl.exec.train.trainer import PolicyTrainer

    trainer = PolicyTrainer(
        str(model_dir),
        TrainerConfig(lr=1e-5),
        AlgorithmConfig(),
        temperature=1.0,
        total_steps=steps,
        device=str(device),
        compute_dtype=trainer_compute_dtype("auto", device),
        seed=0,
        group=group,
    )
    trainer.setup()
    return trainer


def _fsdp_rank(rank: int, world_size: int, rendezvous, model_dir: str, cpu: bool) -> list[dict]:
    import torch.distributed as dist

    from llamarl.control.launch.devices import group_backend

    device = _device(cpu)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("gloo", init_method=rendezvous.init_method, rank=rank, world_size=world_size)
    sizes = CPU_MODEL if cpu else GPU_MODEL
    batch = random_batch(sizes["vocab_size"], sequences=16, prompt_len=64, completion_len=192)
    backends = [group_backend(device)] + (["gloo"] if device.type == "cuda" else [])
    rows = []
    for backend in backends:
        try:
            group = dist.new_group([0], backend=backend)
            trainer = _trainer(Path(model_dir), device, group)
            trainer.train_step(batch)  # warm-up: allocations, kernels, communicators
            _sync(device)
            times = []
            for _ in range(3):
                start = time.perf_counter()
                trainer.train_step(batch)
                _sync(device)
                times.append(time.perf_counter() - start)
            peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
            tokens = batch.num_sequences * (64 + 192)
            note = f"{tokens / min(times):,.0f} tok/s, peak {peak:.1f} GiB"
            rows.append(row(f"fsdp step [{backend}]", True, f"{min(times) * 1e3:.0f} ms", note))
            trainer.close()
            del trainer
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
        except Exception as e:
            rows.append(row(f"fsdp step [{backend}]", False, "", _one_line(e)))
    dist.destroy_process_group()
    return rows


def check_fsdp(model_dir: Path, cpu: bool) -> list[dict]:
    from llamarl.comm.testing import run_distributed

    return run_distributed(_fsdp_rank, 1, str(model_dir), cpu, timeout_s=240, fresh=True)[0]


def _digest(state: dict[str, torch.Tensor]) -> dict[str, str]:
    """sha256 of each tensor's bytes (bf16), by name."""
    out = {}
    for name, t in state.items():
        raw = t.detach().to(torch.bfloat16).contiguous().cpu().view(torch.uint8).numpy().tobytes()
        out[name] = hashlib.sha256(raw).hexdigest()
    return out


def _sync_rank(rank: int, world_size: int, rendezvous, model_dir: str, cpu: bool) -> dict:
    import torch.distributed as dist

    from llamarl.control.config import WeightSyncConfig
    from llamarl.control.launch.devices import generation_dtype, group_backend, weight_wire_dtype
    from llamarl.control.run.channels.weights import open_sender, weight_sync_endpoint
    from llamarl.exec.config import SamplingConfig
    from llamarl.exec.generate.hf import HFGenerator

    device = _device(cpu)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # both processes on the one GPU
    dist.init_process_group("gloo", init_method=rendezvous.init_method, rank=rank, world_size=world_size)
    group = dist.new_group([0], backend=group_backend(device))  # every rank takes part
    endpoint = weight_sync_endpoint(
        rank, world_size, backend="gloo", timeout_s=120, dead_after_s=WeightSyncConfig().dead_after_s
    )
    assert endpoint is not None  # both ranks are members
    out: dict[str, Any] = {}
    if rank == 0:
        trainer = _trainer(Path(model_dir), device, group)
        # One step first: the weights sent then differ from the file the generator loaded.
        vocab = trainer.model.config.vocab_size
        trainer.train_step(random_batch(vocab, sequences=8, prompt_len=16, completion_len=16))
        weight_group, sender = open_sender(
            trainer.model,
            endpoint,
            bucket_mb=256,
            wire_dtype=weight_wire_dtype(generation_dtype("auto", device)),
            delta=False,  # full syncs: the row is the transfer's bandwidth (the same weights go 3 times)
        )
        times = []
        for version in range(1, 4):
            dist.barrier()
            start = time.perf_counter()
            sender.send(version)
            _sync(device)
            times.append(time.perf_counter() - start)
            dist.barrier()
        full = trainer.full_state_dict()
        out = {"times": times, "digest": _digest(full), "bytes": sum(t.numel() * 2 for t in full.values())}
        weight_group.close()
        trainer.close()
    else:
        generator = HFGenerator(
            model_dir, SamplingConfig(), device=str(device), dtype=generation_dtype("auto", device)
        )
        generator.setup()
        generator.connect_weight_sync(endpoint)
        for _ in range(3):
            dist.barrier()
            generator.receive_weights(timeout_s=120)
            dist.barrier()
        out = {"digest": _digest(generator.model.state_dict()), "version": generator.policy_version}
        # The baseline: the same bytes copied once on the device.
        n = sum(p.numel() for p in generator.model.parameters()) * 2
        src, dst = (
            torch.empty(n, dtype=torch.uint8, device=device),
            torch.empty(n, dtype=torch.uint8, device=device),
        )
        dst.copy_(src)
        _sync(device)
        start = time.perf_counter()
        for _ in range(5):
            dst.copy_(src)
        _sync(device)
        out["copy_s"] = (time.perf_counter() - start) / 5
        generator.close()
    dist.destroy_process_group()
    return out


def check_sync(model_dir: Path, cpu: bool) -> list[dict]:
    from llamarl.comm.testing import run_distributed

    trainer, generator = run_distributed(_sync_rank, 2, str(model_dir), cpu, timeout_s=300, fresh=True)
    sent, got = trainer["digest"], generator["digest"]
    # A tied lm_head shares the embedding's storage; every tensor the trainer holds must have arrived.
    differing = sorted(name for name in sent if got.get(name) != sent[name])
    gbs = trainer["bytes"] / min(trainer["times"]) / 1e9
    copy_gbs = trainer["bytes"] / generator["copy_s"] / 1e9
    ok = not differing and generator["version"] == 3
    bitwise = "equal" if not differing else f"DIFFERS in {len(differing)}: {differing[:3]}"
    note = (
        f"{trainer['bytes'] / 2**20:.0f} MiB bf16 in {min(trainer['times']) * 1e3:.0f} ms; "
        f"device copy {copy_gbs:.0f} GB/s ({gbs / copy_gbs:.1%}); bitwise {bitwise}"
    )
    return [row("weight sync -> hf", ok, f"{gbs:.2f} GB/s", note)]


def _dcp_rank(rank: int, world_size: int, rendezvous, model_dir: str, folder: str, cpu: bool) -> dict:
    import torch.distributed as dist

    from llamarl.control.launch.devices import group_backend
    from llamarl.control.run import checkpoint as ckpt

    device = _device(cpu)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("gloo", init_method=rendezvous.init_method, rank=rank, world_size=world_size)
    group = dist.new_group([0], backend=group_backend(device))
    trainer = _trainer(Path(model_dir), device, group)
    batch = random_batch(trainer.model.config.vocab_size, sequences=8, prompt_len=16, completion_len=16)
    trainer.train_step(batch)
    saved_model = _digest(trainer.full_state_dict())
    saved_moments = _moments(trainer.optimizer)
    writer = ckpt.CheckpointWriter(Path(folder), rank=0, world_size=1, keep=1)
    start = time.perf_counter()
    parts = (trainer.model, trainer.optimizer)
    writer.save(1, rank_state={}, trainer=parts, trainer_group=group, controller_state={})
    save_s = time.perf_counter() - start
    trainer.train_step(batch)  # moves on: the load must bring the saved state back
    moved = _digest(trainer.full_state_dict()) != saved_model
    found = ckpt.find_latest(Path(folder))
    assert found is not None, "no complete checkpoint found"
    start = time.perf_counter()
    ckpt.load_trainer(found, trainer.model, trainer.optimizer, group)
    _sync(device)
    load_s = time.perf_counter() - start
    out = {
        "model_equal": _digest(trainer.full_state_dict()) == saved_model,
        "optimizer_equal": _moments(trainer.optimizer) == saved_moments,
        "moved": moved,
        "save_s": save_s,
        "load_s": load_s,
        "bytes": sum(p.stat().st_size for p in Path(found.path).rglob("*") if p.is_file()),
    }
    trainer.close()
    dist.destroy_process_group()
    return out


def _moments(optimizer: torch.optim.Optimizer) -> str:
    """One digest of every AdamW moment (this rank's shards)."""
    h = hashlib.sha256()
    for state in optimizer.state.values():
        for key in ("exp_avg", "exp_avg_sq"):
            t = state[key]
            t = t.to_local() if hasattr(t, "to_local") else t
            h.update(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def check_dcp(model_dir: Path, cpu: bool, scratch: Path) -> list[dict]:
    from llamarl.comm.testing import run_distributed

    r = run_distributed(
        _dcp_rank, 1, str(model_dir), str(scratch / "checkpoints"), cpu, timeout_s=240, fresh=True
    )[0]
    ok = r["model_equal"] and r["optimizer_equal"] and r["moved"]
    model = "equal" if r["model_equal"] else "DIFFERS"
    moments = "equal" if r["optimizer_equal"] else "DIFFER"
    note = f"{r['bytes'] / 2**20:.0f} MiB; model bitwise {model}, AdamW moments {moments}"
    return [row("dcp round trip", ok, f"save {r['save_s']:.1f} s, load {r['load_s']:.1f} s", note)]


def check_app(model_dir: Path, cpu: bool, scratch: Path, modes: list[str]) -> list[dict]:
    rows = []
    for mode in modes:
        out = scratch / f"app_{mode}"
        args = [
            sys.executable, str(REPO / "apps" / "arith_rl"), "--model", str(model_dir), "--mode", mode,
            "--steps", "4", "--prompts-per-step", "4", "--samples-per-prompt", "4", "--max-new-tokens", "16",
            "--eval-size", "8", "--no-wandb", "--no-save-model", "--output-dir", str(out), "--timeout", "240",
        ]  # fmt: skip
        if cpu:
            args += ["--device", "cpu"]
        else:  # one GPU: the trainer rank and the generator rank share it, with explicit shares
            args += ["--device", "cuda", "--ranks.colocate", "--ranks.trainer-memory-fraction", "0.45"]
            args += ["--generator.gpu-memory-utilization", "0.45"]
        start = time.perf_counter()
        result = subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=REPO)
        wall = time.perf_counter() - start
        if result.returncode != 0:
            (scratch / f"app_{mode}.stderr").write_text(result.stderr)
            last = result.stderr.strip().splitlines()[-1:] or ["no output"]
            rows.append(row(f"app [{mode}]", False, f"{wall:.0f} s", _one_line(last[0])))
            continue
        s = json.loads((out / "summary.json").read_text())
        ok = s["steps"] == 4 and s["final_policy_version"] == 4
        note = (
            f"{s['gen_tokens_per_s']:.0f} gen tok/s, sync {s['weight_sync_s'] * 1e3:.0f} ms, "
            f"policy_version {s['final_policy_version']}, wall {wall:.0f} s"
        )
        rows.append(row(f"app [{mode}]", ok, f"{s['step_time_s']:.2f} s/step", note))
    return rows


# ------------------------------------------------------------------------------------------------
# the trace for the simulator's GPU calibration

# What llamarl.sim.gpu_calibration reads (this script runs without llamarl-sim on its path, so the
# format is spelled out here; tests/test_gpu_check.py reads the file with the simulator's reader).
TRACE_FORMAT = "llamarl-gpu-trace/1"
TRACE_BATCHES_GPU, TRACE_BATCHES_CPU = (1, 8, 32, 64), (1, 4)


def check_moe(scratch: Path, cpu: bool) -> list[dict]:
    """Routing replay: the generator's bf16 routes against the trainer's own, and replayed."""
    from llamarl.exec import HFGenerator, SamplingConfig
    from llamarl.exec.models import tiny_moe_model
    from llamarl.exec.testing import build_trainer

    device = _device(cpu)
    sizes = CPU_MOE if cpu else GPU_MOE
    folder = scratch / "moe_model"
    tiny_moe_model(
        "qwen3_moe",
        sizes["vocab_size"],
        seed=0,
        eos_token_id=2,
        pad_token_id=0,
        **{k: v for k, v in sizes.items() if k != "vocab_size"},
    ).save_pretrained(folder)
    dtype = "float32" if cpu else "bfloat16"
    generator = HFGenerator(str(folder), SamplingConfig(), device=str(device), dtype=dtype, seed=0)
    generator.setup()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, sizes["vocab_size"], (32,), generator=g).tolist() for _ in range(8)]
    batch = generator.generate(prompts, samples_per_prompt=4, max_new_tokens=64 if not cpu else 16)
    generator.close()
    batch.rewards_B = torch.rand(batch.num_sequences, generator=g)
    rows, gaps = [], {}
    for replay in ("off", "r3"):
        trainer = build_trainer(
            str(folder), device=str(device), compute_dtype=dtype, routing_replay=replay, lr=0.0, seed=0
        )
        trainer.setup()
        metrics = trainer.train_step(batch)
        gaps[replay] = metrics["logprob_gap_abs_mean"]
        figure = f"{metrics['routing_mismatch']:.1%} routed apart"
        note = f"log-prob gap {gaps[replay]:.4f} (mean abs), ratio max {metrics['ratio_max']:.3f}"
        rows.append(row(f"moe routing replay [{replay}]", True, figure, note))
        trainer.close()
    if gaps["r3"] > gaps["off"]:
        rows[-1] = row(
            "moe routing replay [r3]", False, rows[-1]["figure"], "replay widened the log-prob gap"
        )
    return rows


def _shape(config) -> dict:
    """The transformers config's numbers the simulator prices a model with."""
    heads = config.num_attention_heads
    return {
        "name": "gpu_check model",
        "layers": config.num_hidden_layers,
        "hidden": config.hidden_size,
        "heads": heads,
        "kv_heads": getattr(config, "num_key_value_heads", None) or heads,
        "head_dim": getattr(config, "head_dim", None) or config.hidden_size // heads,
        "ffn": config.intermediate_size,
        "vocab": config.vocab_size,
        "tied": bool(getattr(config, "tie_word_embeddings", False)),
    }


def _timed(device: torch.device, step: Callable[[], Any], repeats: int) -> float:
    """Mean seconds of `step` over `repeats` calls after two untimed ones."""
    for _ in range(2):
        step()
    _sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        step()
    _sync(device)
    return (time.perf_counter() - start) / repeats


def _eager_decode(model, device: torch.device, batch: int, context: int, repeats: int) -> dict:
    """One decoding step of `batch` sequences after a `context`-token prefill, launched eagerly."""
    vocab = model.config.vocab_size
    ids = torch.randint(3, vocab, (batch, context), device=device)
    with torch.no_grad():
        out = model(ids, use_cache=True)
    cache, token = out.past_key_values, ids[:, -1:]

    def step() -> None:
        nonlocal cache
        with torch.no_grad():
            cache = model(token, past_key_values=cache, use_cache=True).past_key_values

    seconds = _timed(device, step, repeats)
    return {"mode": "eager", "batch": batch, "context": context + (repeats + 2) / 2, "step_s": seconds}


def _graph_decode(model, device: torch.device, batch: int, context: int, repeats: int) -> dict:
    """The same step replayed from a captured CUDA graph over a static KV cache (attending to the
    whole cache: the context recorded is its length)."""
    from transformers import StaticCache

    length = context + 8
    try:  # transformers 5 sizes the batch at the first update; 4.x asks for it up front
        cache = StaticCache(config=model.config, max_cache_len=length)
    except TypeError:
        cache = StaticCache(model.config, batch, length, device=device, dtype=model.dtype)
    ids = torch.randint(3, model.config.vocab_size, (batch, context), device=device)
    token, position = ids[:, -1:].clone(), torch.tensor([context], device=device)
    with torch.no_grad():
        model(ids, past_key_values=cache, cache_position=torch.arange(context, device=device), use_cache=True)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # warm-up off the capture stream, as torch.cuda.graphs asks
            for _ in range(3):
                model(token, past_key_values=cache, cache_position=position, use_cache=True)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            model(token, past_key_values=cache, cache_position=position, use_cache=True)
    seconds = _timed(device, graph.replay, repeats)
    return {"mode": "graphs", "batch": batch, "context": length, "step_s": seconds}


def _trace_rank(rank: int, world_size: int, rendezvous, model_dir: str, cpu: bool) -> dict:
    import warnings

    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from llamarl.control.launch.devices import group_backend

    # `past_key_values` is the name every transformers this may meet accepts; 5.x warns about it.
    warnings.filterwarnings("ignore", message=".*past_key_values.*", category=FutureWarning)
    device = _device(cpu)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("gloo", init_method=rendezvous.init_method, rank=rank, world_size=world_size)
    group = dist.new_group([0], backend=group_backend(device))
    trace: dict[str, Any] = {"format": TRACE_FORMAT, "torch": torch.__version__, "notes": []}
    trace["device"] = "cpu" if cpu else torch.cuda.get_device_name(device)
    # Training: the app's trainer on one device, the step the fsdp check times.
    trainer = _trainer(Path(model_dir), device, group)
    trace["model"] = _shape(trainer.model.config)
    # On the CPU (the suite runs it there) a smaller batch: the trace's format, not its figures, is checked.
    prompt, completion, sequences = (16, 48, 4) if cpu else (64, 192, 16)
    batch = random_batch(
        trace["model"]["vocab"], sequences=sequences, prompt_len=prompt, completion_len=completion
    )
    seconds = _timed(device, functools.partial(trainer.train_step, batch), repeats=2)
    trace["train"] = [
        {"sequences": sequences, "prompt_tokens": prompt, "completion_tokens": completion, "step_s": seconds}
    ]
    trainer.close()
    del trainer
    # Decoding: the model alone, in the generator's precision.
    dtype = torch.float32 if cpu else torch.bfloat16
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    context, repeats = (16, 4) if cpu else (256, 16)
    trace["decode"] = []
    for size in TRACE_BATCHES_CPU if cpu else TRACE_BATCHES_GPU:
        trace["decode"].append(_eager_decode(model, device, size, context, repeats))
        if device.type != "cuda":
            continue
        try:
            trace["decode"].append(_graph_decode(model, device, size, context, repeats))
        except Exception as e:  # graphs are a bonus: the eager series is fitted without them
            trace["notes"].append(f"CUDA graph at batch {size} not captured: {_one_line(e)}")
    dist.destroy_process_group()
    return trace


def check_trace(model_dir: Path, cpu: bool, scratch: Path) -> list[dict]:
    from llamarl.comm.testing import run_distributed

    trace = run_distributed(_trace_rank, 1, str(model_dir), cpu, timeout_s=300, fresh=True)[0]
    (scratch / "gpu_trace.json").write_text(json.dumps(trace, indent=1))
    modes = sorted({r["mode"] for r in trace["decode"]})
    fastest = min(r["step_s"] for r in trace["decode"])
    note = (
        f"{len(trace['decode'])} decode steps timed ({', '.join(modes)}; fastest {fastest * 1e3:.2f} ms), "
        f"train step {trace['train'][0]['step_s'] * 1e3:.0f} ms; {scratch / 'gpu_trace.json'}"
    )
    return [row("gpu trace", bool(trace["decode"] and trace["train"]), f"{len(modes)} launch modes", note)]


# ------------------------------------------------------------------------------------------------


def row(check: str, ok: bool, figure: str, note: str) -> dict[str, str]:
    """One line of the table."""
    return {"check": check, "result": "ok" if ok else "FAILED", "figure": figure, "note": note}


def _one_line(error: Any) -> str:
    text = f"{type(error).__name__}: {error}" if isinstance(error, BaseException) else str(error)
    return " ".join(text.split())[:160]


def print_table(rows: list[dict], header: str) -> None:
    print(header)
    columns = ("check", "result", "figure", "note")
    widths = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in columns}
    print("| " + " | ".join(c.ljust(widths[c]) for c in columns) + " |")
    print("|" + "|".join("-" * (widths[c] + 2) for c in columns) + "|")
    for r in rows:
        print("| " + " | ".join(str(r[c]).ljust(widths[c]) for c in columns) + " |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="a dry run on the CPU (gloo, small models)")
    parser.add_argument("--checks", default=",".join(CHECKS), help=f"comma-separated subset of {CHECKS}")
    parser.add_argument("--app-modes", default="async,stream")
    parser.add_argument("--out", default=None, help="keep the scratch files (models, runs) here")
    args = parser.parse_args()
    checks = args.checks.split(",")
    unknown = set(checks) - set(CHECKS)
    if unknown:
        parser.error(f"unknown checks {sorted(unknown)}; known: {', '.join(CHECKS)}")
    if not args.cpu and not torch.cuda.is_available():
        print("gpu_check: no CUDA device visible (use --cpu for a dry run)", file=sys.stderr)
        return 2
    scratch = Path(args.out or tempfile.mkdtemp(prefix="llamarl-gpu-check-"))
    scratch.mkdir(parents=True, exist_ok=True)
    # Inherited by every process started below: no network, no progress bars in the output.
    os.environ.setdefault("WANDB_MODE", "disabled")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    device = "cpu" if args.cpu else torch.cuda.get_device_name(0)
    header = f"llamarl gpu_check: {device}, torch {torch.__version__}, Python {sys.version.split()[0]}"
    start = time.perf_counter()
    rows: list[dict] = []
    big = save_model(scratch / "model", CPU_MODEL if args.cpu else GPU_MODEL)

    def app_model() -> Path:
        return save_model(scratch / "app_model", CPU_MODEL if args.cpu else APP_MODEL)

    steps: list[tuple[str, Callable[[], list[dict]]]] = [
        ("fsdp", lambda: check_fsdp(big, args.cpu)),
        ("sync", lambda: check_sync(big, args.cpu)),
        ("dcp", lambda: check_dcp(big, args.cpu, scratch)),
        ("app", lambda: check_app(app_model(), args.cpu, scratch, args.app_modes.split(","))),
        ("moe", lambda: check_moe(scratch, args.cpu)),
        ("trace", lambda: check_trace(big, args.cpu, scratch)),
    ]
    for name, run in steps:
        if name not in checks:
            continue
        began = time.perf_counter()
        try:
            rows += run()
        except Exception as e:
            traceback.print_exc()
            rows.append(row(name, False, "", _one_line(e)))
        print(f"gpu_check: {name} done in {time.perf_counter() - began:.0f} s", file=sys.stderr, flush=True)
    print_table(rows, f"{header}; {time.perf_counter() - start:.0f} s in all")
    (scratch / "gpu_check.json").write_text(json.dumps(rows, indent=1))
    return 0 if all(r["result"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
