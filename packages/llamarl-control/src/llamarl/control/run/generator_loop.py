"""A generator rank's loop: receive weights -> generate and score -> hand over a batch.

`GeneratorLoop` holds no process group: it takes its executors (a `Generator`, a `Rewarder`) and its
prompts as objects, so tests drive it with fakes in one process. In lock step the generator side calls
`make_batch` once per tick; in stream mode `GeneratorStream` (`llamarl.control.run.generator_stream`)
drives it request after request (`sample`), following the trainer's weight syncs as they are announced
(`take_new_weights`) and replacing a dead engine (`replace_engine`); the request in hand (`work`) is
what a checkpoint keeps of the stream.

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
from typing import TextIO

import torch

from llamarl.comm import WeightSyncError
from llamarl.control.config import ScheduleConfig
from llamarl.control.outputs.timeline import Timeline
from llamarl.control.run.channels.rollouts import GENERATOR_TOTALS, PendingBatch, concat_rollouts
from llamarl.control.run.channels.stream import StreamControl
from llamarl.control.run.in_flight import InFlightRequest
from llamarl.control.run.reward_scoring import add_model_rewards
from llamarl.control.run.sampler import EpisodeSetup, Sampled, TaskSampler
from llamarl.control.run.stream_requests import WorkInHand
from llamarl.control.tasks.prompts import PromptSource, PromptStream
from llamarl.exec import EngineError, EngineLost
from llamarl.exec.config import RewardModelConfig, SamplingConfig
from llamarl.exec.reward.model import ModelRewarder
from llamarl.exec.types import GenerationPaused, Generator, Rewarder, RolloutBatch


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
        self.work = WorkInHand()  # stream mode: the request in hand, which a checkpoint saves
        # Stream mode: the announced weight syncs taken part in, and whether a replaced engine is to
        # join the next one (`take_new_weights`).
        self._syncs_taken = 0
        self._rejoining = False

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

    def make_batch(self, tick: int) -> PendingBatch:
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
            batch, dropped, last = self.sample(self.prompts.take_positions(share - len(kept)))
            kept += _groups(batch) if batch is not None else []
            filtered += dropped
            if len(kept) >= share:
                break
        topped_up = filtered[: share - len(kept)]
        self.totals["filtered_total"] -= len(topped_up)  # trained on after all: not filtered
        kept += topped_up
        return PendingBatch(concat_rollouts(kept[:share]), {**last, **self.metrics()})

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

    def sample(
        self,
        positions: list[int],
        between_steps: Callable[[], None] | None = None,
        resume: InFlightRequest | None = None,
    ) -> tuple[RolloutBatch | None, list[RolloutBatch], dict[str, float]]:
        """Generates and scores G completions of each prompt at `positions` of the data order, going on
        from `resume` (a paused request of these prompts) if given.

        Returns (the groups kept as one batch or None, the groups dynamic sampling dropped, metrics).
        Raises GenerationPaused (what was drawn: `resume` extended itself) when `between_steps` paused it.
        """
        G = self.sampling.samples_per_prompt
        indices = [self.prompts.index(p) for p in positions]
        start = time.perf_counter()
        failures_before = self.rewarder.num_failures if self.rewarder is not None else 0
        try:
            sampled = self.sampler.sample(
                indices, samples_per_prompt=G, between_steps=between_steps, resume=resume
            )
        except GenerationPaused:
            paused_s = time.perf_counter() - start
            self.totals["generate_s_total"] += paused_s
            self.totals["busy_s_total"] += paused_s
            raise
        batch = sampled.batch
        generate_s = time.perf_counter() - start - sampled.score_s
        if self.rewarder is not None:
            self.totals["reward_failures_total"] += self.rewarder.num_failures - failures_before
        self.totals["episodes_dropped_total"] += sampled.episodes_dropped
        batch.prompt_position_B = torch.tensor(positions, dtype=torch.int64).repeat_interleave(G)
        score_s = sampled.score_s + self._add_model_rewards(sampled)
        self._log_samples(batch, positions, sampled.texts)
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

    def _add_model_rewards(self, sampled: Sampled) -> float:
        """With the reward model colocated: its scores join the batch's rewards (in place); returns the
        seconds it took (0 without one)."""
        if self.reward_model is None:
            return 0.0
        assert self.reward_model_config is not None
        batch = sampled.batch
        failures_before = self.reward_model.num_failures
        with self.timeline.phase("reward_model", self.tick):
            _, model_s = add_model_rewards(
                batch,
                scorer=self.reward_model,
                config=self.reward_model_config,
                source=self.source,
                index_of=self.prompts.index,
                texts=sampled.texts,
            )
        self.totals["reward_model_s_total"] += model_s
        self.totals["reward_model_samples_total"] += batch.num_sequences
        self.totals["reward_model_failures_total"] += self.reward_model.num_failures - failures_before
        return model_s

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

    # stream mode: following the trainer's weight syncs -------------------------------------------

    def take_new_weights(self, control: StreamControl) -> None:
        """Takes part in every weight sync the trainer announced and this generator has not taken yet,
        one receive each, in order. A generator may be more than one behind: with several generators the
        weights go down a chain and the trainer's send returns once the first one has them, so the
        trainer can train and announce again before a slow one took the last; skipping one would leave
        the generator relaying to this one waiting on it."""
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
                print(f"generator: weight sync failed ({e}); asking for the weights again", file=sys.stderr)
                self.generator.mark_weights_lost()
                control.want_weights()
                return

    def replace_engine(self, error: EngineLost, control: StreamControl) -> None:
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
