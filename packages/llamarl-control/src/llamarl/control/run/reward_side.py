"""The reward side of a run: ranks N+G..N+G+R-1, each with a reward model (a sequence classifier or an
LLM judge, `llamarl.exec.reward.model`) on its own device and in its own precision.

Generators score their samples with the task's rule rewards and hand each batch to their reward rank
(generator g goes to reward rank g mod R), which adds the model's score (weighted, `reward_model`) and
forwards the batch to the first trainer rank. The generator does not wait for the score: once the reward
rank has its batch it samples the next one while the reward rank scores.

    lock step, tick t:   generator:  ... generate t ─▶ hand to reward ─▶ next tick (weights, generate t+1)
                         reward:     receive t ─▶ score t (the trainer trains on t-1 meanwhile in async)
                                     move_rollouts(t): forward t ─▶ trainer
    stream:              one thread per generator: receive ─▶ score ─▶ forward, until its stream ends

The reward model's weights are its own: a reward rank never joins the weight channel. Every wait has the
launch deadline (the default group's and the stream group's timeout); a reward rank that dies fails the
run (its peers' receives fail, and the launcher names the rank that died).
"""

from __future__ import annotations

import json
import threading
from typing import TextIO

import torch
import torch.distributed as dist

from llamarl.comm import WeightSyncEndpoint
from llamarl.control.run import checkpoint as ckpt
from llamarl.control.run.channels.rollouts import (
    CHECKPOINT_MARKER,
    PendingBatch,
    recv_rollouts,
    send_rollouts,
)
from llamarl.control.run.channels.stream import PauseServer, StreamControl
from llamarl.control.run.channels.weights import FIRST_TRAINER_RANK
from llamarl.control.run.rank_states import RewardRankState
from llamarl.control.run.reward_scoring import add_model_rewards
from llamarl.control.run.schedule import Tick
from llamarl.control.run.side import Side
from llamarl.control.tasks.prompts import PromptStream, TaskPrompts
from llamarl.exec.reward.model import build_model_rewarder
from llamarl.exec.types import RolloutBatch

REWARD_MODEL_TOTALS = ("reward_model_s_total", "reward_model_samples_total", "reward_model_failures_total")
"""The cumulative counters a reward rank adds to each of its generators' batches (`GENERATOR_TOTALS`)."""


