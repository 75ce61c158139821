"""Fault injection for the fault-tolerance tests: a rank that raises or is killed at a chosen point.

`LLAMARL_FAULT` holds one fault:

- "RANK:TICK" raises on that rank at the start of that tick (tick -1: before the first evaluation);
- "RANK:TICK:kill" kills it there instead (SIGKILL: no cleanup, as the out-of-memory killer does);
- "RANK:TICK:node" kills its whole machine there: SIGKILL to its process group, which is the launcher
  and every rank it started when the launcher leads a group of its own (as a shell job or a test's
  `start_new_session` child does);
- "RANK:TICK:hang" makes its main thread wait forever there: the rank stays alive (its threads, their
  heartbeats, its signal handlers) and makes no progress, as a deadlocked rank does;
- "RANK:TICK:oom" makes it allocate memory until the kernel's out-of-memory killer kills it (for tests
  that run the app under a memory limit; without one it gives up at 8 GiB and raises);
- a last ":checkpoint" strikes inside that tick's checkpoint write, after the rank wrote its part and
  before the commit;
- "RANK:N:engine" kills (SIGKILL) that generator rank's vLLM engine half a second into its stream
  request N; the rank itself lives on.

In stream mode a tick is a step on the trainer ranks (the step that makes version TICK + 1; its
checkpoint is written at the end of it) and a request number on a generator rank.

Faults strike in the first attempt only, never after torch elastic restarted the ranks: the restarted run
must get past the point where the first attempt failed.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

FAULT_ENV = "LLAMARL_FAULT"
ERRORS_DIR = "errors"  # OUTPUT_DIR/errors: each failed rank's record, and the injected fault's marker

Phase = Literal["tick", "checkpoint", "request"]


@dataclass(frozen=True)
class Fault:
    rank: int
    tick: int  # the tick, or the stream request number of an engine fault
    kill: bool  # SIGKILL instead of an exception
    phase: Phase
    node: bool = False  # SIGKILL to the rank's whole process group (its machine's launcher and ranks)
    oom: bool = False  # allocate until the out-of-memory killer strikes
    hang: bool = False  # the main thread waits forever (alive, no progress)

    @classmethod
    def parse(cls, spec: str) -> Fault:
        """A fault from "RANK:TICK[:kill|:node|:oom][:checkpoint]" or "RANK:REQUEST:engine"."""
        parts = spec.split(":")
        try:
            rank, tick = int(parts[0]), int(parts[1])
        except (IndexError, ValueError):
            raise ValueError(
                f"{FAULT_ENV}={spec!r}: expected RANK:TICK[:kill|:node|:oom|:hang][:checkpoint] or "
                "RANK:N:engine"
            ) from None
        flags = set(parts[2:])
        phase: Phase = "checkpoint" if "checkpoint" in flags else "request" if "engine" in flags else "tick"
        return cls(
            rank,
            tick,
            "kill" in flags or "node" in flags,
            phase,
            node="node" in flags,
            oom="oom" in flags,
            hang="hang" in flags,
        )


class FaultInjector:
    """This rank's fault, if `LLAMARL_FAULT` names it; `strike` is called at every point a fault may hit."""

    def __init__(self, rank: int, output_dir: Path, spec: str | None = None) -> None:
        spec = os.environ.get(FAULT_ENV) if spec is None else spec
        fault = Fault.parse(spec) if spec else None
        restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
        self.fault = fault if fault is not None and fault.rank == rank and not restarted else None
        self.rank = rank
        self.output_dir = output_dir

    def strike(
        self, tick: int, phase: Phase = "tick", *, engine_pid: Callable[[], int | None] | None = None
    ) -> None:
        """Raises, kills this rank, or kills its engine, when the fault is for this tick and phase."""
        fault = self.fault
        if fault is None or (fault.tick, fault.phase) != (tick, phase):
            return
        if phase == "request":  # the engine dies in the middle of this request; the rank lives on
            pid = engine_pid() if engine_pid is not None else None
            if pid is None:
                raise ValueError(
                    f"{FAULT_ENV}: the engine fault needs a generator with an engine (--generator vllm)"
                )
            threading.Timer(0.5, os.kill, args=(pid, signal.SIGKILL)).start()
            self.fault = None
            return
        # Tests measure how long the run takes to end after the fault, so record when it struck.
        marker = {"rank": self.rank, "tick": tick, "phase": phase, "time": time.time()}
        (self.output_dir / ERRORS_DIR / "injected_fault.json").write_text(json.dumps(marker))
        if fault.node:
            os.killpg(os.getpgid(0), signal.SIGKILL)
        if fault.kill:
            os.kill(os.getpid(), signal.SIGKILL)
        if fault.oom:
            _allocate_until_killed()
        if fault.hang:
            while True:  # a signal (the launcher stopping the run) still ends it, as it would a deadlock
                time.sleep(3600)
        raise RuntimeError(f"injected failure on rank {self.rank} at tick {tick}, {phase} ({FAULT_ENV})")


def _allocate_until_killed(limit_gib: int = 8) -> None:
    """Touches 64 MiB after 64 MiB of memory until the kernel kills this process; raises past the limit."""
    held = []
    for _ in range(limit_gib * 16):
        held.append(b"\x01" * (64 << 20))  # written, so resident: bytes(n) alone may stay unbacked
    raise MemoryError(
        f"{FAULT_ENV}: allocated {limit_gib} GiB and no out-of-memory kill came (no memory limit?)"
    )
