"""Times one trainer step on SmolLM2-135M-Instruct on one 16-sequence GSM8K batch: padded rows against
packed rows, each with and without sharing each prompt's forward across its group, on 1 and 2 ranks,
and TRL's GRPOTrainer's training pass on the same batch.

    uv run tools/bench_train_step.py [--threads 2] [--prompts 4] [--samples 4] [--max-completion 256]
        [--uneven | --even] [--ranks 1 2] [--layouts padded shared packed packed_shared ...] [--json out.json]
    uv run --with trl==1.16.0 tools/bench_train_step.py --ranks 1 --layouts trl padded packed_shared
    uv run tools/bench_train_step.py --precision bf16 ...   (bf16 compute, float32 master weights)

Each case runs in fresh processes, so its peak RSS is its own. The `trl` layouts (1 rank only; TRL is
not a project dependency, `--with` adds it for the one run) time what GRPOTrainer does with a generated
batch: its `compute_loss` (padded rows of `--micro-batch-size`, its fused LM head, DAPO token-sum loss,
no KL) and backward per micro-batch, then clipping and the AdamW step, as its training loop would,
with generation and scoring left out on both sides. `trl` keeps GRPOConfig's defaults (activation
checkpointing on, enabled here as `train()` would); `trl_no_checkpointing` turns it off, as llamarl's
layouts run but `packed_shared_checkpointed`.

Prompts are real GSM8K questions in the chat template; completions are random tokens (the cost of a
training pass does not depend on what the tokens say). With `--uneven` (the default) completion lengths
are drawn uniformly from [max/8, max], as RL rollouts are: some stop early, some hit the limit. One rank
uses `--threads` threads; two ranks (FSDP2 over gloo, one process each) use one thread each, so both
use the same cores. tokens/s counts completion tokens (what the loss is over) of the whole batch;
CPU seconds and peak RSS are the sums over the ranks. `--precision` (fp32 by default, as before) sets
llamarl's `trainer.precision` and TRL's `bf16` alike.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from functools import partial
from pathlib import Path

import torch

from llamarl.exec import PolicyTrainer, smollm2_path
from llamarl.exec.testing import build_trainer
from llamarl.exec.types import RolloutBatch

_KEPT = {"activation_checkpointing": False}
LAYOUTS = {  # name -> trainer settings (pack_tokens of the packed ones is set from --pack-tokens)
    "padded": {"share_prompts": False, **_KEPT},
    "shared": {"share_prompts": True, **_KEPT},  # padded rows, each prompt forwarded once per group
    "packed": {"share_prompts": False, **_KEPT},  # packed rows, each sequence with its own prompt
    "packed_shared": {"share_prompts": True, **_KEPT},  # packed rows, each group's prompt laid once
    # the same with activation checkpointing (the trainer's default), as TRL's defaults run
    "packed_shared_checkpointed": {"share_prompts": True, "activation_checkpointing": True},
}


TRL_LAYOUTS = {  # name -> GRPOConfig overrides (see _trl_step)
    "trl": {},  # TRL's defaults, which turn gradient checkpointing on
    "trl_no_checkpointing": {"activation_checkpointing": False},  # as the llamarl layouts run
}


def make_batch(
    tokenizer, *, prompts: int, samples: int, max_completion: int, uneven: bool, seed: int = 0
) -> RolloutBatch:
    """`prompts` GSM8K questions x `samples` random completions, right-padded to the longest."""
    from bench_generate import gsm8k_prompts  # (tools/, beside this script)

    ids = gsm8k_prompts(tokenizer, prompts)
    width = max(map(len, ids))
    prompt_ids = torch.tensor([[0] * (width - len(p)) + p for p in ids for _ in range(samples)])
    prompt_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ids for _ in range(samples)])
    num = prompts * samples
    g = torch.Generator().manual_seed(seed)
    if uneven:
        lengths = torch.randint(max(max_completion // 8, 1), max_completion + 1, (num,), generator=g)
    else:
        lengths = torch.full((num,), max_completion)
    width_c = int(lengths.max())
    mask = (torch.arange(width_c)[None, :] < lengths[:, None]).long()
    return RolloutBatch(
        prompt_ids_BP=prompt_ids,
        prompt_mask_BP=prompt_mask,
        completion_ids_BC=torch.randint(0, len(tokenizer), (num, width_c), generator=g) * mask,
        completion_mask_BC=mask,
        behavior_logprobs_BC=torch.full((num, width_c), -2.0) * mask,
        rewards_B=torch.rand(num, generator=g).round(),
        policy_version_B=torch.zeros(num, dtype=torch.int64),
        group_size=samples,
    )


def _trl_step(model: str, batch: RolloutBatch, args, output_dir: str, **overrides):
    """A callable running one GRPOTrainer training pass (loss, backward, clip, AdamW) over `batch`."""
    try:
        from datasets import Dataset
        from trl import GRPOConfig, GRPOTrainer
    except ImportError as error:
        raise SystemExit(
            "the trl layout needs TRL: uv run --with trl==1.16.0 tools/bench_train_step.py ..."
        ) from error
    micro = args.micro_batch_size
    if batch.num_sequences % micro:
        raise SystemExit(f"--micro-batch-size {micro} must divide the {batch.num_sequences} sequences")
    config = GRPOConfig(
        output_dir=output_dir,
        use_cpu=True,
        bf16=args.precision == "bf16",
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=batch.num_sequences // micro,
        num_generations=batch.group_size,
        max_completion_length=batch.completion_ids_BC.shape[1],
        beta=0.0,  # no reference model, as in the llamarl layouts
        report_to=[],
        **overrides,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=lambda completions, **_: [0.0] * len(completions),
        args=config,
        train_dataset=Dataset.from_dict({"prompt": ["unused"] * batch.num_sequences}),
    )
    if config.activation_checkpointing:  # (`train()` turns it on; this pass calls compute_loss itself)
        kwargs = dict(config.activation_checkpointing_kwargs or {})
        every_n_layers, offload = kwargs.pop("every_n_layers", 1), kwargs.pop("offload", False)
        trainer.model.activation_checkpointing_enable(
            activation_checkpointing_kwargs=kwargs or None, every_n_layers=every_n_layers, offload=offload
        )
    model_ = trainer.model.train()
    optimizer = trainer.create_optimizer()
    trainer.current_gradient_accumulation_steps = config.gradient_accumulation_steps  # (set by train())
    rewards_GN = batch.rewards_B.view(-1, batch.group_size)
    advantages_B = (rewards_GN - rewards_GN.mean(1, keepdim=True)).flatten()
    num_items = torch.tensor(float(batch.num_completion_tokens))

    def step() -> None:
        for first in range(0, batch.num_sequences, micro):
            rows = slice(first, first + micro)
            inputs = {
                "prompt_ids": batch.prompt_ids_BP[rows],
                "prompt_mask": batch.prompt_mask_BP[rows],
                "completion_ids": batch.completion_ids_BC[rows],
                "completion_mask": batch.completion_mask_BC[rows],
                "advantages": advantages_B[rows],
                "num_items_in_batch": num_items,
            }
            trainer.accelerator.backward(trainer.compute_loss(model_, inputs))
        torch.nn.utils.clip_grad_norm_(model_.parameters(), config.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def _trainer(model: str, layout: str, args, group) -> PolicyTrainer:
    settings = dict(LAYOUTS[layout])
    settings["pack_tokens"] = args.pack_tokens if layout.startswith("packed") else 0
    compute_dtype = "bfloat16" if args.precision == "bf16" else None
    return build_trainer(
        model, micro_batch_size=args.micro_batch_size, group=group, compute_dtype=compute_dtype, **settings
    )


def _time_steps(step, repeats: int, warmup: bool, barrier=None) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process, all its threads) per call of `step` (one training
    step). On a shared machine the CPU time is the steadier figure: it leaves out waiting for a core."""
    if warmup:
        step()  # allocator, optimizer state, FSDP2 lazy init
    if barrier:
        barrier()
    start, start_cpu = time.perf_counter(), time.process_time()
    for _ in range(repeats):
        step()
    if barrier:
        barrier()
    return (time.perf_counter() - start) / repeats, (time.process_time() - start_cpu) / repeats


