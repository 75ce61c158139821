"""What a finished run measured, read from its output folder (summary.json, metrics.jsonl, trace.json
and samples.rank*.jsonl), per step and per phase.

- Phase seconds come from the trace: each rank's `generate`, `score` and `train` boxes by tick; a
  weight sync or rollout transfer from the matching boxes of every rank (each box includes its
  rank's wait for the others, so the transfer runs from the last start to the first end).
- Completion lengths: each step's completion tokens (metrics.jsonl) shared over its samples in
  proportion to their characters (samples files), so every sample has a length in tokens; the longest
  one in a generator's share sets how many decoding steps a batched `generate` call makes.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from llamarl.sim.trace import TraceSpan as Span
from llamarl.sim.trace import read_chrome_trace


class RunReadError(ValueError):
    """An output folder that lacks what the simulator needs (the message says what)."""


@dataclass
class MeasuredRun:
    """One run's measured phases. Batches are indexed by the tick (lock step) or request that made them."""

    path: Path
    mode: str
    model: str
    steps: int
    num_trainers: int
    num_generators: int
    step_time_s: float  # summary.json: mean over steps after the first
    step_times: list[float]  # metrics.jsonl: time/step_s of every step (nan for the first)
    generate_s: dict[int, dict[int, float]]  # batch -> generator index -> seconds
    score_s: dict[int, dict[int, float]]
    train_s: dict[int, float]  # optimizer step -> seconds
    weight_sync_s: list[float]  # every sync, once all ranks had joined
    move_s: list[float]  # every transfer of rollouts, once all ranks had joined
    lengths: dict[int, list[int]] = field(default_factory=dict)  # batch -> tokens of each sample
    samples_per_prompt: int = 1
    prompts_per_step: int = 1

    @property
    def lockstep(self) -> bool:
        return self.mode in ("sync", "async")

    def generate_total_s(self, batch: int) -> float:
        """The batch's generation time: its slowest generator."""
        return max(self.generate_s[batch].values())

    def describe(self) -> str:
        return (
            f"{self.path} ({self.mode}, {self.num_trainers} trainer + {self.num_generators} generator "
            f"ranks, {self.steps} steps of {self.prompts_per_step} prompts x {self.samples_per_prompt} "
            f"samples; step {self.step_time_s:.2f} s)"
        )


def read_run(path: Path, max_new_tokens: int | None = None) -> MeasuredRun:
    """Reads a finished run's output folder; `max_new_tokens` (the run's limit, when known) caps the
    estimated completion lengths."""
    path = Path(path)
    summary_path = path / "summary.json"
    if not summary_path.is_file():
        raise RunReadError(f"{path}: no summary.json (not a finished run's output folder)")
    summary = json.loads(summary_path.read_text())
    records = _metrics(path / "metrics.jsonl")
    if not (path / "trace.json").is_file():
        raise RunReadError(f"{path}: no trace.json (the phase times come from it)")
    spans, roles = read_chrome_trace(path / "trace.json")
    trainer_rank = min(r for r, role in roles.items() if "trainer" in role)
    generator_ranks = sorted(r for r, role in roles.items() if "generator" in role)
    generate: dict[int, dict[int, float]] = {}
    score: dict[int, dict[int, float]] = {}
    for g, rank in enumerate(generator_ranks):
        for span in spans.get(rank, []):
            if span.tick < 0:
                continue  # evaluation outside the loop
            if span.name in ("generate", "score"):
                into = generate if span.name == "generate" else score
                into.setdefault(span.tick, {})[g] = (
                    into.get(span.tick, {}).get(g, 0.0) + span.end - span.start
                )
    train = {
        i: s.end - s.start for i, s in enumerate(x for x in spans.get(trainer_rank, []) if x.name == "train")
    }
    lockstep = str(summary["mode"]) in ("sync", "async")
    ranks = [trainer_rank, *generator_ranks]
    move = _transfers(spans, ranks, "rollouts", both_sides=lockstep)
    sync = _transfers(spans, ranks, "weight_sync", both_sides=lockstep)
    if not generate or not train:
        raise RunReadError(f"{path}: the trace has no generate or train boxes")
    run = MeasuredRun(
        path=path,
        mode=str(summary["mode"]),
        model=str(summary.get("model", "")),
        steps=int(summary["steps"]),
        num_trainers=int(summary.get("num_trainers", 1)),
        num_generators=int(summary.get("num_generators", len(generator_ranks))),
        step_time_s=float(summary["step_time_s"]),
        step_times=[float(r.get("time/step_s", math.nan)) for r in records],
        generate_s=generate,
        score_s=score,
        train_s=train,
        weight_sync_s=sync,
        move_s=move,
    )
    _read_lengths(run, records, max_new_tokens)
    return run


