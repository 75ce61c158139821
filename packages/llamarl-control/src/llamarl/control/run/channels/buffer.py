"""The trainer's rollout buffer in stream mode: bounded, thread-safe, and bounded in staleness.

Generators put groups (the samples of one prompt) as they finish them; the trainer takes the next
batch of groups whose oldest token is at most `max_policy_lag` policy versions behind its own weights.
Older groups are dropped (and counted) at take time, never trained on. Groups are taken in the order
of their admission tickets (`ticket_of`, from `StreamControl.admit`), not of arrival: admission
control's bound assumes that order, and with several generators a group admitted early can arrive
after later ones. Without `ticket_of` the order is arrival's. A full buffer blocks `put` while the
trainer can take from it: that back-pressure is what stops a generator that runs ahead of the trainer
(admission control, `StreamControl.admit`, keeps it from sampling so far ahead in the first place).

While the run pauses (a checkpoint, an evaluation) the buffer `hold`s everything that arrives, full or
not, so no sender waits on a trainer that is not taking; a checkpoint saves its groups (`state`) once
every generator's marker arrived (`wait_for_markers`), and a resumed run puts them back (`restore`).

Shape legend: B sequences (whole groups), G group size.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from llamarl.control.run.channels.rollouts import concat_rollouts
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
    """A bounded queue of groups between stream generators and the trainer (thread-safe), in admission
    order. `ticket_of` maps a group's prompt position to its admission ticket (None: arrival order)."""

    def __init__(
        self,
        *,
        capacity_groups: int,
        max_policy_lag: int,
        ticket_of: Callable[[int], int] | None = None,
    ) -> None:
        if capacity_groups < 1 or max_policy_lag < 0:
            raise ValueError("capacity_groups must be >= 1 and max_policy_lag >= 0")
        self.capacity_groups = capacity_groups
        self.max_policy_lag = max_policy_lag
        self.ticket_of = ticket_of
        self.counts = BufferCounts()
        self._groups: dict[int, RolloutBatch] = {}  # by ticket
        self._next = 0  # the ticket taken next (the groups consumed so far)
        self._arrivals = 0  # the next arrival's ticket when groups carry none
        self._gone: set[int] = set()  # tickets at or after `_next` of groups dropped as stale
        self._cond = threading.Condition()
        self._closed = False
        self._holding = False  # while the run pauses: puts never wait

    def __len__(self) -> int:
        with self._cond:
            return len(self._groups)

    def put(self, batch: RolloutBatch, *, timeout_s: float) -> None:
        """Adds every group of `batch` [B = k * G], waiting while the buffer is full."""
        G = batch.group_size
        groups = [batch.select(slice(g * G, (g + 1) * G)) for g in range(batch.num_sequences // G)]
        # Read outside the lock: the tickets come from the run's key-value store.
        tickets = (
            None
            if self.ticket_of is None
            else [self.ticket_of(int(group.prompt_position_B[0])) for group in groups]
        )
        deadline = time.monotonic() + timeout_s
        with self._cond:
            for i, group in enumerate(groups):
                # A full buffer holds a put back only while the trainer can take from it: when the
                # group it takes next has not arrived, room would never come (it may be this one, or
                # come from a generator whose send waits behind this one). Admission control bounds the
                # groups in flight, so the buffer still cannot grow without bound.
                while len(self._groups) >= self.capacity_groups and not self._holding and self._takeable():
                    self._wait(deadline, "room in the rollout buffer (the trainer stopped taking)")
                if tickets is None:
                    self._groups[self._arrivals] = group
                    self._arrivals += 1
                else:
                    self._groups[tickets[i]] = group
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
        """The next `num_groups` groups in ticket order not older than `max_policy_lag` versions, as
        one batch.

        Waits until they are there (a group admitted earlier than those here is waited for); drops
        stale groups on the way (counted in `counts`). While waiting, calls `on_wait` every `poll_s`
        seconds without holding the buffer's lock (the trainer answers a restarted generator's request
        for weights there). Returns B = num_groups * G rows.
        """
        deadline = time.monotonic() + timeout_s
        taken: dict[int, RolloutBatch] = {}  # by ticket
        first = self._next
        while True:
            with self._cond:
                while len(taken) < num_groups and self._takeable():
                    ticket = self._next
                    self._next += 1
                    if ticket in self._gone:  # dropped by a take that failed after
                        self._gone.discard(ticket)
                        continue
                    group = self._groups.pop(ticket)
                    self._cond.notify_all()  # room for a waiting put
                    if current_version - int(group.policy_version_B.min()) > self.max_policy_lag:
                        self.counts.dropped_stale += 1
                    else:
                        taken[ticket] = group
                if len(taken) == num_groups:
                    self.counts.taken += len(taken)
                    return concat_rollouts(list(taken.values()))
                wait_until = deadline if on_wait is None else min(deadline, time.monotonic() + poll_s)
                try:
                    what = f"{num_groups - len(taken)} more groups from the generators"
                    if self.ticket_of is not None:
                        what += f" (the next one admitted: ticket {self._next})"
                    self._wait(deadline, what, wait_until)
                except (BufferTimeout, BufferClosed):
                    # Nothing is lost by a take that fails: the groups it holds go back and the next
                    # take starts where this one did; a stale group it dropped stays dropped. (Decided
                    # here, where the wait failed: a clock read before it may still be short of the
                    # deadline that the wait's own reading has passed.)
                    self._gone.update(t for t in range(first, self._next) if t not in taken)
                    self._groups.update(taken)
                    self._next = first
                    raise
            if on_wait is not None:
                on_wait()

    def _takeable(self) -> bool:
        """Whether the ticket taken next is here (or was dropped already): a take can go on."""
        return self._next in self._groups or self._next in self._gone

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

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps: every buffered group by its ticket, in ticket order, the next ticket
        to take, the tickets dropped ahead of it, the counts, and whether groups go in admission order.
        (`llamarl.control.run.legacy_checkpoints` reads the states of older checkpoints.)"""
        with self._cond:
            return {
                "groups": {t: g.state() for t, g in sorted(self._groups.items())},
                "next": self._next,
                "arrivals": self._arrivals,
                "gone": sorted(self._gone),
                "counts": vars(self.counts).copy(),
                "in_admission_order": self.ticket_of is not None,
            }

    def restore(self, state: dict[str, Any]) -> None:
        """Puts back a checkpoint's groups and counts (before anything else is put). A buffer saved in
        arrival order (a checkpoint from before admission tickets) goes on in arrival order."""
        with self._cond:
            self.counts = BufferCounts(**state["counts"])
            self._groups = {int(t): RolloutBatch.from_state(g) for t, g in state["groups"].items()}
            self._next = state["next"]
            self._arrivals = state["arrivals"]
            self._gone = set(state["gone"])
            if not state["in_admission_order"]:
                self.ticket_of = None

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
