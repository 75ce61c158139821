"""The picture of a run: OUTPUT_DIR/report.png, drawn from the files the run wrote.

Four panels: training reward per step, held-out accuracy per policy version, step time per step, and
where each rank's time went per tick (generate / score / train / weight sync / rollouts / eval / idle),
which shows whether the ranks overlap or wait for each other. `tools/compare_runs.py` draws two runs
into the same panels.
"""

from __future__ import annotations

import json
import textwrap
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llamarl.control.outputs.timeline import read_chrome_trace

if TYPE_CHECKING:
    from matplotlib.figure import Figure

FIGURE_SIZE = (14, 9.5)  # inches
# The title's characters per line: the width of the picture at the title's font size, with a margin.
TITLE_WIDTH_CHARS = 150

PHASE_COLORS = {
    "generate": "tab:blue",
    "score": "tab:cyan",
    "reward_model": "tab:olive",
    "train": "tab:orange",
    "weight_sync": "tab:red",
    "rollouts": "tab:purple",
    "eval": "tab:green",
    "checkpoint": "tab:brown",
    "idle": "lightgray",
}


@dataclass(kw_only=True)
class RunRecord:
    """What a finished run left in its output folder, in the shapes the plots want."""

    name: str
    summary: dict[str, Any]
    steps: list[dict[str, float]] = field(default_factory=list)  # metrics.jsonl training records
    evals: list[dict[str, float]] = field(default_factory=list)  # metrics.jsonl evaluation records
    phase_s_per_tick: dict[str, dict[str, float]] = field(default_factory=dict)  # rank lane -> phase -> s


def load_run(output_dir: Path, name: str | None = None) -> RunRecord:
    """Reads summary.json, metrics.jsonl and trace.json (each optional but the summary) of a run."""
    output_dir = Path(output_dir)
    summary_path = output_dir / "summary.json"
    if not summary_path.is_file():
        raise FileNotFoundError(f"{output_dir}: no summary.json (not the output folder of a finished run)")
    run = RunRecord(name=name or output_dir.name, summary=json.loads(summary_path.read_text()))
    metrics_path = output_dir / "metrics.jsonl"
    if metrics_path.is_file():
        for line in metrics_path.read_text().splitlines():
            record = json.loads(line)
            if "eval/policy_version" in record:
                run.evals.append(record)
            elif "train/reward_mean" in record:
                run.steps.append(record)
    trace_path = output_dir / "trace.json"
    if trace_path.is_file():
        run.phase_s_per_tick = phase_seconds_per_tick(trace_path)
    return run


def phase_seconds_per_tick(trace_path: Path) -> dict[str, dict[str, float]]:
    """Mean seconds per training tick that each rank spent in each phase, plus its idle time.

    Only the training loop counts (spans with tick >= 0). An evaluation inside the loop ends in a
    collective, so for a while every rank is evaluating: that common stretch is left out of the loop
    (it is not training); what a rank spent evaluating before the others joined counts as its `eval`.
    The loop's length is the same for every rank: what a rank did not spend in a phase it spent
    waiting for another rank (`idle`).
    """
    spans_by_rank, roles = read_chrome_trace(trace_path)
    in_loop = {r: [s for s in spans if s.tick >= 0] for r, spans in spans_by_rank.items()}
    every = [s for spans in in_loop.values() for s in spans]
    if not every:
        return {}
    evals_by_tick: dict[int, list] = defaultdict(list)
    for span in every:
        if span.name == "eval":
            evals_by_tick[span.tick].append(span)
    common = {  # the stretch of each in-loop evaluation during which every rank was in it
        tick: max(0.0, min(s.end for s in spans) - max(s.start for s in spans))
        for tick, spans in evals_by_tick.items()
    }
    loop_s = max(s.end for s in every) - min(s.start for s in every) - sum(common.values())
    num_ticks = len({s.tick for s in every})
    result: dict[str, dict[str, float]] = {}
    for rank in sorted(in_loop):
        totals: dict[str, float] = defaultdict(float)
        for span in in_loop[rank]:
            totals[span.name] += span.end - span.start - (common[span.tick] if span.name == "eval" else 0.0)
        totals["idle"] = max(0.0, loop_s - sum(totals.values()))
        result[roles.get(rank, f"rank {rank}")] = {k: v / num_ticks for k, v in totals.items()}
    return result