def _transfers(spans: dict[int, list[Span]], ranks: list[int], name: str, *, both_sides: bool) -> list[float]:
    """Seconds of each collective `name` (rollout move, weight sync) once every rank had joined.

    Each rank's box also holds its wait for the others; in lock step the k-th box of a tick on every
    rank is the same collective, so the transfer is from the last start to the first end. Stream
    mode's boxes do not pair up: the trainer's boxes are taken whole (an upper bound).
    """
    by_rank: list[dict[tuple[int, int], Span]] = []
    for rank in ranks if both_sides else ranks[:1]:
        seen: dict[int, int] = {}
        boxes = {}
        for span in spans.get(rank, []):
            if span.name == name and span.tick >= 0:
                k = seen.get(span.tick, 0)
                seen[span.tick] = k + 1
                boxes[(span.tick, k)] = span
        by_rank.append(boxes)
    out = []
    for key in sorted(by_rank[0]):
        group = [boxes[key] for boxes in by_rank if key in boxes]
        if len(group) == len(by_rank):
            out.append(max(0.0, min(s.end for s in group) - max(s.start for s in group)))
    return out


def _metrics(path: Path) -> list[dict[str, float]]:
    """The training records of metrics.jsonl (evaluation records left out)."""
    if not path.is_file():
        raise RunReadError(f"{path}: missing (per-step tokens come from it)")
    out = []
    for line in path.read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            if "time/train_s" in record:
                out.append(record)
    return out


def _read_lengths(run: MeasuredRun, records: list[dict[str, float]], cap: int | None) -> None:
    """Token lengths of every sample, by batch, in prompt order across generators (see module doc)."""
    texts: dict[int, list[str]] = {}
    questions: dict[int, list[str]] = {}
    for rank_file in sorted(run.path.glob("samples.rank*.jsonl"), key=lambda p: int(p.stem.split("rank")[1])):
        for line in rank_file.read_text().splitlines():
            if not line.strip():
                continue
            sample = json.loads(line)
            texts.setdefault(int(sample["tick"]), []).append(sample["completion"])
            questions.setdefault(int(sample["tick"]), []).append(sample["question"])
    if not texts:
        return
    first = questions[min(questions)]
    run.samples_per_prompt = next((i for i, q in enumerate(first) if q != first[0]), len(first))
    groups = [float(g) for r in records if (g := r.get("sampling/groups")) is not None and g == g]
    run.prompts_per_step = int(statistics.median(groups)) if groups else len(first) // run.samples_per_prompt
    # Each trained step's completion tokens (lock step: batch t is step t), shared by characters.
    totals = {
        step: float(record["train/num_completion_tokens"])
        for step, record in enumerate(records)
        if run.lockstep and texts.get(step)
    }
    per_char = [totals[b] / max(sum(len(t) for t in texts[b]), 1) for b in totals]
    if not per_char:  # stream: requests are not steps; use the run's overall tokens per character
        tokens = sum(float(r["train/num_completion_tokens"]) for r in records)
        rows = run.steps * run.prompts_per_step * run.samples_per_prompt
        chars = sum(len(t) for ts in texts.values() for t in ts) / max(sum(map(len, texts.values())), 1)
        per_char = [tokens / rows / max(chars, 1e-9)]
    default = statistics.median(per_char)
    for batch, batch_texts in texts.items():
        chars = [len(t) for t in batch_texts]
        total = totals.get(batch, default * sum(chars))
        run.lengths[batch] = share_tokens(chars, total, cap)


def share_tokens(chars: list[int], total: float, cap: int | None) -> list[int]:
    """`total` tokens shared over samples in proportion to their characters, none above `cap` (what a
    capped sample cannot take goes to the others)."""
    if not chars:
        return []
    cap_f = math.inf if cap is None else float(cap)

    def given(rate: float) -> float:
        return sum(min(cap_f, max(1.0, c * rate)) for c in chars)

    lo, hi = 0.0, max(total, 1.0) / max(min(c for c in chars if c) if any(chars) else 1, 1) + 1.0
    while given(hi) < total and given(hi) < len(chars) * cap_f and hi < 1e9:
        hi *= 2
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if given(mid) < total else (lo, mid)
    return [max(1, round(min(cap_f, c * hi))) for c in chars]
