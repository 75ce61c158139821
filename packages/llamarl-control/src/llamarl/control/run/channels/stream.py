"""The stream-mode channel: generators send finished groups to the first trainer rank while they sample
the next ones, and every rank reads the run's few shared counters from the launcher's key-value store.

- `StreamControl`: weight syncs announced (every generator takes part in each), the stop, requests for
  the weights again (a replaced engine, a failed sync), pauses (a checkpoint, an evaluation), and
  admission control: the groups started, taken and trained, so that a generator never starts sampling
  a group that would be too stale to train on by the time the trainer takes it (as AReaL bounds the
  versions in flight), and each group's admission ticket: the trainer takes groups in the order they
  were admitted, which is what the bound assumes. Cheap reads, polled between decoding steps.
- `PauseServer`: a rank's part of every pause, each once, in the order the trainer asked for them (every
  side serves pauses through one: generators, reward ranks, trainer ranks).
- `RolloutOutbox`: a generator's sending side; a thread sends while the generator samples on, and a
  full trainer buffer holds the generator back (back-pressure) while it can still take new weights.
  Before a checkpoint it sends a marker after what it queued (`mark`).
- `drain_into_buffer`: the trainer's receiving side of one generator's stream, into the
  `RolloutBuffer` (`llamarl.control.run.channels.buffer`).

Each takes its transport as a small object or callable, so tests run both ends in one process.
"""

from __future__ import annotations

import json
import queue
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from llamarl.control.run.channels.buffer import BufferClosed, RolloutBuffer
from llamarl.control.run.channels.rollouts import CHECKPOINT_MARKER
from llamarl.control.run.schedule import PauseKind, stream_admits
from llamarl.exec.types import RolloutBatch

__all__ = [
    "KeyValueStore",
    "Pause",
    "PauseOrderError",
    "PauseServer",
    "RolloutOutbox",
    "StreamControl",
    "drain_into_buffer",
]


class KeyValueStore(Protocol):
    """The part of torch.distributed.Store that `StreamControl` uses."""

    def set(self, key: str, value: str | bytes) -> None: ...

    def get(self, key: str) -> bytes: ...

    def check(self, keys: list[str]) -> bool: ...

    def add(self, key: str, amount: int) -> int: ...

    def compare_set(self, key: str, expected: str, desired: str) -> bytes: ...

    def delete_key(self, key: str) -> bool: ...


@dataclass(frozen=True)
class Pause:
    """A pause of every rank in stream mode, requested by the trainer after the step that made
    `policy_version`: a checkpoint, or an evaluation inside the loop."""

    number: int  # 1, 2, ... in the order requested
    kind: PauseKind
    policy_version: int


