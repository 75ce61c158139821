"""A stream trainer rank's intake: where each step's batch comes from, and what the generators hear from
the trainer (weight syncs announced, pauses, the end). `TrainerLoop.stream` takes one (`StreamIntake`).

- `TrainerIntake`, on the first trainer rank: one thread per generator receives its stream into the
  `RolloutBuffer`; `take` hands out the next batch in admission order (relaying each other trainer rank
  its part), answering generators' requests for the weights while it waits; `pause_after` pauses every
  rank after the steps `PausePlan` names (an evaluation, a checkpoint), the buffer holding whatever
  arrives meanwhile, after every generator's marker for a checkpoint; `close` stops the generators,
  discards what still arrives, and counts what became of every group (`StreamCounts`). Its stages:

      READY --open--> OPEN --pause--> PAUSED --resume--> OPEN --close--> CLOSED --every stream ended--> ENDED

  each move checked (an illegal one raises `IntakeStageError`). A checkpoint keeps `state()` (taken
  PAUSED: every generator's marker arrived, nothing is in the channels) and a resumed run puts it back
  (`restore`, READY).
- `RelayedIntake`, on the other trainer ranks: its part of each batch from the first trainer rank; the
  same pauses, planned here.

The transport comes in as callables (`receive` of a generator's next message, `relay`), so tests run
the intake in one process, with no process group.
"""

from __future__ import annotations

import contextlib
import enum
import threading
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

from llamarl.control.run.channels.buffer import RolloutBuffer
from llamarl.control.run.channels.stream import PauseServer, StreamControl, drain_into_buffer
from llamarl.control.run.schedule import PausePlan
from llamarl.control.run.trainer_loop import GeneratorStats
from llamarl.exec.types import RolloutBatch

# One message of a generator's stream: a batch, a checkpoint marker, or None (its end), with its metrics.
Message = tuple[RolloutBatch | object | None, dict[str, float]]


class IntakeStage(enum.Enum):
    """Where the first trainer rank's intake is (see the module doc)."""

    READY = "ready"  # built, perhaps restored from a checkpoint; nothing received yet
    OPEN = "open"  # receiving: one thread per generator puts its groups into the buffer
    PAUSED = "paused"  # every rank pauses (an evaluation, a checkpoint): the buffer holds what arrives
    CLOSED = "closed"  # the last batch is taken: what still arrives is received and discarded
    ENDED = "ended"  # every generator ended its stream: the counts are final


class IntakeStageError(RuntimeError):
    """The intake asked to do what its stage does not allow."""


@dataclass(frozen=True)
class StreamCounts:
    """What became of the groups a stream run's generators sent (its summary's "stream" section)."""

    dropped_stale_groups: int  # older than max_policy_lag when their turn came: never trained on
    received_groups: int
    unused_groups: int  # still in the buffer at the end
    discarded_groups: int  # arrived after the last step: sampled, never trained on
    dropped_stale_frac: float  # of the groups whose turn came

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


