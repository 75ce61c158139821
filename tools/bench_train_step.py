"""Times one trainer step on SmolLM2-135M-Instruct on one 16-sequence GSM8K batch: padded rows (with and
without sharing each prompt's forward across its group) against packed rows, on 1 and 2 trainer ranks.

    uv run tools/bench_train_step.py [--threads 2] [--prompts 4] [--samples 4] [--max-completion 256]
        [--uneven | --even] [--ranks 1 2] [--layouts padded shared packed] [--json out.json]

Prompts are real GSM8K questions in the chat template; completions are random tokens (the cost of a
training pass does not depend on what the tokens say). With `--uneven` (the default) completion lengths
are drawn uniformly from [max/8, max], as RL rollouts are: some stop early, some hit the limit. One rank
uses `--threads` threads; two ranks (FSDP2 over gloo, one process each) use one thread each, so both
use the same cores. tokens/s counts completion tokens (what the loss is over) of the whole batch.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from llamarl.exec import PolicyTrainer, TrainerConfig, smollm2_path
from llamarl.exec.types import RolloutBatch

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "gsm8k" / "test.jsonl"
LAYOUTS = {  # name -> trainer settings
    "padded": {"share_prompts": False},
    "shared": {"share_prompts": True},  # padded rows, each prompt forwarded once per group
    "packed": {},  # pack_tokens is set from --pack-tokens
}


def make_batch(
    tokenizer, *, prompts: int, samples: int, max_completion: int, uneven: bool, seed: int = 0
) -> RolloutBatch:
    """`prompts` GSM8K questions x `samples` random completions, right-padded to the longest."""
    rows = [json.loads(line) for line in DATA.read_text().splitlines()[:prompts]]
    ids = [
        list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": r["question"]}],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=True,
            )["input_ids"]
        )
        for r in rows
    ]
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


def _config(model: str, layout: str, args) -> TrainerConfig:
    settings = dict(LAYOUTS[layout])
    if layout == "packed":
        settings["pack_tokens"] = args.pack_tokens
    return TrainerConfig(model=model, micro_batch_size=args.micro_batch_size, **settings)


def _time_steps(
    trainer: PolicyTrainer, batch: RolloutBatch, repeats: int, warmup: bool, barrier=None
) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process, all its threads) per step. On a shared machine the
    CPU time is the steadier figure: it leaves out the time spent waiting for a core."""
    if warmup:
        trainer.train_step(batch)  # allocator, optimizer state, FSDP2 lazy init
    if barrier:
        barrier()
    start, start_cpu = time.perf_counter(), time.process_time()
    for _ in range(repeats):
        trainer.train_step(batch)
    if barrier:
        barrier()
    return (time.perf_counter() - start) / repeats, (time.process_time() - start_cpu) / repeats


def _two_rank_case(
    rank: int, world_size: int, rdv, model: str, layout: str, batch, args
) -> tuple[float, float]:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=rdv.init_method, rank=rank, world_size=world_size)
    trainer = PolicyTrainer(_config(model, layout, args), group=dist.group.WORLD)
    trainer.setup()
    part = batch.data_parallel_part(rank, world_size)
    times = _time_steps(trainer, part, args.repeats, args.warmup, dist.barrier)
    trainer.close()
    return times


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
    parser.add_argument(
        "--no-warmup", dest="warmup", action="store_false", help="time the first step too (saves a step)"
    )
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2], choices=[1, 2])
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
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
            if ranks == 1:
                torch.set_num_threads(args.threads)
                trainer = PolicyTrainer(_config(model, layout, args))
                trainer.setup()
                seconds, cpu_seconds = _time_steps(trainer, batch, args.repeats, args.warmup)
                trainer.close()
            else:  # (CPU seconds: rank 0's process)
                seconds, cpu_seconds = run_distributed(
                    _two_rank_case, 2, model, layout, batch, args, timeout_s=3600, fresh=True
                )[0]
            results.append(
                {
                    "layout": layout,
                    "ranks": ranks,
                    "step_s": seconds,
                    "cpu_s": cpu_seconds,
                    "completion_tokens_per_s": completion / seconds,
                    "real_tokens_per_s": real / seconds,
                    "load_1min": [load_before, os.getloadavg()[0]],  # before, after (shared machine)
                }
            )
            print(json.dumps(results[-1]), flush=True)
    base = next((r["step_s"] for r in results if r["layout"] == "padded" and r["ranks"] == 1), None)
    base_cpu = next((r["cpu_s"] for r in results if r["layout"] == "padded" and r["ranks"] == 1), None)
    print(
        "\n| layout | trainer ranks | s/step | completion tok/s | real tok/s | speed-up vs padded 1 rank "
        "| CPU s/step | CPU speed-up | load avg 1 min (before, after) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        speedup = f"{base / r['step_s']:.2f}x" if base else "-"
        cpu_speedup = f"{base_cpu / r['cpu_s']:.2f}x" if base_cpu else "-"
        print(
            f"| {r['layout']} | {r['ranks']} | {r['step_s']:.1f} | {r['completion_tokens_per_s']:.0f} | "
            f"{r['real_tokens_per_s']:.0f} | {speedup} | {r['cpu_s']:.1f} | {cpu_speedup} | "
            f"{r['load_1min'][0]:.1f}, {r['load_1min'][1]:.1f} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