def _rolling(values: list[float], window: int) -> list[float]:
    """The mean of each value and the `window - 1` before it."""
    out = []
    for i in range(len(values)):
        chunk = values[max(0, i - window + 1) : i + 1]
        out.append(sum(chunk) / len(chunk))
    return out


def plot_rewards(ax, run: RunRecord, color: str | None = None) -> None:
    """Mean training reward per step (dots) and its running mean over a tenth of the run (line)."""
    steps = [int(r["step"]) for r in run.steps]
    rewards = [r["train/reward_mean"] for r in run.steps]
    ax.plot(steps, rewards, ".", alpha=0.35, color=color)
    window = max(1, len(rewards) // 10)
    ax.plot(steps, _rolling(rewards, window), "-", color=color, label=f"{run.name} (mean of {window})")
    ax.set(title="training reward", xlabel="step (policy_version)", ylabel="mean reward")


def plot_eval(ax, run: RunRecord, color: str | None = None) -> None:
    """Held-out accuracy against the policy_version that answered (greedy, and sampled when scored), on a
    0-1 axis; for a task that does not say when an answer is right, its held-out mean reward instead, on
    an axis of its own."""
    judged = any("eval/accuracy" in r for r in run.evals)
    greedy, sampled = ("eval/accuracy", "eval/sampled_accuracy") if judged else ("eval/reward_mean", "eval/sampled_reward_mean")
    versions = [int(r["eval/policy_version"]) for r in run.evals]
    ax.plot(versions, [r.get(greedy, float("nan")) for r in run.evals], "o-", color=color, label=f"{run.name} greedy")
    if any(sampled in r for r in run.evals):
        ax.plot(versions, [r.get(sampled, float("nan")) for r in run.evals], "s--", color=color, label=f"{run.name} sampled")
    if judged:
        ax.set(title="held-out accuracy", xlabel="policy_version", ylabel="accuracy", ylim=(0, 1))
    else:
        ax.set(title="held-out mean reward", xlabel="policy_version", ylabel="mean reward")


def plot_step_times(ax, run: RunRecord, color: str | None = None) -> None:
    """Seconds per step, and the generate and train parts of each step."""
    steps = [int(r["step"]) for r in run.steps]
    ax.plot(
        steps,
        [r.get("time/step_s", float("nan")) for r in run.steps],
        "-",
        color=color,
        label=f"{run.name} step",
    )
    ax.plot(steps, [r["time/generate_s"] for r in run.steps], ":", color=color, label=f"{run.name} generate")
    ax.plot(steps, [r["time/train_s"] for r in run.steps], "--", color=color, label=f"{run.name} train")
    ax.set(title="time per step", xlabel="step", ylabel="seconds")


def plot_phases(ax, runs: list[RunRecord]) -> None:
    """Stacked horizontal bars: per run and rank, the mean seconds per tick of each phase and idle."""
    labels, rows = [], []
    for run in runs:
        for lane, phases in run.phase_s_per_tick.items():
            labels.append(f"{run.name}: {lane}" if len(runs) > 1 else lane)
            rows.append(phases)
    left = [0.0] * len(rows)
    for phase, color in PHASE_COLORS.items():
        widths = [row.get(phase, 0.0) for row in rows]
        if any(widths):
            ax.barh(labels, widths, left=left, color=color, label=phase)
            left = [a + b for a, b in zip(left, widths, strict=True)]
    ax.invert_yaxis()
    ax.set(title="where each rank's time goes (mean per training tick)", xlabel="seconds")
    ax.legend(fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=len(PHASE_COLORS))


def draw(runs: list[RunRecord], path: Path, title: str) -> None:
    """Draws the four panels for one or more runs (overlaid) into `path`."""
    import matplotlib.pyplot as plt

    fig = figure(runs, title)
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    tmp.replace(path)


def figure(runs: list[RunRecord], title: str) -> Figure:
    """The four panels for one or more runs (overlaid), under `title` (lines wider than the picture are
    wrapped to fit it)."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on ranks or CI
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=FIGURE_SIZE)
    colors = [f"C{i}" for i in range(len(runs))]
    for run, color in zip(runs, colors, strict=True):
        plot_rewards(axes[0][0], run, color)
        plot_eval(axes[0][1], run, color)
        plot_step_times(axes[1][0], run, color)
    for ax in (axes[0][0], axes[0][1], axes[1][0]):
        if ax.has_data():
            ax.legend(fontsize="small")
    plot_phases(axes[1][1], runs)
    fig.suptitle("\n".join(wrapped for line in title.splitlines() for wrapped in _wrap(line, TITLE_WIDTH_CHARS)))
    fig.tight_layout()  # (makes room above the panels for every line of the title)
    return fig


def write_report(output_dir: Path) -> Path:
    """Draws OUTPUT_DIR/report.png from the run's files and returns its path."""
    run = load_run(output_dir)
    s = run.summary
    title = (
        f"{s.get('task')} {s.get('mode')}: {s.get('steps')} steps, "
        f"{s.get('step_time_s', float('nan')):.1f} s/step, " + _held_out(s)
    )
    memory = memory_line(s)
    if memory:
        title += "\n" + memory
    path = Path(output_dir) / "report.png"
    draw([run], path, title)
    return path


def memory_line(summary: dict[str, Any]) -> str:
    """ "peak memory 11.0 GB (9.1 GB at once): rank 0 trainer 5.8, rank 1 generator 2.1, rank 1 generator
    reward worker x4 0.4, launcher 0.6, 23 helper processes 1.1" from a summary: the sum of per-process
    peaks, the largest PSS of all at once where sampled, and the peaks of the ranks, their engines and
    workers (those of one name together); the helpers (an engine's, the resource tracker, the compilers
    a trainer runs) summed in one figure."""
    processes = summary.get("memory_per_process") or []
    if not processes:
        return ""
    named: dict[str, list[float]] = {}
    helpers = []
    for p in processes:
        if p.get("kind") == "helper":
            helpers.append(p["peak_rss_mb"])
        else:
            named.setdefault(p["process"], []).append(p["peak_rss_mb"])
    parts = [
        f"{label} {sum(peaks) / 1024:.1f}" if len(peaks) == 1 else f"{label} x{len(peaks)} {sum(peaks) / 1024:.1f}"
        for label, peaks in named.items()
    ]
    if helpers:
        parts.append(f"{len(helpers)} helper process{'es' if len(helpers) > 1 else ''} {sum(helpers) / 1024:.1f}")
    at_once = summary.get("peak_pss_mb_total")
    at_once = "" if at_once is None else f" ({at_once / 1024:.1f} GB at once)"
    return f"peak memory {summary['peak_rss_mb_total'] / 1024:.1f} GB{at_once}: " + ", ".join(parts)


def _wrap(line: str, width: int) -> list[str]:
    """`line` in lines of at most `width` characters, broken after its commas where it can (the items of
    a list stay whole)."""
    lines: list[str] = []
    current = ""
    for item in line.split(", "):
        if current and len(current) + 2 + len(item) > width:
            lines.append(current + ",")
            current = item
        else:
            current = f"{current}, {item}" if current else item
    lines.append(current)
    return [short for long in lines for short in textwrap.wrap(long, width)]


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def _held_out(summary: dict) -> str:
    """The title's held-out figure: accuracy where the task has one, else the mean reward."""
    name = "accuracy" if summary.get("eval_accuracy_start") is not None else "reward"
    start, end = summary.get(f"eval_{name}_start"), summary.get(f"eval_{name}_end")
    return f"held-out {'accuracy' if name == 'accuracy' else 'mean reward'} {_fmt(start)} -> {_fmt(end)}"
