"""Does reward-model scoring overlap the other phases? `uv run tools/bench_reward.py --reward-model DIR`.

Runs the arith app once per mode (sync, async, stream by default) with the reward model on a reward rank
of its own (`--num-reward-ranks 1`), and once colocated with the generator (`--placements colocated`),
with the same policy, prompts and lengths, one after the other on this machine. From each run's
trace.json it prints the fraction of the reward model's scoring time that overlapped the generators'
`generate` spans, the trainer's `train` spans, and either of them, next to the step time and the reward
model's scoring time and throughput (from summary.json).

A colocated reward model scores inside the generator, after it generates: it never overlaps generation
by construction, only training (in async and stream mode). A reward rank should overlap both.
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
sys.path.insert(0, str(REPO / "packages" / "llamarl-control" / "src"))


def run(mode: str, placement: str, args: argparse.Namespace, out: Path) -> dict:
    reward_ranks = "1" if placement == "ranks" else "0"
    command = [
        sys.executable, str(REPO / "apps" / "arith_rl"), "--mode", mode, "--output-dir", str(out),
        "--steps", str(args.steps), "--prompts-per-step", str(args.prompts_per_step),
        "--samples-per-prompt", str(args.samples_per_prompt), "--max-new-tokens", str(args.max_new_tokens),
        "--eval-size", "0", "--no-wandb", "--no-save-model", "--num-reward-ranks", reward_ranks,
        "--reward-model-path", str(args.reward_model), *args.extra,
    ]  # fmt: skip
    if args.model:
        command += ["--model", args.model]
    print(f"[{time.strftime('%H:%M:%S')}] {mode}/{placement}: {' '.join(command[1:])}", flush=True)
    result = subprocess.run(
        command, capture_output=True, text=True, env={**os.environ, "WANDB_SILENT": "true"}
    )
    if result.returncode != 0:
        raise SystemExit(f"{mode}/{placement} failed:\n{result.stderr[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    print(f"[{time.strftime('%H:%M:%S')}] {mode}/{placement}: done in {summary['wall_s']:.0f} s", flush=True)
    return summary


def overlaps(trace: Path) -> dict[str, float]:
    """Fractions of the reward model's scoring time (its `reward_model` spans, on every lane) that
    overlapped generation (the generators' `generate` spans) and training (the trainer's `train`)."""
    from llamarl.control.outputs.timeline import overlap_fraction, read_chrome_trace

    spans, roles = read_chrome_trace(trace)
    scoring = [s for lane in spans.values() for s in lane if s.name == "reward_model" and s.tick >= 0]
    generating = [
        s for r, lane in spans.items() if "generator" in roles[r] for s in lane if s.name == "generate"
    ]
    training = [s for r, lane in spans.items() if "trainer" in roles[r] for s in lane if s.name == "train"]
    return {
        "with_generate": overlap_fraction(scoring, generating),
        "with_train": overlap_fraction(scoring, training),
        "with_either": overlap_fraction(scoring, generating + training),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reward-model", required=True, help="reward model folder (tools/train_reward_model.py)")
    p.add_argument("--model", help="policy folder (default: the app's)")
    p.add_argument("--modes", nargs="+", default=["sync", "async", "stream"])
    p.add_argument("--placements", nargs="+", default=["ranks"], choices=["ranks", "colocated"])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--prompts-per-step", type=int, default=8)
    p.add_argument("--samples-per-prompt", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--output-dir", type=Path, default=Path("runs/bench_reward"))
    p.add_argument(
        "--from-runs", action="store_true", help="run nothing: read the runs already in --output-dir"
    )
    p.add_argument("extra", nargs=argparse.REMAINDER, help="after --: more app flags for every run")
    args = p.parse_args(argv)
    args.extra = [a for a in args.extra if a != "--"]
    rows = {}
    for placement in args.placements:
        for mode in args.modes:
            out = args.output_dir / f"{mode}_{placement}"
            if args.from_runs:
                if not (out / "summary.json").is_file():
                    continue
                summary = json.loads((out / "summary.json").read_text())
            else:
                summary = run(mode, placement, args, out)
            rows[f"{mode}/{placement}"] = {
                "step_s": summary["step_time_s"],
                "scoring_s": summary["reward_model_scoring_s"] / summary["steps"],
                "samples_per_s": summary["reward_model_samples_per_s"],
                **overlaps(out / "trace.json"),
            }
    load = os.getloadavg()
    print(f"\nload average after the runs: {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")
    columns = [  # label, key, format
        ("step s", "step_s", ".1f"), ("score s/step", "scoring_s", ".2f"),
        ("samples/s", "samples_per_s", ".1f"), ("ovl gen", "with_generate", ".2f"),
        ("ovl train", "with_train", ".2f"), ("ovl either", "with_either", ".2f"),
    ]  # fmt: skip
    print(f"{'run':18}" + "".join(f" {label:>12}" for label, _, _ in columns))
    for name, r in rows.items():
        print(f"{name:18}" + "".join(f" {r[key]:>12{fmt}}" for _, key, fmt in columns))
    (args.output_dir / "overlap.json").write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
