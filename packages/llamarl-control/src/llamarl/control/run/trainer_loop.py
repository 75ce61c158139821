"""A trainer rank's loop: take a batch -> train -> send weights.

`TrainerLoop` holds no process group: in lock step the side hands it each batch, in stream mode it takes
them from a `StreamIntake` (`llamarl.control.run.trainer_intake`), and the weights go out through a
callable (the weight channel's sender), so tests drive it with fakes in one process. It refuses a batch
older than `max_policy_lag` before touching the model, and turns each step into the step's metrics
record: times, throughput, staleness, and the generators' counters (`GeneratorStats`: the change since
the previous step of the cumulative totals that travel with every batch).
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Callable
from typing import Protocol

from llamarl.comm import SyncStats, WeightSyncError
from llamarl.control.outputs.timeline import Timeline
from llamarl.control.run.channels.rollouts import GENERATOR_TOTALS
from llamarl.control.run.refused_steps import RefusedSteps
from llamarl.exec.types import RolloutBatch, Trainer


class PolicyLagError(RuntimeError):
    """Rollouts older than max_policy_lag reached the trainer."""


class GeneratorStats:
    """Trainer side: the latest cumulative totals of every generator, and their change per step."""

    def __init__(self) -> None:
        self._latest: dict[int, dict[str, float]] = {}
        self._at_last_step: dict[int, dict[str, float]] = {}
        self._lock = threading.Lock()

    def state(self) -> dict[str, dict[int, dict[str, float]]]:
        """What a checkpoint keeps: the totals seen so far and at the last step, per generator."""
        with self._lock:
            return {"latest": dict(self._latest), "at_last_step": dict(self._at_last_step)}

    def restore(self, state: dict[str, dict[int, dict[str, float]]] | None) -> None:
        if state:
            with self._lock:
                self._latest = {int(g): dict(v) for g, v in state["latest"].items()}
                self._at_last_step = {int(g): dict(v) for g, v in state["at_last_step"].items()}

    def update(self, generator: int, metrics: dict[str, float]) -> None:
        with self._lock:
            self._latest[generator] = {k: metrics[k] for k in GENERATOR_TOTALS if k in metrics}

    def step(self) -> dict[str, float]:
        """Changes since the previous call: max generate seconds over generators, groups sampled and
        filtered (sums), and the generators' mean idle fraction."""
        with self._lock:
            deltas = []
            for g, latest in self._latest.items():
                before = self._at_last_step.get(g, dict.fromkeys(GENERATOR_TOTALS, 0.0))
                deltas.append({k: latest.get(k, 0.0) - before.get(k, 0.0) for k in GENERATOR_TOTALS})
                self._at_last_step[g] = dict(latest)
        if not deltas:
            return {}
        idle = [1.0 - d["busy_s_total"] / d["alive_s_total"] for d in deltas if d["alive_s_total"] > 0]
        return {
            "reward_model_s": sum(d["reward_model_s_total"] for d in deltas),
            "reward_model_samples": sum(d["reward_model_samples_total"] for d in deltas),
            "generate_s": max(d["generate_s_total"] for d in deltas),
            "groups": sum(d["groups_total"] for d in deltas),
            "filtered": sum(d["filtered_total"] for d in deltas),
            "generator_idle_frac": sum(idle) / len(idle) if idle else float("nan"),
            "engine_restarts": sum(d["engine_restarts_total"] for d in deltas),
            # a reward function's failures and the reward model's, each costing its sample
            "reward_failures": sum(
                d["reward_failures_total"] + d["reward_model_failures_total"] for d in deltas
            ),
            "episodes_dropped": sum(d["episodes_dropped_total"] for d in deltas),
        }


def staleness_histogram(batch: RolloutBatch, current_version: int, max_lag: int) -> dict[str, float]:
    """The fraction of completion tokens `k` versions behind `current_version`, k = 0..max_lag."""
    lags_BC = batch.token_lags_BC(current_version)
    mask_BC = batch.completion_mask_BC.bool()
    total = max(int(mask_BC.sum()), 1)
    return {
        f"staleness/lag_{k}_frac": float(((lags_BC == k) & mask_BC).sum()) / total for k in range(max_lag + 1)
    }


