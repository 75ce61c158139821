"""A generator rank in stream mode: request after request, each admitted, sampled and delivered, until the
trainer stops the run.

`GeneratorStream` drives the generator loop's request in hand (`GeneratorLoop.work`, a `WorkInHand`)
through its states: a request starts only when admission control lets its groups in (their groups will
still be fresh enough to train on when the trainer takes them, `StreamControl.admit`); it is sampled,
taking new weights between requests and, where the generator supports it, between decoding steps (each
token stamped with the version that drew it); when the trainer asks for a pause (a checkpoint, an
evaluation) it stops between two decoding steps, the pause is served, and it goes on where it stopped;
its batch goes to the outbox, which sends it to the trainer while the next request samples.

Like the loop it drives, it holds no process group: the store's counters (`StreamControl`) and the
outbox's transport come in as objects, so tests run it in one process.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

from llamarl.control.run.channels.rollouts import PendingBatch, concat_rollouts
from llamarl.control.run.channels.stream import Pause, PauseServer, RolloutOutbox, StreamControl
from llamarl.control.run.generator_loop import GeneratorLoop
from llamarl.control.run.stream_requests import RequestState, StreamRequest
from llamarl.exec import EngineError, EngineLost
from llamarl.exec.types import GenerationPaused, PauseGeneration


class StreamStopped(Exception):
    """The trainer finished: a stream generator abandons its request."""


class GeneratorStream:
    """One generator rank's stream (see the module doc).

    `in_flight`: whether the generator takes new weights (and pauses) between decoding steps;
    `on_pause(pause)`: this rank's part of a pause (after the outbox delivered everything queued, for a
    checkpoint).
    """

    def __init__(
        self,
        loop: GeneratorLoop,
        control: StreamControl,
        outbox: RolloutOutbox,
        *,
        in_flight: bool,
        on_pause: Callable[[Pause], None] = lambda pause: None,
    ) -> None:
        self.loop = loop
        self.work = loop.work
        self.control = control
        self.outbox = outbox
        self.in_flight = in_flight
        self.on_pause = on_pause
        self.pauses = PauseServer(self._serve_pause)
        self.flat_in_a_row = 0  # requests in a row whose groups dynamic sampling all dropped

    def run(self) -> int:
        """Samples requests back to back until the trainer stops the run; returns the requests started.

        consumes:     admission tickets (`StreamControl.admit`), a share of the prompts per request
        waits for:    admission (the trainer taking batches); room in the outbox (the trainer's buffer);
                      each announced weight sync (the trainer's send); the other ranks in each pause
        unblocked by: the trainer's takes, sends and pause requests; its stop
        """
        self.loop.tick = self.work.requests - 1  # the request in hand, if any, keeps its number
        if self.work.request is not None:  # a resumed run's work in hand, into a new store
            self.control.label(self.work.request.tickets)
        while not self.control.stopped():  # the trainer announced its last sync before stopping
            try:
                self._between_requests()
                if self.loop.policy_version < 0:  # no usable weights until the trainer sends them again
                    time.sleep(0.05)
                    continue
                request = self.work.request or self._admit()
                if request is not None:
                    self._advance(request)
            except StreamStopped:
                break
            except EngineLost as e:
                # The request (and its completions so far, if it was paused) goes on with a new engine.
                self.loop.replace_engine(e, self.control)
            except EngineError:
                # A sync that failed in flight interrupts the request (take_new_weights already asked for
                # the weights again); anything else is an engine fault that ends the run.
                if not (self.loop.replace_engines and self.loop.policy_version < 0 and not self._made()):
                    raise
        # The stop comes right after the trainer's last sync, but that sync may not have reached this
        # generator yet: with several generators the weights travel down a chain, and the trainer's send
        # returns once the first generator has them. Leaving without it would put this generator one sync
        # behind the others, and the plain sync after the stream would pair its last stream sync with the
        # others' plain one: the generator relaying to it would wait for it forever (the stall of two
        # stream generators under load, found from the stack dumps: one generator in the final sync
        # waiting for the other to post its receives, the other and the trainer already evaluating).
        self.loop.take_new_weights(self.control)
        self.outbox.close(self.loop.metrics())
        return self.work.requests

    # a request's life -----------------------------------------------------------------------------

    def _admit(self) -> StreamRequest | None:
        """A new request (ADMITTED): under the tickets of groups dynamic sampling dropped, if any (the
        trainer takes groups in ticket order, so it waits for them: no new admission needed), else under
        new tickets once admission control lets them in. None when the run stopped meanwhile."""
        tickets = self.work.take_held()
        if not tickets:
            first = self._wait_for_admission()
            if first is None:
                return None
            tickets = list(range(first, first + self.loop.prompts.share))
        request = self.work.admit(self.loop.prompts.take_positions(len(tickets)), tickets)
        self.control.label(request.tickets)
        self.loop.tick = request.number
        if self.loop.before_request is not None:
            self.loop.before_request(request.number)
        return request

    def _advance(self, request: StreamRequest) -> None:
        """Takes `request` as far as it goes now: sampled (until made, filtered or paused), then, once
        made, delivered."""
        if request.state is not RequestState.MADE:
            self._sample(request)
        if request.state is RequestState.MADE:
            self._deliver(request)

    def _sample(self, request: StreamRequest) -> None:
        """SAMPLING, until the request is MADE, FILTERED or PAUSED (an interrupted one goes back to
        its last pause)."""
        self.work.start()
        alone = request.number == 0 and self.loop.policy_version == 0  # a fresh run's first request
        between_steps = self._between_steps if self.in_flight else None
        try:
            with self.loop.trainer_waiting() if alone else contextlib.nullcontext():
                batch, dropped, metrics = self.loop.sample(
                    request.positions, between_steps, request.in_flight
                )
        except GenerationPaused as paused:
            self.work.pause(paused)  # the pause is served at the top of the loop; then it goes on
            return
        except BaseException:
            self.work.interrupt()
            raise
        if batch is None:  # every group filtered by dynamic sampling
            self.flat_in_a_row += 1
            if self.flat_in_a_row < self.loop.schedule.max_sampling_rounds:
                self.work.filter(dropped=_positions(dropped))  # never sent: the next request uses them
                return
            # As in lock step: after max_sampling_rounds requests without a single group with a
            # signal, send flat groups rather than starve the trainer.
            self.loop.totals["filtered_total"] -= len(dropped)  # sent after all
            batch, dropped = concat_rollouts(dropped), []
        self.flat_in_a_row = 0
        self.work.make(PendingBatch(batch, {**metrics, **self.loop.metrics()}), dropped=_positions(dropped))

    def _deliver(self, request: StreamRequest) -> None:
        """MADE -> DELIVERED once the outbox took the batch. Time blocked here on a full trainer buffer
        counts as idle; weights and pauses are served meanwhile."""
        assert request.made is not None
        self.outbox.put(request.made.batch, request.made.metrics, while_waiting=self._between_requests)
        self.work.deliver()

    def _made(self) -> bool:
        return self.work.request is not None and self.work.request.state is RequestState.MADE

    # between requests and decoding steps ----------------------------------------------------------

    def _between_requests(self) -> None:
        self.loop.take_new_weights(self.control)
        self.pauses.serve_requested(self.control)

    def _between_steps(self) -> None:
        if self.control.stopped():
            raise StreamStopped
        self.loop.take_new_weights(self.control)
        # Multi-turn episodes are not paused mid-request: the pause waits for the request's end.
        if self.pauses.pending(self.control) and self.loop.sampler.episodes is None:
            raise PauseGeneration

    def _serve_pause(self, pause: Pause) -> None:
        with self.loop.timeline.phase(pause.kind, self.loop.tick):
            if pause.kind == "checkpoint":
                self.outbox.mark(self.loop.metrics())  # the trainer's buffer holds all we sent
            self.on_pause(pause)

    def _wait_for_admission(self) -> int | None:
        """Waits until admission control lets this generator's next request in, serving weights and
        pauses meanwhile; returns the first of its groups' tickets, or None when the run stopped or the
        weights were lost meanwhile. Raises TimeoutError when the trainer took no batch for the loop's
        `weights_timeout_s` while this generator waited."""
        schedule, timeout_s = self.loop.schedule, self.loop.weights_timeout_s
        progress, since = self.control.progress(), time.monotonic()
        while (
            first := self.control.admit(
                self.loop.prompts.share,
                version=self.loop.policy_version,
                prompts_per_step=schedule.prompts_per_step,
                max_policy_lag=schedule.max_policy_lag,
                steps=schedule.steps,
            )
        ) is None:
            if self.control.stopped():
                return None
            self._between_requests()
            if self.loop.policy_version < 0:
                return None  # weights lost meanwhile: the loop waits for them first
            now = time.monotonic()
            if self.control.progress() != progress:
                progress, since = self.control.progress(), now
            elif now - since > timeout_s:
                raise TimeoutError(
                    f"the trainer took no batch for {timeout_s:.0f} s while this generator waited to start "
                    "sampling"
                )
            time.sleep(0.02)
        return first


def _positions(groups: list) -> list[int]:
    """The data-order position of each group's prompt."""
    return [int(group.prompt_position_B[0]) for group in groups]