class StreamControl:
    """Counters every rank reads through a key-value store: how many weight syncs the trainer started
    (every generator takes part in each), whether the run is over, how many times a generator asked
    for the current weights again (its engine was replaced, or a sync failed half-way), the pauses
    requested, and the groups admitted, consumed and the batches taken (admission control).
    Generators poll them between decoding steps, so the reads must be cheap."""

    _SYNCS = "stream/syncs_announced"
    _STOP = "stream/stop"
    _WANTED = "stream/weights_wanted"
    _PAUSES = "stream/pauses"
    _ADMITTED = "stream/groups_admitted"  # "<tickets issued> <nonce>": groups admitted, cumulative
    _CONSUMED = "stream/groups_consumed"  # groups the trainer took or dropped as stale, cumulative
    _TAKEN = "stream/batches_taken"  # batches the trainer took: the version the next one trains at
    _TICKET = "stream/ticket"  # + "/<prompt position>": the admission ticket of that prompt's group

    def __init__(self, store: KeyValueStore) -> None:
        self.store = store

    def announce(self) -> int:
        """Trainer: a weight sync starts now; every generator should take part. Returns its number."""
        return self.store.add(self._SYNCS, 1)

    def announced(self) -> int:
        """How many weight syncs were announced (0 before any)."""
        return self.store.add(self._SYNCS, 0)

    def stop(self) -> None:
        self.store.set(self._STOP, "1")

    def want_weights(self) -> None:
        """Generator: a restarted engine holds no synced weights; asks the trainer to send them again."""
        self.store.add(self._WANTED, 1)

    def weights_wanted(self) -> int:
        """How many times generators asked for the current weights again (cumulative)."""
        return self.store.add(self._WANTED, 0)

    def stopped(self) -> bool:
        return self.store.check([self._STOP])

    # pauses ---------------------------------------------------------------------------------------

    def request_pause(self, kind: PauseKind, policy_version: int) -> Pause:
        """Trainer: every generator should pause (between two decoding steps) for `kind`."""
        number = self.store.add(self._PAUSES, 0) + 1
        self.store.set(f"{self._PAUSES}/{number}", json.dumps([kind, policy_version]))
        self.store.add(self._PAUSES, 1)  # after the details: a reader that sees the count finds them
        return Pause(number, kind, policy_version)

    def pauses_requested(self) -> int:
        return self.store.add(self._PAUSES, 0)

    def pause(self, number: int) -> Pause:
        kind, version = json.loads(self.store.get(f"{self._PAUSES}/{number}"))
        return Pause(number, kind, int(version))

    # admission control ----------------------------------------------------------------------------

    def restore_counts(self, counts: dict[str, int]) -> None:
        """Trainer, on resume: the admission counters as a checkpoint saved them (`counts()`)."""
        self.store.set(self._ADMITTED, f"{int(counts[self._ADMITTED])} restored")
        for key in (self._CONSUMED, self._TAKEN):
            self.store.add(key, int(counts[key]) - self.store.add(key, 0))

    def counts(self) -> dict[str, int]:
        """The admission counters (for a checkpoint: every generator is paused, so they hold still)."""
        return {
            self._ADMITTED: self._admitted()[0],
            **{key: self.store.add(key, 0) for key in (self._CONSUMED, self._TAKEN)},
        }

    def _admitted(self) -> tuple[int, str]:
        """(groups admitted so far, the key's value as stored: "" while there is none)."""
        if not self.store.check([self._ADMITTED]):
            return 0, ""
        raw = self.store.get(self._ADMITTED).decode()
        return int(raw.split()[0]), raw

    def admit(
        self,
        groups: int,
        *,
        version: int,
        prompts_per_step: int,
        max_policy_lag: int,
        steps: int | None = None,
    ) -> int | None:
        """Generator: reserves `groups` new groups if the last of them would still be trained within
        `max_policy_lag` of `version` (the weights that would sample its first token), and within the
        run's `steps`; None (and nothing reserved) if not (yet). The rule:
        `llamarl.control.run.schedule.stream_admits`.

        Returns the first of the groups' admission tickets (they are consecutive). Tickets number the
        groups in the order they were admitted, which is the order the trainer takes them in
        (`RolloutBuffer` with `ticket_of`): the rule's promise holds however the generators' groups
        arrive (a group admitted early and finished late would otherwise be overtaken by later ones
        and could go stale: two generators after a restart did that).
        """
        while True:
            admitted, raw = self._admitted()
            # Groups consumed before batches taken: the reverse of `consumed`'s writes (see there).
            ahead = admitted - self.store.add(self._CONSUMED, 0)
            taken = self.store.add(self._TAKEN, 0)
            if not stream_admits(
                taken=taken,
                ahead=ahead,
                groups=groups,
                version=version,
                prompts_per_step=prompts_per_step,
                max_policy_lag=max_policy_lag,
                steps=steps,
            ):
                return None
            # Reserved only if no other generator was admitted since the read (else read again): the
            # nonce makes this generator's value its own, so a swap is never mistaken for another's.
            wanted = f"{admitted + groups} {uuid.uuid4().hex}"
            if self.store.compare_set(self._ADMITTED, raw, wanted) == wanted.encode():
                return admitted

    def label(self, tickets: dict[int, int]) -> None:
        """Generator: the admission ticket of each prompt position's group, for the trainer to read
        when the group arrives (`ticket_of`). Set before the group is sent."""
        for position, ticket in tickets.items():
            self.store.set(f"{self._TICKET}/{position}", str(ticket))

    def ticket_of(self, position: int) -> int:
        """Trainer: the admission ticket of the group of `position` (its label is then removed)."""
        key = f"{self._TICKET}/{position}"
        ticket = int(self.store.get(key))
        self.store.delete_key(key)
        return ticket

    def consumed(self, groups: int) -> None:
        """Trainer: took a batch; `groups` groups left the buffer for it (taken or dropped as stale)."""
        # The batch count first: `admit` reads the groups consumed before the batches taken, so a
        # generator reading between these two writes sees the new count of batches with the old count
        # of groups, which places its groups later than they will be (a refusal, retried). The other
        # order let it see the groups gone but not the batch, place its groups a version early and
        # admit a group that then arrived too stale to train on (a stream run dropped one such group).
        self.store.add(self._TAKEN, 1)
        self.store.add(self._CONSUMED, groups)

    def progress(self) -> int:
        """Batches the trainer took so far (a generator waiting for admission waits on this)."""
        return self.store.add(self._TAKEN, 0)


class PauseOrderError(RuntimeError):
    """A pause served out of the order the trainer requested it in (or twice)."""