class TrainerIntake:
    """The first trainer rank's intake in stream mode (see the module doc).

    Args:
        control: the counters shared with the generators (admission, syncs, pauses, the stop).
        buffer: the rollout buffer, taking groups in admission order (`ticket_of=control.ticket_of`).
        generators: the ranks whose streams arrive here.
        receive: `receive(g)` -> generator g's next message (a batch, `CHECKPOINT_MARKER`, or None at
            its end) with its metrics; called from g's receiving thread.
        stats: where each message's generator totals go.
        relay: `relay(whole)` sends each other trainer rank its part of a batch and returns this rank's
            part (default: this rank trains on the whole batch).
        send_weights: sends the current weights again (a generator asked for them).
        pauses, plan: this rank's pause server, and which pauses follow which step.
        prompts_per_step: groups per batch.
        timeout_s: the deadline of every wait (on a generator, on the buffer).
    """

    def __init__(
        self,
        *,
        control: StreamControl,
        buffer: RolloutBuffer,
        generators: list[int],
        receive: Callable[[int], Message],
        stats: GeneratorStats,
        send_weights: Callable[[], None],
        pauses: PauseServer,
        plan: PausePlan,
        prompts_per_step: int,
        timeout_s: float,
        relay: Callable[[RolloutBatch], RolloutBatch] | None = None,
    ) -> None:
        self.control = control
        self.buffer = buffer
        self.generators = generators
        self._receive = receive
        self.stats = stats
        self._relay = relay
        self._send_weights = send_weights
        self.pauses = pauses
        self.plan = plan
        self.prompts_per_step = prompts_per_step
        self.timeout_s = timeout_s
        self.stage = IntakeStage.READY
        self.discarded = 0  # groups that arrived after the last step
        self._answered = 0  # requests for the weights answered (`StreamControl.weights_wanted`)
        self._threads: list[threading.Thread] = []
        self._errors: list[BaseException] = []  # a receiving thread's failure, raised by the trainer's waits
        self._lock = threading.Lock()

    # the stream, step by step ---------------------------------------------------------------------

    def open(self) -> None:
        """READY -> OPEN: starts receiving every generator's stream."""
        self._move(IntakeStage.OPEN, IntakeStage.READY)
        self._threads = [
            threading.Thread(target=self._drain, args=(g,), name=f"rollouts-from-{g}", daemon=True)
            for g in self.generators
        ]
        for thread in self._threads:
            thread.start()

    def take(self, version: int) -> tuple[RolloutBatch, RolloutBatch]:
        """The next batch for a trainer at `version`: (this rank's part, the whole batch). Waits for the
        groups admitted next (answering requests for the weights meanwhile); drops stale ones."""
        self._expect(IntakeStage.OPEN)
        before = self._consumed()
        with self._drain_errors():
            whole = self.buffer.take(
                self.prompts_per_step,
                current_version=version,
                timeout_s=self.timeout_s,
                on_wait=self.answer_weight_requests,
            )
        self.control.consumed(self._consumed() - before)
        return (whole if self._relay is None else self._relay(whole)), whole

    def figures(self) -> dict[str, float]:
        """The buffer's figures for a step's record."""
        return {
            "stream/dropped_stale_groups": float(self.buffer.counts.dropped_stale),
            "stream/buffered_groups": float(len(self.buffer)),
        }

    def announce(self) -> None:
        """A weight sync starts now: every generator takes part in it."""
        self.control.announce()

    def answer_weight_requests(self) -> None:
        """Sends the current weights again when a generator asked for them (its engine was replaced, or
        a sync failed half-way)."""
        wanted = self.control.weights_wanted()
        if wanted > self._answered:
            self._answered = wanted
            self.control.announce()
            self._send_weights()

    def pause_after(self, version: int) -> None:
        """OPEN -> PAUSED -> OPEN for each pause due after the step that made `version`: every rank
        takes part (`pauses`); for a checkpoint, once every generator's marker arrived."""
        for kind in self.plan.stream_pauses(version):
            self._move(IntakeStage.PAUSED, IntakeStage.OPEN)
            markers = self.buffer.counts.markers + len(self.generators)
            self.buffer.hold(True)  # the generators' sends never wait on a paused trainer
            pause = self.control.request_pause(kind, version)
            if kind == "checkpoint":  # every generator sent all it had: the channel is empty
                with self._drain_errors():
                    # A generator whose engine died asks for weights before it can pause.
                    self.buffer.wait_for_markers(
                        markers, timeout_s=self.timeout_s, on_wait=self.answer_weight_requests
                    )
            self.pauses.serve(pause)
            self.buffer.hold(False)
            self._move(IntakeStage.OPEN, IntakeStage.PAUSED)

    def close(self) -> None:
        """OPEN -> CLOSED -> ENDED: stops the generators, discards what they still send, and waits until
        every stream ended."""
        self._move(IntakeStage.CLOSED, IntakeStage.OPEN)
        self.control.stop()
        self.buffer.close()  # what still arrives is received and discarded until every generator ends
        for thread in self._threads:
            thread.join(self.timeout_s)
            if thread.is_alive():
                raise TimeoutError(f"{thread.name}: a generator did not end its stream in time")
        if self._errors:
            raise self._errors[0]
        self._move(IntakeStage.ENDED, IntakeStage.CLOSED)

    def final_counts(self) -> dict[str, float]:
        """What became of every group the generators sent (ENDED: the counts are final)."""
        self._expect(IntakeStage.ENDED)
        counts = self.buffer.counts
        return StreamCounts(
            dropped_stale_groups=counts.dropped_stale,
            received_groups=counts.received,
            unused_groups=counts.received - counts.taken - counts.dropped_stale,
            discarded_groups=self.discarded,
            dropped_stale_frac=counts.dropped_stale / max(1, counts.taken + counts.dropped_stale),
        ).as_dict()

    # checkpoints ----------------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps: the buffered groups, the admission counters and the groups discarded.
        Taken PAUSED, once every generator's marker arrived: nothing is in the channels, so that is the
        whole of the stream's state on this side."""
        self._expect(IntakeStage.PAUSED)
        return {
            "buffer": self.buffer.state(),
            "admission": self.control.counts(),
            "discarded": self.discarded,
        }

    def restore(self, state: dict[str, Any]) -> None:
        """READY: puts back what `state()` kept (the buffer's groups, the shared counters)."""
        self._expect(IntakeStage.READY)
        self.buffer.restore(state["buffer"])
        self.control.restore_counts(state["admission"])
        self.discarded = int(state["discarded"])

    # inside ---------------------------------------------------------------------------------------

    def _drain(self, generator: int) -> None:
        """A receiving thread: generator `generator`'s stream into the buffer, until its end.

        consumes:     the generator's messages: batches, checkpoint markers, the end of its stream
        waits for:    its next message (the channel's deadline); room in a full buffer (`timeout_s`)
        unblocked by: the generator's outbox sending; the trainer taking a batch, or pausing (`hold`)
        """
        try:
            discarded = drain_into_buffer(
                self.buffer,
                lambda: self._receive(generator),
                lambda metrics: self.stats.update(generator, metrics),
                timeout_s=self.timeout_s,
            )
            with self._lock:
                self.discarded += discarded
        except BaseException as e:  # the trainer's waits raise it, through the closed buffer
            self._errors.append(e)
            self.buffer.close()

    @contextlib.contextmanager
    def _drain_errors(self) -> Iterator[None]:
        """A wait on the buffer that fails because a receiving thread failed raises that thread's error."""
        try:
            yield
        except Exception as e:
            if self._errors:
                raise self._errors[0] from e
            raise

    def _consumed(self) -> int:
        """Groups that left the buffer so far: taken, or dropped as stale."""
        return self.buffer.counts.taken + self.buffer.counts.dropped_stale

    def _expect(self, *allowed: IntakeStage) -> None:
        if self.stage not in allowed:
            raise IntakeStageError(
                f"the intake is {self.stage.value}; expected {' or '.join(a.value for a in allowed)}"
            )

    def _move(self, to: IntakeStage, *allowed: IntakeStage) -> None:
        self._expect(*allowed)
        self.stage = to


class RelayedIntake:
    """A trainer rank other than the first in stream mode: its part of each batch (whole groups) comes
    from the first trainer rank (`receive`); it takes part in the same pauses, which it plans itself."""

    def __init__(self, *, receive: Callable[[], RolloutBatch], pauses: PauseServer, plan: PausePlan) -> None:
        self._receive = receive
        self.pauses = pauses
        self.plan = plan

    def open(self) -> None:
        """Nothing to start: the first trainer rank sends each part."""

    def take(self, version: int) -> tuple[RolloutBatch, RolloutBatch]:
        part = self._receive()
        return part, part

    def figures(self) -> dict[str, float]:
        return {}

    def announce(self) -> None:
        """The first trainer rank announces the syncs."""

    def pause_after(self, version: int) -> None:
        for kind in self.plan.stream_pauses(version):
            self.pauses.serve_next(kind, version)

    def close(self) -> None:
        """The first trainer rank stops the generators."""

    def final_counts(self) -> dict[str, float]:
        return {}

    def state(self) -> None:
        """Nothing of the stream's state lives on this rank (a checkpoint keeps the first rank's)."""

    def restore(self, state: None) -> None:
        """Nothing to put back (see `state`)."""
