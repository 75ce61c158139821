"""The trainer's rollout buffer in stream mode: bounded, thread-safe, and bounded in staleness.

Generators put groups (the samples of one prompt) as they finish them; the trainer takes the next
batch of groups whose oldest token is at most `max_policy_lag` policy versions behind its own weights.
Older groups are dropped (and counted) at take time, never trained on. A full buffer blocks `put`:
that back-pressure is what stops a generator that runs ahead of the trainer (admission control,
`StreamControl.admit`, keeps it from sampling so far ahead in the first place).

While the run pauses (a checkpoint, an evaluation) the buffer `hold`s everything that arrives, full or
not, so no sender waits on a trainer that is not taking; a checkpoint saves its groups (`state`) once
every generator's marker arrived (`wait_for_markers`), and a resumed run puts them back (`restore`).

Shape legend: B sequences (whole groups), G group size.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from llamarl.control.channels.rollouts import concat_rollouts
from llamarl.exec.types import RolloutBatch


class BufferTimeout(TimeoutError):
    """A put or take waited past its deadline (no generator delivered, or the trainer stopped taking)."""


class BufferClosed(RuntimeError):
    """The buffer was closed while a put or take waited."""


@dataclass
class BufferCounts:
    """Cumulative group counts of a buffer."""

    received: int = 0  # groups put
    dropped_stale: int = 0  # groups found older than max_policy_lag at take time (never trained on)
    taken: int = 0  # groups handed to the trainer
    markers: int = 0  # checkpoint markers received (one per generator per checkpoint)


class RolloutBuffer:
    """A bounded FIFO of groups between stream generators and the trainer (thread-safe)."""

    def __init__(self, *, capacity_groups: int, max_policy_lag: int) -> None:
        if capacity_groups < 1 or max_policy_lag < 0:
            raise ValueError("capacity_groups must be >= 1 and max_policy_lag >= 0")
        self.capacity_groups = capacity_groups
        self.max_policy_lag = max_policy_lag
        self.counts = BufferCounts()
        self._groups: deque[RolloutBatch] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self._holding = False  # while the run pauses: puts never wait

    def __len__(self) -> int:
        with self._cond:
            return len(self._groups)

    def put(self, batch: RolloutBatch, *, timeout_s: float) -> None:
        """Adds every group of `batch` [B = k * G], waiting while the buffer is full."""
        groups = [
            batch.select(slice(g * batch.group_size, (g + 1) * batch.group_size))
            for g in range(batch.num_sequences // batch.group_size)
        ]
        deadline = time.monotonic() + timeout_s
        with self._cond:
            for group in groups:
                while len(self._groups) >= self.capacity_groups and not self._holding:
                    self._wait(deadline, "room in the rollout buffer (the trainer stopped taking)")
                self._groups.append(group)
                self.counts.received += 1
                self._cond.notify_all()

    def take(
        self,
        num_groups: int,
        *,
        current_version: int,
        timeout_s: float,
        on_wait: Callable[[], None] | None = None,
        poll_s: float = 0.25,
    ) -> RolloutBatch:
        """The oldest `num_groups` groups not older than `max_policy_lag` versions, as one batch.

        Waits until that many are there; drops stale groups on the way (counted in `counts`). While
        waiting, calls `on_wait` every `poll_s` seconds without holding the buffer's lock (the trainer
        answers a restarted generator's request for weights there). Returns B = num_groups * G rows.
        """
        deadline = time.monotonic() + timeout_s
        taken: list[RolloutBatch] = []
        while True:
            with self._cond:
                while len(taken) < num_groups and self._groups:
                    group = self._groups.popleft()
                    self._cond.notify_all()  # room for a waiting put
                    if current_version - int(group.policy_version_B.min()) > self.max_policy_lag:
                        self.counts.dropped_stale += 1
                    else:
                        taken.append(group)
                if len(taken) == num_groups:
                    self.counts.taken += len(taken)
                    return concat_rollouts(taken)
                wait_until = deadline if on_wait is None else min(deadline, time.monotonic() + poll_s)
                try:
                    self._wait(
                        deadline, f"{num_groups - len(taken)} more groups from the generators", wait_until
                    )
                except (BufferTimeout, BufferClosed):
                    # Nothing is lost by a take that fails: the groups it holds go back in front, in
                    # order. (Decided here, where the wait failed: a clock read before it may still be
                    # short of the deadline that the wait's own reading has passed.)
                    self._groups.extendleft(reversed(taken))
                    raise
            if on_wait is not None:
                on_wait()

    def hold(self, holding: bool) -> None:
        """While `holding`, puts never wait for room (the trainer is paused: a checkpoint or an
        evaluation); the buffer may then exceed its capacity by what the generators had already sent."""
        with self._cond:
            self._holding = holding
            self._cond.notify_all()

    def note_marker(self) -> None:
        """A generator's checkpoint marker arrived: every batch it sent before is in the buffer."""
        with self._cond:
            self.counts.markers += 1
            self._cond.notify_all()

    def wait_for_markers(
        self,
        total: int,
        *,
        timeout_s: float,
        on_wait: Callable[[], None] | None = None,
        poll_s: float = 0.25,
    ) -> None:
        """Waits until `total` markers arrived in all (cumulative over the run). While waiting, calls
        `on_wait` every `poll_s` seconds without holding the buffer's lock (as `take`: a generator whose
        engine was replaced must get its weights before it can reach the pause and send its marker)."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._cond:
                if self.counts.markers >= total:
                    return
                wait_until = deadline if on_wait is None else min(deadline, time.monotonic() + poll_s)
                self._wait(
                    deadline, f"{total - self.counts.markers} generators' checkpoint markers", wait_until
                )
                if self.counts.markers >= total:
                    return
            if on_wait is not None:
                on_wait()

    def state(self) -> dict:
        """What a checkpoint keeps: every buffered group's tensors, in order, and the counts."""
        with self._cond:
            return {
                "groups": [(g.tensors(), g.group_size) for g in self._groups],
                "counts": vars(self.counts).copy(),
            }

    def restore(self, state: dict) -> None:
        """Puts back a checkpoint's groups and counts (before anything else is put)."""
        with self._cond:
            self._groups = deque(
                RolloutBatch(group_size=group_size, **tensors) for tensors, group_size in state["groups"]
            )
            self.counts = BufferCounts(**state["counts"])

    def close(self) -> None:
        """Wakes every waiter with BufferClosed; later puts and takes fail at once."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _wait(self, deadline: float, what: str, until: float | None = None) -> None:
        """Waits for a notification until `until` (default: `deadline`); raises past the deadline."""
        if self._closed:
            raise BufferClosed(f"rollout buffer closed while waiting for {what}")
        if time.monotonic() >= deadline:
            raise BufferTimeout(f"waited too long for {what}")
        self._cond.wait(max(0.0, (deadline if until is None else until) - time.monotonic()))
        if self._closed:
            raise BufferClosed(f"rollout buffer closed while waiting for {what}")
