"""Reading a run's trace.json: the Chrome/Perfetto trace format that `llamarl.control` writes (one
lane per rank, one complete event a phase). The simulator reads the file format only, so that it
installs and runs without torch or the rest of llamarl (the workspace tests hold the reader to what
the controller writes)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class TraceSpan:
    """One measured phase on one rank: wall-clock start and end in seconds."""

    name: str  # the phase: generate, score, train, weight_sync, rollouts, eval, ...
    start: float
    end: float
    tick: int  # the controller tick (stream mode: request or step) it belongs to; -1 outside the loop


def read_chrome_trace(path: Path) -> tuple[dict[int, list[TraceSpan]], dict[int, str]]:
    """The spans and lane names (roles), by rank, of a run's trace.json."""
    spans: dict[int, list[TraceSpan]] = {}
    roles: dict[int, str] = {}
    for event in json.loads(Path(path).read_text())["traceEvents"]:
        if event["ph"] == "X":
            start = event["ts"] / 1e6
            tick = event.get("args", {}).get("tick", -1)
            spans.setdefault(event["pid"], []).append(
                TraceSpan(event["name"], start, start + event["dur"] / 1e6, tick)
            )
        elif event["name"] == "process_name":
            roles[event["pid"]] = event["args"]["name"]
    return spans, roles
