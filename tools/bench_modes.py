"""The three schedules side by side on the same work: `uv run tools/bench_modes.py [--modes ...]`.

Runs the GSM8K app once per mode (sync, async, stream by default) with the same model, prompts and
lengths, one after the other on this machine, and prints per mode: seconds per step, completion
tokens trained per second, the generate and train time per batch, the weight sync, the best step
time the schedule can reach with those phase times (max(generate, train) + sync when they overlap,
their sum in sync mode), the step time over that bound, and the staleness and idle figures. Ratios
are against the first mode.

Defaults are the issue's benchmark: SmolLM2-135M-Instruct, 4 prompts x 4 samples x 128 new tokens,
6 steps, no evaluation.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_mode(mode: str, args: argparse.Namespace, out: Path) -> dict:
    command = [
        sys.executable, str(REPO / "apps" / "gsm8k_rl"), "--mode", mode,
        "--output-dir", str(out), "--steps", str(args.steps),
        "--prompts-per-step", str(args.prompts_per_step),
        "--samples-per-prompt", str(args.samples_per_prompt),
        "--max-new-tokens", str(args.max_new_tokens), "--eval-size", "0", "--no-wandb", "--no-save-model",
        "--max-policy-lag", str(args.max_policy_lag), "--generator", args.generator,
    ]  # fmt: skip
    if args.model:
        command += ["--model", args.model]
    if args.data:
        command += ["--data", args.data]
    command += args.extra
    print(f"[{time.strftime('%H:%M:%S')}] {mode}: {' '.join(command[1:])}", flush=True)
    result = subprocess.run(
        command, capture_output=True, text=True, env={**os.environ, "WANDB_SILENT": "true"}
    )
    if result.returncode != 0:
        raise SystemExit(f"{mode} failed:\n{result.stderr[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    print(f"[{time.strftime('%H:%M:%S')}] {mode}: done in {summary['wall_s']:.0f} s", flush=True)
    return summary


def figures(summary: dict, prompts_per_step: int) -> dict[str, float]:
    """The headline figures of one run (seconds per batch of `prompts_per_step` prompts)."""
    records = [
        json.loads(line) for line in Path(summary["output_dir"], "metrics.jsonl").read_text().splitlines()
    ]
    steps = [r for r in records if "train/reward_mean" in r]
    generate_total = sum(r["time/generate_s"] for r in steps)
    groups_total = sum(r.get("sampling/groups", prompts_per_step) for r in steps)
    # A stream generator samples continuously (some groups are dropped as stale): its time per batch
    # is its generate time per group sampled, times the groups of a batch.
    generate_per_batch = generate_total / groups_total * prompts_per_step
    # The best a schedule can do with these phase times: overlapped (async, stream) the slower of
    # generate and train plus the sync; one after the other (sync) their sum.
    if summary["mode"] == "sync":
        bound = generate_per_batch + summary["train_s_mean"] + summary["weight_sync_s"]
    else:
        bound = max(generate_per_batch, summary["train_s_mean"]) + summary["weight_sync_s"]
    return {
        "step_s": summary["step_time_s"],
        "tokens_per_s": summary["gen_tokens_per_s"],
        "generate_s": generate_per_batch,
        "train_s": summary["train_s_mean"],
        "sync_s": summary["weight_sync_s"],
        "bound_s": bound,
        "step_over_bound": summary["step_time_s"] / bound,
        "lag_max": summary["policy_lag_max"],
        "dropped": summary.get("stream", {}).get("dropped_stale_groups", 0),
        "gen_idle": summary["generator_idle_frac_mean"],
        "train_idle": summary["trainer_idle_frac_mean"],
        "peak_gb": summary["peak_rss_mb_total"] / 1024,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--modes", nargs="+", default=["sync", "async", "stream"])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--prompts-per-step", type=int, default=4)
    p.add_argument("--samples-per-prompt", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--max-policy-lag", type=int, default=1)
    p.add_argument("--generator", default="hf", choices=["hf", "vllm"])
    p.add_argument("--model", help="model folder (default: the app's)")
    p.add_argument("--data", help="GSM8K folder (default: the app's)")
    p.add_argument("--output-dir", type=Path, default=Path("runs/bench_modes"))
    p.add_argument("extra", nargs=argparse.REMAINDER, help="after --: more app flags for every mode")
    args = p.parse_args(argv)
    args.extra = [a for a in args.extra if a != "--"]
    rows = {}
    for mode in args.modes:
        summary = run_mode(mode, args, args.output_dir / mode)
        summary["output_dir"] = str(args.output_dir / mode)
        rows[mode] = figures(summary, args.prompts_per_step)
    load = os.getloadavg()
    print(f"\nload average after the runs: {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")
    base = rows[args.modes[0]]
    columns = [  # label, key, format
        ("step s", "step_s", ".1f"), ("tok/s", "tokens_per_s", ".1f"), ("x tok/s", "speedup", ".2f"),
        ("gen s", "generate_s", ".1f"), ("train s", "train_s", ".1f"), ("sync s", "sync_s", ".2f"),
        ("bound s", "bound_s", ".1f"), ("step/bound", "step_over_bound", ".2f"), ("lag", "lag_max", ".0f"),
        ("dropped", "dropped", ".0f"), ("gen idle", "gen_idle", ".2f"), ("train idle", "train_idle", ".2f"),
        ("peak GB", "peak_gb", ".1f"),
    ]  # fmt: skip
    print(f"{'mode':8}" + "".join(f" {label:>10}" for label, _, _ in columns))
    for mode, r in rows.items():
        r["speedup"] = r["tokens_per_s"] / base["tokens_per_s"]
        print(f"{mode:8}" + "".join(f" {r[key]:>10{fmt}}" for _, key, fmt in columns))
    return 0


if __name__ == "__main__":
    sys.exit(main())
