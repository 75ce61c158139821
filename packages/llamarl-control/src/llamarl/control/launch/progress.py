"""Which rank stopped making progress, when a run ends because a wait on another process timed out.

A rank that stops without dying (stopped, deadlocked, stuck in a kernel) is caught by the deadline on
the waits of the others (`launch.timeout_s`), but the rank that gives up first is one that waited, not
the one that stalled. So every rank marks its progress as its main thread makes it: each phase it enters
and leaves (generate, train, rollouts, weight_sync, ...) and the heartbeats of long phases (an
evaluation's decoding steps). A thread's heartbeat is not progress: only the main thread writes marks.

The mark is a few bytes in a file of the run's `errors/` folder (`rank{r}.progress`), written in place
through a memory map (no system call per mark). When a run fails on a timeout, the launcher reads every
rank's mark: the rank at work (not in a phase that waits on others) whose mark is the oldest is the one
the others waited for, and the run's one line names it, its role, what it was last doing and for how
long. A rank that ends cleanly removes its file.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path

from llamarl.control.config import RunConfig

_MARK = struct.Struct("<dq32s")  # wall-clock time of the mark, tick, the phase (or "after PHASE")
WAITING_PHASES = frozenset({"rollouts", "weight_sync"})
"""Phases in which a rank waits on another rank (a receive, a sync); in an evaluation the ranks that do
not generate wait too (`is_waiting`)."""
STALL_FRACTION = 0.5  # of launch.timeout_s: a rank at work this long without a mark is the stalled one


def progress_path(errors_dir: str | os.PathLike[str], rank: int) -> Path:
    return Path(errors_dir, f"rank{rank}.progress")


class ProgressMark:
    """This rank's mark: `enter(phase, tick)` and `leave()` around each phase, `beat()` inside long ones.
    Only the main thread calls them. Marks go nowhere where the file cannot be made (a read-only folder)."""

    def __init__(self, path: str | os.PathLike[str] | None) -> None:
        self.path = None if path is None else Path(path)
        self._map: mmap.mmap | None = None
        self._stack: list[tuple[str, int]] = []
        self._current = ("", -1)  # what the mark says: the phase (or "after PHASE") and its tick
        if self.path is not None:
            with contextlib.suppress(OSError):
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
                try:
                    os.ftruncate(fd, _MARK.size)
                    self._map = mmap.mmap(fd, _MARK.size)
                finally:
                    os.close(fd)
        self._write("", -1)

    def enter(self, phase: str, tick: int) -> None:
        self._stack.append((phase, tick))
        self._write(phase, tick)

    def leave(self) -> None:
        """Leaves the innermost phase: back in the enclosing one, or between phases ("after PHASE"),
        progress made."""
        left = self._stack.pop() if self._stack else ("", -1)
        phase, tick = self._stack[-1] if self._stack else (f"after {left[0]}", left[1])
        self._write(phase, tick)

    def beat(self) -> None:
        """Progress inside the current phase (a decoding step of a long evaluation)."""
        self._write(*self._current)

    def close(self) -> None:
        """A rank that ends cleanly leaves no mark behind."""
        if self._map is not None:
            self._map.close()
            self._map = None
        if self.path is not None:
            with contextlib.suppress(OSError):
                self.path.unlink()

    def _write(self, phase: str, tick: int) -> None:
        self._current = (phase, tick)
        if self._map is not None:
            _MARK.pack_into(self._map, 0, time.time(), tick, phase.encode()[:32])


@dataclass(frozen=True)
class Progress:
    """A rank's last mark, as read back."""

    rank: int
    time: float
    tick: int
    phase: str  # the phase it was in, or "after PHASE" between phases ("" before the first)

    def is_waiting(self, config: RunConfig) -> bool:
        """Whether the rank was waiting on another rank (not at work) at its mark."""
        if self.phase in WAITING_PHASES:
            return True
        return self.phase == "eval" and config.role_of(self.rank) != "generator"

    def doing(self) -> str:
        what = self.phase or "starting"
        return what if self.tick < 0 else f"{what}, tick {self.tick}"


def read_progress(errors_dir: str | os.PathLike[str]) -> dict[int, Progress]:
    """Every rank's last mark in `errors_dir`, by rank."""
    marks = {}
    for path in Path(errors_dir).glob("rank*.progress"):
        with contextlib.suppress(OSError, ValueError, struct.error):
            when, tick, phase = _MARK.unpack(path.read_bytes()[: _MARK.size])
            rank = int(path.stem.removeprefix("rank"))
            marks[rank] = Progress(rank, when, tick, phase.rstrip(b"\0").decode(errors="replace"))
    return marks


def stalled_rank(marks: dict[int, Progress], config: RunConfig, *, now: float) -> Progress | None:
    """The rank the others waited for: of the ranks at work, the one whose mark is oldest, if it is at
    least `STALL_FRACTION` of `launch.timeout_s` old; None when no rank at work stood still that long."""
    working = [m for m in marks.values() if not m.is_waiting(config)]
    if not working:
        return None
    oldest = min(working, key=lambda m: m.time)
    return oldest if now - oldest.time >= STALL_FRACTION * config.launch.timeout_s else None


def describe_stall(mark: Progress, config: RunConfig, *, now: float, gave_up: int) -> str:
    """One line: which rank stopped making progress, and who gave up waiting for it."""
    return (
        f"rank {mark.rank} ({config.role_of(mark.rank)}) made no progress for {now - mark.time:.0f} s "
        f"(last: {mark.doing()}); rank {gave_up} gave up waiting for it after launch.timeout_s "
        f"({config.launch.timeout_s:g} s)"
    )
