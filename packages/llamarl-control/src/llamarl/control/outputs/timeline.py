"""Per-rank phase timing: what each rank did when, written as a Chrome/Perfetto trace.

Every rank records a span per phase (generate, score, train, weight sync, ...) with wall-clock times,
so the spans of different ranks on one machine line up; the trainer gathers them at the end of the run
and writes `trace.json` (open it in https://ui.perfetto.dev or chrome://tracing): one lane per rank, one
box per phase, which shows at a glance whether generation and training overlap.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol


@dataclass(frozen=True)
class Span:
    """One phase on one rank: wall-clock start and end in seconds since the epoch."""

    name: str  # the phase: generate, score, train, weight_sync, rollouts, eval, ...
    start: float
    end: float
    tick: int  # the controller tick it belongs to (-1: outside the training loop)


class PhaseObserver(Protocol):
    """What a timeline tells of each phase as it runs (`llamarl.control.launch.progress.ProgressMark`)."""

    def enter(self, phase: str, tick: int) -> None: ...

    def leave(self) -> None: ...


class Timeline:
    """The spans one rank recorded, in the order they ended.

    Times are wall-clock seconds read through the monotonic clock (`now`): the ranks of one machine line
    up (each starts from time.time()), and no duration moves with an adjustment of the wall clock, so
    the controller measures its step times with the same readings as the spans it records.
    """

    def __init__(self, observer: PhaseObserver | None = None) -> None:
        self.spans: list[Span] = []
        self._offset = time.time() - time.perf_counter()
        self.observer = observer  # told of every phase entered and left (a rank's progress mark)

    def now(self) -> float:
        """The timeline's clock: wall-clock seconds since the epoch, advancing monotonically."""
        return self._offset + time.perf_counter()

    @contextlib.contextmanager
    def phase(self, name: str, tick: int = -1) -> Iterator[None]:
        """Records the time spent in the `with` block as a span named `name`."""
        start = self.now()
        if self.observer is not None:
            self.observer.enter(name, tick)
        try:
            yield
        finally:
            self.spans.append(Span(name, start, self.now(), tick))
            if self.observer is not None:
                self.observer.leave()

    def last(self, name: str) -> Span:
        """The span named `name` that ended last."""
        return next(s for s in reversed(self.spans) if s.name == name)


def write_chrome_trace(path: Path, spans_by_rank: list[list[Span]], roles: list[str]) -> None:
    """Writes the spans of every rank as a Chrome trace: a process lane per rank named by its role.

    Args:
        path: the file to write (trace.json).
        spans_by_rank: spans_by_rank[r] holds rank r's spans.
        roles: roles[r] names rank r ("trainer", "generator 1", ...).
    """
    origin = min((s.start for spans in spans_by_rank for s in spans), default=0.0)
    events: list[dict] = []
    for rank, (spans, role) in enumerate(zip(spans_by_rank, roles, strict=True)):
        events.append(
            {"ph": "M", "name": "process_name", "pid": rank, "args": {"name": f"rank {rank} {role}"}}
        )
        events.append({"ph": "M", "name": "process_sort_index", "pid": rank, "args": {"sort_index": rank}})
        events.extend(
            {
                "ph": "X",
                "name": span.name,
                "cat": "phase",
                "pid": rank,
                "tid": 0,
                "ts": (span.start - origin) * 1e6,  # microseconds, as the trace format wants
                "dur": (span.end - span.start) * 1e6,
                "args": {"tick": span.tick},
            }
            for span in spans
        )
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    tmp.replace(path)


def read_chrome_trace(path: Path) -> tuple[dict[int, list[Span]], dict[int, str]]:
    """The spans and lane names, by rank, of a trace written by `write_chrome_trace`."""
    spans: dict[int, list[Span]] = {}
    roles: dict[int, str] = {}
    for e in json.loads(path.read_text())["traceEvents"]:
        if e["ph"] == "X":
            start = e["ts"] / 1e6
            tick = e.get("args", {}).get("tick", -1)
            spans.setdefault(e["pid"], []).append(Span(e["name"], start, start + e["dur"] / 1e6, tick))
        elif e["name"] == "process_name":
            roles[e["pid"]] = e["args"]["name"]
    return spans, roles


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Disjoint, sorted intervals covering the same time as `intervals`."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def overlap_fraction(spans: list[Span], others: list[Span]) -> float:
    """The fraction of the time in `spans` during which some span of `others` ran too (nan when
    `spans` take no time): e.g. how much of the reward ranks' scoring happened while generators
    generated."""
    mine, theirs = _union([(s.start, s.end) for s in spans]), _union([(s.start, s.end) for s in others])
    total = sum(end - start for start, end in mine)
    if total <= 0:
        return float("nan")
    shared, j = 0.0, 0
    for start, end in mine:
        while j < len(theirs) and theirs[j][1] <= start:
            j += 1
        k = j
        while k < len(theirs) and theirs[k][0] < end:
            shared += min(end, theirs[k][1]) - max(start, theirs[k][0])
            k += 1
    return shared / total
