"""A generator rank's loop: receive weights -> generate and score -> hand over a batch.

`GeneratorLoop` holds no process group: it takes its executors (a `Generator`, a `Rewarder`), its
prompts and its outbox as objects, so tests drive it with fakes in one process. In lock step the
generator side calls `make_batch` once per tick; in stream mode `stream` samples back to back, taking
new weights between requests and, where the generator supports it, between decoding steps.

Generator metrics travel with every batch as cumulative totals (`GENERATOR_TOTALS`); the trainer takes
differences between steps, so nothing is lost when a request yields no batch (all of its groups
filtered) or a batch is dropped as stale.

Shape legend: B sequences, C completion length, G group size.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from typing import TextIO

from llamarl.comm import WeightSyncError
from llamarl.control.channels.rollouts import GENERATOR_TOTALS, concat_rollouts
from llamarl.control.channels.stream import RolloutOutbox, StreamControl
from llamarl.control.config import ScheduleConfig
from llamarl.control.prompts import PromptSource, PromptStream
from llamarl.control.sampler import EpisodeSetup, TaskSampler
from llamarl.control.timeline import Timeline
from llamarl.exec import EngineError, EngineLost
from llamarl.exec.config import SamplingConfig
from llamarl.exec.types import Generator, Rewarder, RolloutBatch


class StreamStopped(Exception):
    """The trainer finished: a stream generator abandons its request."""


class GeneratorLoop:
    """Receive weights -> generate and score -> hand over a batch, on one generator rank.

    `prompts` says which rows to sample (this generator's share of each step, `prompts.share` per
    request), `source` turns them into token ids and back; `sampling` and `schedule` are the run's
    sections; `episodes` makes each sample a multi-turn episode (`llamarl.control.sampler`). Weights
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
        replace_engines: bool = False,
        episodes: EpisodeSetup | None = None,
    ) -> None:
        self.generator = generator
        self.rewarder = rewarder
        self.prompts = prompts
        self.source = source
        self.sampling = sampling
        self.schedule = schedule
        self.weights_timeout_s = weights_timeout_s
        self.timeline = timeline
        self.sample_log = sample_log
        self.before_request = before_request  # stream mode: called with each request's number (faults)
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
            batch, dropped, last = self._sample(self.prompts.take(share - len(kept)))
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
        self, indices: list[int], between_steps: Callable[[], None] | None = None
    ) -> tuple[RolloutBatch | None, list[RolloutBatch], dict[str, float]]:
        """Generates and scores G completions of each prompt in `indices`.

        Returns (the groups kept as one batch or None, the groups dynamic sampling dropped, metrics).
        """
        G = self.sampling.samples_per_prompt
        start = time.perf_counter()
        failures_before = self.rewarder.num_failures if self.rewarder is not None else 0
        sampled = self.sampler.sample(indices, samples_per_prompt=G, between_steps=between_steps)
        batch, texts, score_s = sampled.batch, sampled.texts, sampled.score_s
        generate_s = time.perf_counter() - start - score_s
        if self.rewarder is not None:
            self.totals["reward_failures_total"] += self.rewarder.num_failures - failures_before
        self.totals["episodes_dropped_total"] += sampled.episodes_dropped
        self._log_samples(batch, indices, texts)
        self.totals["generate_s_total"] += generate_s
        self.totals["busy_s_total"] += generate_s + score_s
        self.totals["groups_total"] += len(indices)
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

    def _log_samples(self, batch: RolloutBatch, indices: list[int], texts: list[str]) -> None:
        if self.sample_log is None:
            return
        G = self.sampling.samples_per_prompt
        for j, text in enumerate(texts):
            record = {
                "tick": self.tick,
                "policy_version": int(batch.policy_version_B[j]),
                "question": self.source.question(indices[j // G]),
                "completion": text,
                "reward": float(batch.rewards_B[j]),
            }
            self.sample_log.write(json.dumps(record) + "\n")
        self.sample_log.flush()

    # stream mode --------------------------------------------------------------------------------

    def stream(self, control: StreamControl, outbox: RolloutOutbox, *, in_flight: bool) -> int:
        """Samples requests back to back until the trainer stops the run; returns requests made.

        New weights are taken between requests and, with `in_flight`, between decoding steps too (the
        generator must accept `between_steps`); tokens are stamped with the version that sampled them.
        """
        requests = 0
        self._syncs_taken = 0
        self._rejoining = False

        def take_new_weights() -> None:
            announced = control.announced()
            if announced <= self._syncs_taken:
                return
            # One sync at a time: the trainer announces the next only after every generator took this.
            self._syncs_taken = announced
            try:
                self.receive_weights()
                if self._rejoining:
                    # A rejoined engine's first receive skips syncs formed before it existed and gets
                    # the next one: whatever was announced up to now is taken.
                    self._rejoining = False
                    self._syncs_taken = max(self._syncs_taken, control.announced())
            except EngineLost:
                raise  # this generator's own engine died: replaced by the request loop
            except (WeightSyncError, EngineError) as e:  # another engine died during it: ask again
                if not self.replace_engines:
                    raise
                print(f"generator: weight sync failed ({e}); asking for the weights again", file=sys.stderr)
                self.generator.policy_version = None
                control.want_weights()

        def between_steps() -> None:
            if control.stopped():
                raise StreamStopped
            take_new_weights()

        # A request's prompts whose engine died before they were sampled, or a batch whose engine died
        # while it waited to be queued (taking weights): handled again after the engine is replaced.
        retry: list[int] = []
        undelivered: tuple[RolloutBatch, dict[str, float]] | None = None
        starved = 0  # requests in a row whose groups dynamic sampling all dropped
        while True:
            indices: list[int] = []
            try:
                if control.stopped():  # set only once every generator took the final sync
                    break
                take_new_weights()
                if self.policy_version < 0:  # no usable weights until the trainer sends them again
                    time.sleep(0.05)
                    continue
                if undelivered is None:
                    self.tick = requests
                    indices, retry = retry or self.prompts.take(self.prompts.share), []
                    if self.before_request is not None:
                        self.before_request(requests)
                    batch, dropped, metrics = self._sample(indices, between_steps if in_flight else None)
                    requests += 1
                    if batch is None:  # every group filtered by dynamic sampling
                        starved += 1
                        if starved < self.schedule.max_sampling_rounds:
                            continue
                        # As in lock step: after max_sampling_rounds requests without a single group
                        # with a signal, send flat groups rather than starve the trainer.
                        batch = concat_rollouts(dropped)
                        self.totals["filtered_total"] -= len(dropped)  # sent after all
                    starved = 0
                    undelivered = (batch, {**metrics, **self.metrics()})
                # Time blocked here on a full trainer buffer counts as idle.
                outbox.put(*undelivered, while_waiting=take_new_weights)
                undelivered = None
            except StreamStopped:
                break
            except EngineLost as e:
                self._replace_engine(e, control)
                if undelivered is None:
                    retry = indices or retry  # nothing of it reached the trainer: sample it again
            except EngineError:
                # A sync that failed in flight aborts the request (take_new_weights already asked for
                # the weights again); anything else is an engine fault that ends the run.
                if not (self.replace_engines and self.policy_version < 0 and undelivered is None):
                    raise
                retry = indices or retry
        outbox.close(self.metrics())
        return requests

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
            self.generator.policy_version = 0  # no weights were ever sent: the checkpoint is current
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


def _groups(batch: RolloutBatch) -> list[RolloutBatch]:
    G = batch.group_size
    return [batch.select(slice(g * G, (g + 1) * G)) for g in range(batch.num_sequences // G)]