class StreamIntake(Protocol):
    """Where a stream trainer rank's batches come from, and what the generators hear from it
    (`llamarl.control.run.trainer_intake`: the first trainer rank's buffer, or its relay to the others)."""

    def open(self) -> None:
        """Starts receiving (before the first step)."""
        ...

    def take(self, version: int) -> tuple[RolloutBatch, RolloutBatch]:
        """The next batch for a trainer at `version`: (this rank's part, the whole batch)."""
        ...

    def figures(self) -> dict[str, float]:
        """The intake's figures for a step's record."""
        ...

    def announce(self) -> None:
        """A weight sync starts now: every generator takes part in it."""
        ...

    def pause_after(self, version: int) -> None:
        """Every rank pauses for what is due after the step that made `version` (evaluation, checkpoint)."""
        ...

    def close(self) -> None:
        """After the last step: the generators stop; waits until every stream ended."""
        ...


class TrainerLoop:
    """Take a batch -> train -> send weights, on a trainer rank (every trainer rank has one).

    Stream mode calls `before_step(step)` at the start of each step (fault injection), trains its last
    step inside `generators_done()` (the trainer side borrows the generators' cores there,
    `llamarl.control.launch.threads`) and hands each step's record to `on_step(record, whole batch)`.
    """

    def __init__(
        self,
        *,
        trainer: Trainer,
        send_weights: Callable[[int], SyncStats | None],
        max_policy_lag: int,
        timeline: Timeline,
        paused_s: Callable[[], float] = lambda: 0.0,
        tolerate_sync_failures: bool = False,
        before_step: Callable[[int], None] = lambda step: None,
        generators_done: Callable[[], contextlib.AbstractContextManager[None]] = contextlib.nullcontext,
        on_step: Callable[[dict[str, float], RolloutBatch], None] = lambda record, whole: None,
        refused: RefusedSteps | None = None,
    ) -> None:
        self.trainer = trainer
        # Steps whose update the trainer refused (non-finite values): counted, said, and the run stopped
        # after too many in a row.
        self.refused = refused or RefusedSteps(limit=3, where_to_resume=lambda: "see the checkpoints")
        self.refusal: str | None = None  # the last step's refusal, as a line for the log (None: applied)
        # Where a generator's engine can be replaced: a sync that failed on a dead engine is logged and
        # training goes on; the replaced engine (and any generator the failure reached) asks for the
        # weights again (`TrainerIntake.answer_weight_requests`).
        self.tolerate_sync_failures = tolerate_sync_failures
        self.sync_failures = 0
        self._send = send_weights
        self.max_policy_lag = max_policy_lag
        self.timeline = timeline
        # Seconds the loop was paused so far (evaluations inside it): left out of the step times.
        self.paused_s = paused_s
        self.last_sync_s = float("nan")
        # This rank's share of the last sync: bytes sent, and what a full sync would have sent.
        self.last_sync_bytes, self.last_sync_full_bytes = float("nan"), float("nan")
        self.generator_stats = GeneratorStats()
        self.before_step = before_step
        self.generators_done = generators_done
        self.on_step = on_step
        self._last_step_end: float | None = None
        self.tick = -1

    @property
    def policy_version(self) -> int:
        return int(self.trainer.policy_version)

    def send_weights(self) -> None:
        """Sends the current weights to the generators (every trainer rank sends its shards)."""
        start = time.perf_counter()
        with self.timeline.phase("weight_sync", self.tick):
            try:
                stats = self._send(self.policy_version)
                if stats is not None:
                    self.last_sync_bytes, self.last_sync_full_bytes = stats.bytes, stats.full_bytes
            except WeightSyncError as e:
                if not self.tolerate_sync_failures:
                    raise
                self.sync_failures += 1
                print(
                    f"trainer: weight sync of version {self.policy_version} failed ({e}); training goes "
                    "on and the weights go again to whoever asks",
                    file=sys.stderr,
                    flush=True,
                )
        self.last_sync_s = time.perf_counter() - start

    def _sync_figures(self) -> dict[str, float]:
        """The last sync's megabytes (this rank's) and their share of a full sync's (changed-only syncs,
        weight_sync.delta, send a small share)."""
        sent, full = self.last_sync_bytes, self.last_sync_full_bytes
        return {
            "weight_sync/mb": sent / 2**20,
            "weight_sync/sent_fraction": sent / full if full else float("nan"),
        }

    def train(self, batch: RolloutBatch, whole_batch: RolloutBatch | None = None) -> dict[str, float]:
        """One optimizer step on `batch` (this rank's part); returns the step's record.

        `whole_batch` (the logging rank's view of every part) feeds the batch-level figures; defaults to
        `batch`. Raises PolicyLagError, before touching the model, when a token is older than allowed.
        """
        whole = batch if whole_batch is None else whole_batch
        version = self.policy_version
        lag = version - int(whole.policy_version_B.min())
        if lag > self.max_policy_lag:
            raise PolicyLagError(
                f"rollouts are {lag} policy versions old (max_policy_lag={self.max_policy_lag})"
            )
        with self.timeline.phase("train", self.tick):
            train_metrics = self.trainer.train_step(batch)  # every trainer rank; metrics are global
        self.refusal = self.refused.check(train_metrics, self.policy_version)
        # The step's times are the train span's own readings (the trace shows what the metrics say): a
        # step lasts from the end of the previous training to the end of this one, pauses left out.
        span = self.timeline.last("train")
        train_s = span.end - span.start
        step_end = span.end - self.paused_s()
        step_s = step_end - self._last_step_end if self._last_step_end is not None else float("nan")
        self._last_step_end = step_end
        tokens = whole.num_completion_tokens
        gen = self.generator_stats.step()
        generate_s = gen.get("generate_s", float("nan"))
        reward_model_s = gen.get("reward_model_s", 0.0)
        return {
            "train/reward_mean": float(whole.rewards_B.mean()),
            "time/step_s": step_s,
            "time/train_s": train_s,
            "time/generate_s": generate_s,
            "time/weight_sync_s": self.last_sync_s,
            **self._sync_figures(),
            "throughput/generated_tokens_per_s": tokens / step_s if step_s == step_s else float("nan"),
            "throughput/generator_tokens_per_s": tokens / generate_s if generate_s > 0 else float("nan"),
            "throughput/trainer_tokens_per_s": tokens / train_s,
            "policy/lag": float(lag),
            "policy/version": float(self.policy_version),
            "train/num_completion_tokens": float(tokens),
            "sampling/groups": gen.get("groups", float("nan")),
            "sampling/filtered_groups": gen.get("filtered", float("nan")),
            "idle/generator_frac": gen.get("generator_idle_frac", float("nan")),
            "generator/engine_restarts": gen.get("engine_restarts", float("nan")),
            "sampling/reward_failures": gen.get("reward_failures", float("nan")),
            "sampling/episodes_dropped": gen.get("episodes_dropped", float("nan")),
            # the reward model (reward ranks, or colocated): scoring seconds and samples scored this step
            "time/reward_model_s": reward_model_s,
            "reward_model/samples": gen.get("reward_model_samples", 0.0),
            "throughput/reward_model_samples_per_s": (
                gen.get("reward_model_samples", 0.0) / reward_model_s if reward_model_s > 0 else float("nan")
            ),
            "idle/trainer_frac": 1.0 - train_s / step_s if step_s == step_s and step_s > 0 else float("nan"),
            **staleness_histogram(whole, version, self.max_policy_lag),
            **{f"train/{k}": v for k, v in train_metrics.items()},
        }

    def stream(self, intake: StreamIntake, *, steps: int, first_step: int = 0) -> None:
        """Stream mode: steps `first_step` .. `steps - 1` (a resumed run starts later), each: take a
        batch, train, send the new weights; then the generators stop.

        consumes:     a batch a step from `intake` (the groups admitted next, within max_policy_lag)
        waits for:    those groups (the first trainer rank answers requests for weights meanwhile);
                      the generators in each weight sync; every rank in each pause
        unblocked by: the generators' outboxes (through the intake's receiving threads); their weight
                      receives; every rank reaching the pause

        The last step trains inside `generators_done()`: once its batch is taken no generator has
        anything left to sample (admission stops at the run's last step).
        """
        intake.open()
        for step in range(first_step, steps):
            self.tick = step
            self.before_step(step)
            with self.timeline.phase("rollouts", step):
                part, whole = intake.take(self.policy_version)
            with self.generators_done() if step == steps - 1 else contextlib.nullcontext():
                record = self.train(part, whole)
            self.on_step({**record, **intake.figures()}, whole)
            intake.announce()
            self.send_weights()
            intake.pause_after(self.policy_version)
        intake.close()