def _case(rank: int, world_size: int, rdv, model: str, layout: str, batch, args) -> dict:
    """One layout timed in this (fresh) process: its step times and this process's peak RSS."""
    import resource

    import torch.distributed as dist

    if world_size == 1:
        torch.set_num_threads(args.threads)  # (the harness starts its children with one thread)
    barrier = None
    with tempfile.TemporaryDirectory() as output_dir:
        if layout in TRL_LAYOUTS:
            step = _trl_step(model, batch, args, output_dir, **TRL_LAYOUTS[layout])
        else:
            group = None
            if world_size > 1:
                dist.init_process_group("gloo", init_method=rdv.init_method, rank=rank, world_size=world_size)
                group, barrier = dist.group.WORLD, dist.barrier
                batch = batch.data_parallel_part(rank, world_size)
            trainer = _trainer(model, layout, args, group)
            trainer.setup()
            step = partial(trainer.train_step, batch)
        seconds, cpu_seconds = _time_steps(step, args.repeats, args.warmup, barrier)
    peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # (KiB on Linux)
    return {"step_s": seconds, "cpu_s": cpu_seconds, "peak_rss_gb": peak_gb}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2, help="threads of the 1-rank runs")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--max-completion", type=int, default=256)
    parser.add_argument("--even", dest="uneven", action="store_false", help="every completion max long")
    parser.add_argument("--micro-batch-size", type=int, default=4, help="sequences per padded micro-batch")
    parser.add_argument("--pack-tokens", type=int, default=2048, help="token budget of a packed micro-batch")
    parser.add_argument("--repeats", type=int, default=1, help="timed steps")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32", help="compute precision")
    parser.add_argument(
        "--no-warmup", dest="warmup", action="store_false", help="time the first step too (saves a step)"
    )
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2], choices=[1, 2])
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=[*LAYOUTS, *TRL_LAYOUTS])
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from llamarl.comm.testing import run_distributed

    model = str(smollm2_path())
    batch = make_batch(
        AutoTokenizer.from_pretrained(model),
        prompts=args.prompts,
        samples=args.samples,
        max_completion=args.max_completion,
        uneven=args.uneven,
    )
    completion = batch.num_completion_tokens
    real = completion + int(batch.prompt_mask_BP.sum())
    padded = batch.num_sequences * (batch.prompt_ids_BP.shape[1] + batch.completion_ids_BC.shape[1])
    shortest = int(batch.completion_mask_BC.sum(1).min())
    print(
        f"batch: {batch.num_sequences} sequences, prompts <= {batch.prompt_ids_BP.shape[1]} tokens, "
        f"completions {shortest}..{batch.completion_ids_BC.shape[1]} tokens; "
        f"{completion} completion tokens, {real} real tokens, {padded} padded positions"
    )
    results = []
    for ranks in args.ranks:
        for layout in args.layouts:
            load_before = os.getloadavg()[0]
            if layout in TRL_LAYOUTS and ranks != 1:
                continue  # (TRL's multi-process path needs accelerate's launcher)
            # Fresh processes per case: each case's peak memory is its own.
            cases = run_distributed(_case, ranks, model, layout, batch, args, timeout_s=3600, fresh=True)
            seconds = max(case["step_s"] for case in cases)  # (equal: the ranks meet at a barrier)
            results.append(
                {
                    "layout": layout,
                    "ranks": ranks,
                    "step_s": seconds,
                    "cpu_s": sum(case["cpu_s"] for case in cases),  # all ranks: the work done
                    "peak_rss_gb": sum(case["peak_rss_gb"] for case in cases),  # all ranks
                    "completion_tokens_per_s": completion / seconds,
                    "real_tokens_per_s": real / seconds,
                    "load_1min": [load_before, os.getloadavg()[0]],  # before, after (shared machine)
                }
            )
            print(json.dumps(results[-1]), flush=True)
    padded_1_rank = next((r for r in results if r["layout"] == "padded" and r["ranks"] == 1), None)
    base, base_cpu = (padded_1_rank["step_s"], padded_1_rank["cpu_s"]) if padded_1_rank else (None, None)
    trl = next((r["step_s"] for r in results if r["layout"] == "trl"), None)
    print(
        "\n| layout | trainer ranks | s/step | completion tok/s | real tok/s | speed-up vs padded 1 rank "
        "| vs TRL | CPU s/step (all ranks) | CPU speed-up | peak RSS GB (all ranks) "
        "| load avg 1 min (before, after) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        speedup = f"{base / r['step_s']:.2f}x" if base else "-"
        vs_trl = f"{trl / r['step_s']:.2f}x" if trl else "-"
        cpu_speedup = f"{base_cpu / r['cpu_s']:.2f}x" if base_cpu else "-"
        print(
            f"| {r['layout']} | {r['ranks']} | {r['step_s']:.1f} | {r['completion_tokens_per_s']:.0f} | "
            f"{r['real_tokens_per_s']:.0f} | {speedup} | {vs_trl} | {r['cpu_s']:.1f} | {cpu_speedup} | "
            f"{r['peak_rss_gb']:.2f} | {r['load_1min'][0]:.1f}, {r['load_1min'][1]:.1f} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
