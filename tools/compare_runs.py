"""Two runs side by side: `uv run tools/compare_runs.py RUN_A RUN_B [--out compare.png]`.

Reads the output folders of two finished runs (e.g. `--mode sync` and `--mode async` on the same work),
prints their headline figures with the ratio B / A, and draws both into one picture with the panels of
`report.png`: training reward, held-out accuracy, time per step and where each rank's time went.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from llamarl.control.outputs.report import draw, load_run

FIGURES = (  # summary.json key, label
    ("step_time_s", "step time (s)"),
    ("gen_tokens_per_s", "completion tokens/s"),
    ("generate_s_mean", "generate (s)"),
    ("train_s_mean", "train (s)"),
    ("weight_sync_s", "weight sync (s)"),
    ("eval_accuracy_start", "greedy accuracy, start"),
    ("eval_accuracy_end", "greedy accuracy, end"),
    ("eval_sampled_accuracy_start", "sampled accuracy, start"),
    ("eval_sampled_accuracy_end", "sampled accuracy, end"),
    ("eval_reward_start", "greedy mean reward, start"),
    ("eval_reward_end", "greedy mean reward, end"),
    ("peak_rss_mb_total", "peak memory, all processes (MB)"),
    ("wall_s", "wall (s)"),
)


def _fmt(value) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_a", type=Path, help="output folder of the first run")
    parser.add_argument("run_b", type=Path, help="output folder of the second run")
    parser.add_argument("--names", nargs=2, metavar=("A", "B"), help="labels (default: the folder names)")
    parser.add_argument("--out", type=Path, default=Path("compare.png"), help="picture to write")
    args = parser.parse_args(argv)
    names = args.names or [None, None]
    try:
        runs = [load_run(args.run_a, names[0]), load_run(args.run_b, names[1])]
    except FileNotFoundError as e:
        print(f"compare_runs: error: {e}", file=sys.stderr)
        return 2
    a, b = runs
    print(f"| figure | {a.name} | {b.name} | {b.name} / {a.name} |")
    print("|---|---|---|---|")
    for key, label in FIGURES:
        va, vb = a.summary.get(key), b.summary.get(key)
        ratio = vb / va if isinstance(va, int | float) and isinstance(vb, int | float) and va else None
        print(f"| {label} | {_fmt(va)} | {_fmt(vb)} | {_fmt(ratio)} |")
    draw(runs, args.out, f"{a.name} vs {b.name}")
    print(f"picture: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