class PauseServer:
    """A rank's part of the stream's pauses: each pause served once, in the order requested.

    `serve(pause)` runs this rank's part of a pause (`Side.in_stream_pause`: an evaluation or a
    checkpoint, a collective over every rank). Generators and reward ranks learn of pauses from the
    store (`serve_requested`); the first trainer rank requests each and serves it (`serve`); the other
    trainer ranks plan the same pauses themselves (`serve_next`). Every rank thus takes part in the same
    pauses in the same order, which is what their collectives need.
    """

    def __init__(self, serve: Callable[[Pause], None]) -> None:
        self._serve = serve
        self.served = 0  # the number of the last pause served

    def serve(self, pause: Pause) -> None:
        """Serves `pause`, which must be the one after the last served."""
        if pause.number != self.served + 1:
            raise PauseOrderError(
                f"pause {pause.number} ({pause.kind}) after pause {self.served}: out of order"
            )
        self._serve(pause)
        self.served = pause.number

    def serve_next(self, kind: PauseKind, policy_version: int) -> None:
        """Serves the next pause, planned here (the trainer ranks other than the first)."""
        self.serve(Pause(self.served + 1, kind, policy_version))

    def pending(self, control: StreamControl) -> bool:
        """Whether the trainer requested a pause this rank has not served yet (cheap: one store read)."""
        return control.pauses_requested() > self.served

    def serve_requested(self, control: StreamControl) -> None:
        """Serves every pause the trainer requested and this rank has not served yet, in order."""
        while self.pending(control):
            self.serve(control.pause(self.served + 1))


class RolloutOutbox:
    """A generator's sending side in stream mode: a thread sends finished batches while the generator
    samples the next one. `put` waits while one batch is already queued (back-pressure from a full
    trainer buffer), calling `while_waiting` so the generator can still take new weights meanwhile."""

    def __init__(
        self, send: Callable[[RolloutBatch | object | None, dict[str, float]], None], *, timeout_s: float
    ):
        self._send = send
        self.timeout_s = timeout_s
        self._queue: queue.Queue[tuple[RolloutBatch | object | None, dict[str, float]]] = queue.Queue(
            maxsize=1
        )
        self._error: BaseException | None = None
        self._markers_sent = 0
        self._sent = threading.Condition()
        self._thread = threading.Thread(target=self._loop, name="rollout-outbox", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        """The sending thread.

        consumes:     the batches, markers and end of stream queued (one at a time)
        waits for:    the next one queued; the trainer side's receive of each (the channel's deadline)
        unblocked by: the generator's `put`, `mark`, `close`; the trainer's receiving thread
        """
        while True:
            batch, metrics = self._queue.get()
            try:
                self._send(batch, metrics)
            except BaseException as e:  # re-raised in the generator's thread by put/close/mark
                self._error = e
                with self._sent:
                    self._sent.notify_all()
                return
            if batch is CHECKPOINT_MARKER:
                with self._sent:
                    self._markers_sent += 1
                    self._sent.notify_all()
            if batch is None:
                return

    def mark(self, metrics: dict[str, float]) -> None:
        """Sends a checkpoint marker after everything queued, and waits until it is sent: the trainer
        then holds every batch this generator handed over (its buffer takes them all while paused)."""
        deadline = time.monotonic() + self.timeout_s
        with self._sent:
            target = self._markers_sent + 1
        while True:
            self._raise_error()
            try:
                self._queue.put((CHECKPOINT_MARKER, metrics), timeout=0.05)
                break
            except queue.Full:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the trainer took no rollouts for {self.timeout_s:.0f} s") from None
        with self._sent:
            while self._markers_sent < target:
                self._raise_error()
                if not self._sent.wait(max(0.0, deadline - time.monotonic())):
                    raise TimeoutError("the checkpoint marker was not delivered in time")

    def put(
        self, batch: RolloutBatch, metrics: dict[str, float], *, while_waiting: Callable[[], None]
    ) -> None:
        """Queues `batch` for sending; returns once queued. Raises the sender thread's error."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            self._raise_error()
            try:
                self._queue.put((batch, metrics), timeout=0.05)
                return
            except queue.Full:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the trainer took no rollouts for {self.timeout_s:.0f} s") from None
                while_waiting()

    def close(self, metrics: dict[str, float]) -> None:
        """Sends the end of the stream (with the final totals) after what is queued, and waits for it."""
        self._raise_error()
        self._queue.put((None, metrics), timeout=self.timeout_s)
        self._thread.join(self.timeout_s)
        if self._thread.is_alive():
            raise TimeoutError("the end of the rollout stream was not delivered in time")
        self._raise_error()

    def _raise_error(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"sending rollouts failed: {self._error}") from self._error


def drain_into_buffer(
    buffer: RolloutBuffer,
    receive: Callable[[], tuple[RolloutBatch | None, dict[str, float]]],
    on_metrics: Callable[[dict[str, float]], None],
    *,
    timeout_s: float,
) -> int:
    """Trainer side of one generator's stream: receive batches into `buffer` until its end marker.

    Batches arriving after the buffer closed (the run is over) are received and discarded, so the
    generator's sending thread never blocks; checkpoint markers are counted in the buffer. Returns the
    number of groups discarded.
    """
    discarded = 0
    while True:
        batch, metrics = receive()
        on_metrics(metrics)
        if batch is None:
            return discarded
        if batch is CHECKPOINT_MARKER:
            buffer.note_marker()
            continue
        try:
            buffer.put(batch, timeout_s=timeout_s)
        except BufferClosed:
            discarded += batch.num_sequences // batch.group_size