class RewardSide(Side):
    """A reward rank."""

    scorer = None
    scores_log: TextIO | None = None
    source: TaskPrompts  # built by setup(): the task's questions and references, to score against

    def init_state(self) -> None:
        # Only its map from data-order positions to examples is used (the same order on every rank).
        self.order = PromptStream(
            self.prompt_order, prompts_per_step=self.config.schedule.prompts_per_step, generator_index=0,
            num_generators=1,
        )  # fmt: skip
        self._scored: dict[int, PendingBatch] = {}  # async mode: by generator, scored, not yet forwarded
        # Cumulative per generator: they travel with its batches (GENERATOR_TOTALS) to the trainer.
        self.totals = {g: dict.fromkeys(REWARD_MODEL_TOTALS, 0.0) for g in self.my_generators}
        self._lock = threading.Lock()  # stream mode: one model, several forwarding threads

    @property
    def my_generators(self) -> list[int]:
        """The generator ranks whose batches this rank scores, in order."""
        return [g for g in self.generator_ranks if self.config.reward_rank_of(g) == self.rank]

    def build_executors(self) -> None:
        self.scorer = build_model_rewarder(self.config.reward_model, rank_device=str(self.device))
        self.scorer.setup()
        self.source = TaskPrompts(self.task, self.train_examples, self.tokenizer)

    def open_channels(self, endpoint: WeightSyncEndpoint | None) -> None:
        # No weight channel: the reward model's weights never come from the trainer.
        path = self.output_dir / f"reward_scores.rank{self.rank}.jsonl"
        self.output_dir.mkdir(parents=True, exist_ok=True)
        if self.resumed is not None:  # lines written after the checkpoint are made again, so cut them
            ckpt.truncate(path, RewardRankState.from_dict(self.resumed.rank_state).scores_bytes)
        self.scores_log = path.open("a" if self.resumed is not None else "w", encoding="utf-8")

    def restore(self, resume: ckpt.Resume) -> None:
        mine = RewardRankState.from_dict(resume.rank_state)
        self._scored = mine.scored
        for g, saved in mine.totals.items():  # (a counter added since the checkpoint starts at 0)
            self.totals[g] = {**dict.fromkeys(REWARD_MODEL_TOTALS, 0.0), **saved}

    def checkpoint_state(self) -> RewardRankState:
        self.scores_log.flush()
        # async mode: the batches scored at the end of a tick, forwarded at the next one
        return RewardRankState(scored=self._scored, totals=self.totals, scores_bytes=self.scores_log.tell())

    def after_resume(self) -> None:
        # Mirrors GeneratorSide.after_resume: a checkpoint of an async run's last tick holds no batch in
        # flight; a longer run needs one, so each generator makes it now. Only this rank knows whether
        # it holds a generator's batch, so it tells each generator (1: held, 0: make one and send it).
        cfg = self.config
        if not (cfg.schedule.mode == "async" and 0 < self.start_tick <= cfg.schedule.steps):
            return
        for g in self.my_generators:
            dist.send(torch.tensor([int(g in self._scored)]), g)
            if g not in self._scored:
                self._scored[g] = self._receive_and_score(g, self.start_tick - 1)
        self._scored = {g: self._scored[g] for g in self.my_generators}  # forwarded in generator order

    def _receive_and_score(self, generator: int, tick: int) -> PendingBatch:
        """Lock step: generator `generator`'s batch of `tick`, scored."""
        batch, metrics = recv_rollouts(src=generator)
        assert isinstance(batch, RolloutBatch)
        return PendingBatch(batch, self._score(generator, batch, metrics, tick))

    def _score(
        self, generator: int, batch: RolloutBatch, metrics: dict[str, float], tick: int
    ) -> dict[str, float]:
        """Adds the model's scores to `batch` (in place); returns the metrics to forward with it."""
        with self._lock, self.timeline.phase("reward_model", tick):
            failures_before = self.scorer.num_failures
            model_B, seconds = add_model_rewards(
                batch, scorer=self.scorer, config=self.config.reward_model, source=self.source,
                index_of=self.order.index,
            )  # fmt: skip
        totals = self.totals[generator]
        totals["reward_model_s_total"] += seconds
        totals["reward_model_samples_total"] += batch.num_sequences
        totals["reward_model_failures_total"] += self.scorer.num_failures - failures_before
        for j in range(batch.num_sequences):
            record = {
                "tick": tick,
                "generator": generator,
                "position": int(batch.prompt_position_B[j]),
                "policy_version": int(batch.policy_version_B[j]),
                "model_score": float(model_B[j]),
                "reward": float(batch.rewards_B[j]),
            }
            self.scores_log.write(json.dumps(record) + "\n")
        self.scores_log.flush()
        return {**metrics, **totals}

    # ----------------------------------------------------------------------------------------------
    # lock step

    def generate(self, tick: Tick) -> None:
        """While the generators sample: receive each of this rank's generators' batch, score it."""
        for g in self.my_generators:
            self._scored[g] = self._receive_and_score(g, tick.index)

    def move_rollouts(self, tick: Tick) -> None:
        assert len(self._scored) == len(self.my_generators), "no scored batch to forward"
        for g, scored in self._scored.items():
            scored.send(dst=FIRST_TRAINER_RANK, tag=g)
        self._scored = {}

    def sync_weights(self) -> None:
        """The reward model's weights are its own: nothing to take."""

    # ----------------------------------------------------------------------------------------------
    # stream

    def run_stream(self) -> None:
        """One thread per generator of this rank: receive, score, forward, until its stream ends; the
        main thread meanwhile serves the trainer's pauses (evaluations, checkpoints) with every other
        rank.

        consumes:     the pauses the trainer requests (the threads consume the generators' streams)
        waits for:    every thread's end: each generator's end of stream
        unblocked by: the generators closing their outboxes once the trainer stopped the run
        """
        control = StreamControl(self.store)
        pauses = PauseServer(self.in_stream_pause)
        errors: list[BaseException] = []
        threads = [
            threading.Thread(target=self._forward, args=(g, errors), name=f"reward-for-{g}", daemon=True)
            for g in self.my_generators
        ]
        for thread in threads:
            thread.start()
        while any(t.is_alive() for t in threads) and not errors:
            pauses.serve_requested(control)
            for thread in threads:
                thread.join(0.05)
        if errors:
            raise errors[0]

    def _forward(self, generator: int, errors: list[BaseException]) -> None:
        """A forwarding thread: generator `generator`'s stream, each batch scored, to the first trainer
        rank (markers and the end of the stream pass through with this rank's totals). A failure goes
        to `errors`, which the main thread raises.

        consumes:     the generator's messages: batches, checkpoint markers, the end of its stream
        waits for:    its next message; the trainer's receive of each one (the rollout group's deadline)
        unblocked by: the generator's outbox; the trainer's receiving thread for this generator
        """
        batches = 0
        try:
            while True:
                batch, metrics = recv_rollouts(src=generator, group=self.rollout_group)
                if isinstance(batch, RolloutBatch):
                    metrics = self._score(generator, batch, metrics, batches)
                    batches += 1
                elif batch is CHECKPOINT_MARKER or batch is None:
                    metrics = {**metrics, **self.totals[generator]}
                send_rollouts(batch, metrics, dst=FIRST_TRAINER_RANK, group=self.rollout_group, tag=generator)
                if batch is None:  # the generator's stream ended, and now the trainer knows
                    return
        except BaseException as e:
            errors.append(e)

    def close(self) -> None:
        if self.scorer is not None:
            self.scorer.close()
        if self.scores_log is not None:
            self.scores_log.close()
