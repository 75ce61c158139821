"""A generator rank's loop: receive weights -> generate and score -> hand over a batch.

`GeneratorLoop` holds no process group: it takes its executors (a `Generator`, a `Rewarder`), its
prompts and its outbox as objects, so tests drive it with fakes in one process. In lock step the
generator side calls `make_batch` once per tick; in stream mode `stream` samples back to back, taking
new weights between requests and, where the generator supports it, between decoding steps. It starts a
request only when admission control says its groups will still be fresh enough to train on when the
trainer takes them (`StreamControl.admit`), and it pauses, keeping the request in flight
(`InFlightRequest`), when the trainer asks for a checkpoint or an evaluation.

Generator metrics travel with every batch as cumulative totals (`GENERATOR_TOTALS`); the trainer takes
differences between steps, so nothing is lost when a request yields no batch (all of its groups
filtered) or a batch is dropped as stale.

Shape legend: B sequences, C completion length, G group size.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

import torch

from llamarl.comm import WeightSyncError
from llamarl.control.config import ScheduleConfig
from llamarl.control.outputs.timeline import Timeline
from llamarl.control.run.channels.rollouts import GENERATOR_TOTALS, concat_rollouts
from llamarl.control.run.channels.stream import Pause, RolloutOutbox, StreamControl
from llamarl.control.run.in_flight import InFlightRequest
from llamarl.control.run.reward_scoring import add_model_rewards
from llamarl.control.run.sampler import EpisodeSetup, TaskSampler
from llamarl.control.tasks.prompts import PromptSource, PromptStream
from llamarl.exec import EngineError, EngineLost
from llamarl.exec.config import RewardModelConfig, SamplingConfig
from llamarl.exec.reward.model import ModelRewarder
from llamarl.exec.types import GenerationPaused, Generator, PauseGeneration, Rewarder, RolloutBatch


class StreamStopped(Exception):
    """The trainer finished: a stream generator abandons its request."""


class GeneratorLoop:
    """Receive weights -> generate and score -> hand over a batch, on one generator rank.

    `prompts` says which rows to sample (this generator's share of each step, `prompts.share` per
    request), `source` turns them into token ids and back; `sampling` and `schedule` are the run's
    sections; `episodes` makes each sample a multi-turn episode (`llamarl.control.run.sampler`). Weights
    arrive through the generator itself (`Generator.receive_weights`), waiting at most
    `weights_timeout_s` for the trainer to start a sync.
    """

    def __init__(
        self,
        *,
        generator: Generator,
        rewarder: Rewarder | None,
        prompts: PromptStream,
        source: PromptSource,
        sampling: SamplingConfig,
        schedule: ScheduleConfig,
        weights_timeout_s: float,
        timeline: Timeline,
        sample_log: TextIO | None = None,
        before_request: Callable[[int], None] | None = None,
        trainer_waiting: Callable[[], contextlib.AbstractContextManager[None]] = contextlib.nullcontext,
        replace_engines: bool = False,
        episodes: EpisodeSetup | None = None,
        reward_model: ModelRewarder | None = None,
        reward_model_config: RewardModelConfig | None = None,
    ) -> None:
        self.generator = generator
        # Colocated: the reward model scores in this rank, after the rule rewards, in sequence.
        self.reward_model = reward_model
        self.reward_model_config = reward_model_config
        self.rewarder = rewarder
        self.prompts = prompts
        self.source = source
        self.sampling = sampling
        self.schedule = schedule
        self.weights_timeout_s = weights_timeout_s
        self.timeline = timeline
        self.sample_log = sample_log
        self.before_request = before_request  # stream mode: called with each request's number (faults)
        # Stream mode: held around the first request of a fresh run, which the trainer can only wait
        # for (the generator side borrows the trainer's cores there, `llamarl.control.launch.threads`).
        self.trainer_waiting = trainer_waiting
        self.replace_engines = replace_engines  # stream mode: restart a dead engine instead of failing
        self.sampler = TaskSampler(
            generator=generator,
            rewarder=rewarder,
            source=source,
            sampling=sampling,
            episodes=episodes,
            phase=lambda name: self.timeline.phase(name, self.tick),
        )
        self.totals = dict.fromkeys(GENERATOR_TOTALS, 0.0)
        self._born = time.perf_counter()
        self.tick = -1  # the tick (lock step) or request number (stream) being worked on
        # Stream mode's work in hand, which a checkpoint saves (`stream_state`): the prompts (data-order
        # positions) of the request being sampled, its completions so far if it was paused, and a batch
        # made but not yet handed to the outbox.
        self.request: list[int] | None = None
        self.in_flight: InFlightRequest | None = None
        self.undelivered: tuple[RolloutBatch, dict[str, float]] | None = None
        self.requests = 0  # stream requests started
        # The admission tickets (`StreamControl.admit`) of the groups in hand, by prompt position, and
        # those of filtered groups kept for the next request.
        self.tickets: dict[int, int] = {}
        self.held: list[int] = []

    @property
    def policy_version(self) -> int:
        """The version held; -1 while a restarted engine holds no synced weights."""
        version = self.generator.policy_version
        return -1 if version is None else int(version)

    def receive_weights(self) -> int:
        """Takes the weights the trainer sends now; returns their version."""
        # Not counted as busy: in lock step most of a receive is waiting for the trainer to finish.
        with self.timeline.phase("weight_sync", self.tick):
            return self.generator.receive_weights(self.weights_timeout_s)

    def make_batch(self, tick: int) -> tuple[RolloutBatch, dict[str, float]]:
        """Lock step: this generator's groups for `tick`.

        With dynamic sampling, groups whose rewards are all equal are dropped and further prompts are
        sampled until the share is full, for at most `max_sampling_rounds` generate calls; a share still
        short then is topped up with dropped groups (they carry no advantage under a group baseline).
        """
        self.tick = tick
        share = self.prompts.share
        kept: list[RolloutBatch] = []
        filtered: list[RolloutBatch] = []
        last: dict[str, float] = {}
        for _ in range(self.schedule.max_sampling_rounds if self.schedule.dynamic_sampling else 1):
            batch, dropped, last = self._sample(self.prompts.take_positions(share - len(kept)))
            kept += _groups(batch) if batch is not None else []
            filtered += dropped
            if len(kept) >= share:
                break
        topped_up = filtered[: share - len(kept)]
        self.totals["filtered_total"] -= len(topped_up)  # trained on after all: not filtered
        kept += topped_up
        return concat_rollouts(kept[:share]), {**last, **self.metrics()}

    def restore_totals(self, totals: dict[str, float] | None) -> None:
        """Continues the cumulative counters of a checkpointed run (None: nothing to restore)."""
        if not totals:
            return
        for key in GENERATOR_TOTALS:
            self.totals[key] = float(totals.get(key, 0.0))
        self._born = time.perf_counter() - self.totals["alive_s_total"]

    def metrics(self) -> dict[str, float]:
        """The cumulative totals, plus the version held now."""
        self.totals["alive_s_total"] = time.perf_counter() - self._born
        return {**self.totals, "policy_version": float(self.policy_version)}

    def _sample(
        self, positions: list[int], between_steps: Callable[[], None] | None = None
    ) -> tuple[RolloutBatch | None, list[RolloutBatch], dict[str, float]]:
        """Generates and scores G completions of each prompt at `positions` of the data order,
        continuing `in_flight` (a paused request of these prompts) if there is one.

        Returns (the groups kept as one batch or None, the groups dynamic sampling dropped, metrics).
        Raises GenerationPaused (keeping what was drawn in `in_flight`) when `between_steps` paused it.
        """
        G = self.sampling.samples_per_prompt
        indices = [self.prompts.index(p) for p in positions]
        start = time.perf_counter()
        failures_before = self.rewarder.num_failures if self.rewarder is not None else 0
        try:
            sampled = self.sampler.sample(
                indices, samples_per_prompt=G, between_steps=between_steps, resume=self.in_flight
            )
        except GenerationPaused as paused:
            if self.in_flight is None:
                self.in_flight = InFlightRequest.from_paused(paused)
            paused_s = time.perf_counter() - start
            self.totals["generate_s_total"] += paused_s
            self.totals["busy_s_total"] += paused_s
            raise
        self.in_flight = None
        batch, texts, score_s = sampled.batch, sampled.texts, sampled.score_s
        generate_s = time.perf_counter() - start - score_s
        if self.rewarder is not None:
            self.totals["reward_failures_total"] += self.rewarder.num_failures - failures_before
        self.totals["episodes_dropped_total"] += sampled.episodes_dropped
        batch.prompt_position_B = torch.tensor(positions, dtype=torch.int64).repeat_interleave(G)
        if self.reward_model is not None:
            assert self.reward_model_config is not None
            with self.timeline.phase("reward_model", self.tick):
                _, model_s = add_model_rewards(
                    batch,
                    scorer=self.reward_model,
                    config=self.reward_model_config,
                    source=self.source,
                    index_of=self.prompts.index,
                    texts=texts,
                )
            self.totals["reward_model_s_total"] += model_s
            self.totals["reward_model_samples_total"] += batch.num_sequences
            score_s += model_s
        self._log_samples(batch, positions, texts)
        self.totals["generate_s_total"] += generate_s
        self.totals["busy_s_total"] += generate_s + score_s
        self.totals["groups_total"] += len(positions)
        metrics = {
            "generate_s": generate_s,
            "score_s": score_s,
            "num_completion_tokens": float(batch.num_completion_tokens),
            "reward_mean": float(batch.rewards_B.mean()),
            "turns_mean": sampled.turns_mean,
        }
        if not self.schedule.dynamic_sampling:
            return batch, [], metrics
        keep, drop = [], []
        for group in _groups(batch):
            (keep if float(group.rewards_B.max() - group.rewards_B.min()) > 0 else drop).append(group)
        self.totals["filtered_total"] += len(drop)
        return (concat_rollouts(keep) if keep else None), drop, metrics

    def _log_samples(self, batch: RolloutBatch, positions: list[int], texts: list[str]) -> None:
        if self.sample_log is None:
            return
        G = self.sampling.samples_per_prompt
        for j, text in enumerate(texts):
            record = {
                "tick": self.tick,
                "position": positions[j // G],  # in the data order (trained_groups.jsonl names it too)
                "policy_version": int(batch.policy_version_B[j]),
                "question": self.source.question(self.prompts.index(positions[j // G])),
                "completion": text,
                "reward": float(batch.rewards_B[j]),
            }
            self.sample_log.write(json.dumps(record) + "\n")
        self.sample_log.flush()

    # stream mode --------------------------------------------------------------------------------

    def stream(
        self,
        control: StreamControl,
        outbox: RolloutOutbox,
        *,
        in_flight: bool,
        on_pause: Callable[[Pause], None] = lambda pause: None,
    ) -> int:
        """Samples requests back to back until the trainer stops the run; returns requests started.

        New weights are taken between requests and, with `in_flight`, between decoding steps too (the
        generator must accept `between_steps`); tokens are stamped with the version that sampled them.
        A request starts only once admission control lets its groups in (`StreamControl.admit`). When
        the trainer asks for a pause, the request in flight stops between two decoding steps and
        `on_pause` runs (after the outbox delivered everything queued, for a checkpoint); the request
        then continues where it stopped.
        """
        self._syncs_taken = 0
        self._rejoining = False
        self._pauses_served = 0
        control.label(self.tickets)  # a resumed run's work in hand, into a new store

        def take_new_weights() -> None:
            # Every announced sync, one receive each, in order. A generator may be more than one behind:
            # with several generators the weights go down a chain and the trainer's send returns once
            # the first one has them, so the trainer can train and announce again before a slow one
            # took the last; skipping one would leave the generator relaying to this one waiting on it.
            while self._syncs_taken < control.announced():
                self._syncs_taken += 1
                try:
                    self.receive_weights()
                    if self._rejoining:
                        # A rejoined engine's first receive skips syncs formed before it existed and
                        # gets the next one: whatever was announced up to now is taken.
                        self._rejoining = False
                        self._syncs_taken = max(self._syncs_taken, control.announced())
                except EngineLost:
                    raise  # this generator's own engine died: replaced by the request loop
                except (WeightSyncError, EngineError) as e:  # another engine died during it: ask again
                    if not self.replace_engines:
                        raise
                    print(
                        f"generator: weight sync failed ({e}); asking for the weights again", file=sys.stderr
                    )
                    self.generator.mark_weights_lost()
                    control.want_weights()
                    return

        def serve_pauses() -> None:
            while self._pauses_served < control.pauses_requested():
                pause = control.pause(self._pauses_served + 1)
                with self.timeline.phase(pause.kind, self.tick):
                    if pause.kind == "checkpoint":
                        outbox.mark(self.metrics())  # the trainer's buffer holds all we sent
                    on_pause(pause)
                self._pauses_served = pause.number

        def between_requests() -> None:
            take_new_weights()
            serve_pauses()

        def between_steps() -> None:
            if control.stopped():
                raise StreamStopped
            take_new_weights()
            # Multi-turn episodes are not paused mid-request: the pause waits for the request's end.
            if control.pauses_requested() > self._pauses_served and self.sampler.episodes is None:
                raise PauseGeneration

        starved = 0  # requests in a row whose groups dynamic sampling all dropped
        while True:
            try:
                if control.stopped():  # the trainer announced its last sync before stopping
                    break
                between_requests()
                if self.policy_version < 0:  # no usable weights until the trainer sends them again
                    time.sleep(0.05)
                    continue
                if self.undelivered is None:
                    if self.request is None:
                        # Tickets of groups dynamic sampling filtered are used again first: the trainer
                        # takes groups in ticket order, so it waits for them (no new admission needed).
                        tickets, self.held = self.held, []
                        if not tickets:
                            first = self._admitted(control, between_requests)
                            if first is None:
                                continue
                            tickets = list(range(first, first + self.prompts.share))
                        self.request = self.prompts.take_positions(len(tickets))
                        self.tickets.update(zip(self.request, tickets, strict=True))
                        control.label({p: self.tickets[p] for p in self.request})
                        self.tick = self.requests
                        self.requests += 1
                        if self.before_request is not None:
                            self.before_request(self.tick)
                    alone = self.tick == 0 and self.policy_version == 0
                    try:
                        with self.trainer_waiting() if alone else contextlib.nullcontext():
                            batch, dropped, metrics = self._sample(
                                self.request, between_steps if in_flight else None
                            )
                    except GenerationPaused:
                        continue  # the pause is served at the top of the loop; then the request goes on
                    self.request = None
                    if batch is None:  # every group filtered by dynamic sampling
                        starved += 1
                        if starved < self.schedule.max_sampling_rounds:
                            self._hold_tickets(dropped)  # never sent: the next request uses them
                            continue
                        # As in lock step: after max_sampling_rounds requests without a single group
                        # with a signal, send flat groups rather than starve the trainer.
                        batch = concat_rollouts(dropped)
                        self.totals["filtered_total"] -= len(dropped)  # sent after all
                    else:
                        self._hold_tickets(dropped)
                    starved = 0
                    self.undelivered = (batch, {**metrics, **self.metrics()})
                # Time blocked here on a full trainer buffer counts as idle.
                outbox.put(*self.undelivered, while_waiting=between_requests)
                for position in self.undelivered[0].prompt_position_B[:: self.undelivered[0].group_size]:
                    # Labelled in the store, where the trainer reads them. (None: a request restored
                    # from a checkpoint written before tickets.)
                    self.tickets.pop(int(position), None)
                self.undelivered = None
            except StreamStopped:
                break
            except EngineLost as e:
                # The request (and its completions so far, if it was paused) goes on with a new engine.
                self._replace_engine(e, control)
            except EngineError:
                # A sync that failed in flight aborts the request (take_new_weights already asked for
                # the weights again); anything else is an engine fault that ends the run.
                if not (self.replace_engines and self.policy_version < 0 and self.undelivered is None):
                    raise
        # The stop comes right after the trainer's last sync, but that sync may not have reached this
        # generator yet: with several generators the weights travel down a chain, and the trainer's send
        # returns once the first generator has them. Leaving without it would put this generator one sync
        # behind the others, and the plain sync after the stream would pair its last stream sync with the
        # others' plain one: the generator relaying to it would wait for it forever (the stall of two
        # stream generators under load, found from the stack dumps: one generator in the final sync
        # waiting for the other to post its receives, the other and the trainer already evaluating).
        take_new_weights()
        outbox.close(self.metrics())
        return self.requests

    def _hold_tickets(self, dropped: list[RolloutBatch]) -> None:
        """Keeps the admission tickets of the groups dynamic sampling dropped for the next request."""
        for group in dropped:
            ticket = self.tickets.pop(int(group.prompt_position_B[0]), None)
            if ticket is not None:  # None: a request restored from a checkpoint written before tickets
                self.held.append(ticket)
        self.held.sort()

    def _admitted(self, control: StreamControl, while_waiting: Callable[[], None]) -> int | None:
        """Waits until admission control lets this generator's next request in, serving weights and
        pauses meanwhile; returns the first of its groups' tickets, or None when the run stopped.
        Raises TimeoutError when the trainer took no batch for `weights_timeout_s` while this
        generator waited."""
        progress, since = control.progress(), time.monotonic()
        while (
            first := control.admit(
                self.prompts.share,
                version=self.policy_version,
                prompts_per_step=self.schedule.prompts_per_step,
                max_policy_lag=self.schedule.max_policy_lag,
                steps=self.schedule.steps,
            )
        ) is None:
            if control.stopped():
                return None
            while_waiting()
            if self.policy_version < 0:
                return None  # weights lost meanwhile: the loop waits for them first
            now = time.monotonic()
            if control.progress() != progress:
                progress, since = control.progress(), now
            elif now - since > self.weights_timeout_s:
                raise TimeoutError(
                    f"the trainer took no batch for {self.weights_timeout_s:.0f} s while this generator "
                    "waited to start sampling"
                )
            time.sleep(0.02)
        return first

    def stream_state(self) -> dict[str, Any]:
        """Stream mode's work in hand, for a checkpoint taken while paused: the request being sampled
        (positions) with its completions so far, and a batch made but not yet handed over."""
        undelivered = None
        if self.undelivered is not None:
            batch, metrics = self.undelivered
            undelivered = (batch.tensors(), batch.group_size, metrics)
        return {
            "request": self.request,
            "in_flight": None if self.in_flight is None else self.in_flight.state(),
            "undelivered": undelivered,
            "requests": self.requests,
            "tickets": dict(self.tickets),
            "held": list(self.held),
        }

    def restore_stream_state(self, state: dict[str, Any] | None) -> None:
        if not state:
            return
        self.request = state["request"]
        self.in_flight = (
            None if state["in_flight"] is None else InFlightRequest.from_state(state["in_flight"])
        )
        if state["undelivered"] is not None:
            tensors, group_size, metrics = state["undelivered"]
            self.undelivered = (RolloutBatch(group_size=group_size, **tensors), metrics)
        self.requests = state["requests"]
        self.tick = self.requests - 1  # the request in hand, if any, keeps its number
        self.tickets = {int(p): int(t) for p, t in state.get("tickets", {}).items()}
        self.held = list(state.get("held", []))

    def _replace_engine(self, error: EngineLost, control: StreamControl) -> None:
        """Restarts a dead engine (the trainer keeps its state); the new one gets the current weights."""
        if not (self.generator.can_restart_engine and self.replace_engines):
            raise error
        first_line = str(error).splitlines()[0]
        print(f"generator: {first_line}: restarting the engine", file=sys.stderr, flush=True)
        start = time.perf_counter()
        self.generator.restart_engine()
        self.totals["engine_restarts_total"] += 1
        announced = control.announced()
        if announced == 0:
            self.generator.serve_initial_weights()  # no weights were ever sent: the checkpoint is current
            return
        # The new engine joins the latest announced sync: the trainer may be waiting in it for this
        # rank right now. If that sync is over, the engine's receive waits for the next one, which
        # the trainer sends when asked (a sync it would have sent anyway costs one extra transfer).
        self._syncs_taken = announced - 1
        self._rejoining = True
        control.want_weights()
        seconds = time.perf_counter() - start
        print(f"generator: engine restarted in {seconds:.1f} s", file=sys.stderr, flush=True)


def _groups(batch: RolloutBatch) -> list[RolloutBatch]:
    G = batch.group_size
    return [batch.select(slice(g * G, (g + 1) * G)) for g in range(batch.num_sequences // G)]
