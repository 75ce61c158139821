"""The two roles of an RL run, one object each, free of process groups so tests can drive them.

- `GeneratorRole`: receive weights -> generate (and score) -> hand over a batch.
- `TrainerRole`: take a batch -> train -> send weights.

The controller moves what they hand over between ranks (`llamarl.control.channels`) and decides when
each runs: in lock step by `llamarl.control.schedule`, or continuously in stream mode through
`GeneratorRole.stream` and `TrainerRole.stream`. Both take their transport as small objects (an
outbox, a `RolloutBuffer`, a `StreamControl` over a key-value store), so tests run them with fakes in
one process.

Generator metrics travel with every batch as cumulative totals (`GENERATOR_TOTALS`); the trainer takes
differences between steps (`GeneratorStats`), so nothing is lost when a request yields no batch (all of
its groups filtered) or a batch is dropped as stale.

Shape legend: B sequences, C completion length, G group size.
"""

from __future__ import annotations

import json
import queue
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, TextIO

import torch

from llamarl.comm import WeightSyncError
from llamarl.control.buffer import BufferClosed, RolloutBuffer
from llamarl.control.channels import GENERATOR_TOTALS, concat_rollouts
from llamarl.control.timeline import Timeline
from llamarl.exec import EngineError, EngineLost
from llamarl.exec.types import Generator, Rewarder, RolloutBatch, Trainer


class PolicyLagError(RuntimeError):
    """Rollouts older than max_policy_lag reached the trainer."""


class StreamStopped(Exception):
    """The trainer finished: a stream generator abandons its request."""


# ---------------------------------------------------------------------------------------------------
# prompts


class PromptStream:
    """The prompts one generator samples, in order: its share of every step's prompts.

    The k-th prompt of generator g is the (k mod S)-th of g's S = prompts_per_step / num_generators
    slots in step k // S of the shuffled `order`, so a lock-step run that takes S per tick sees exactly
    the prompts of that tick; dynamic sampling and stream mode simply read further. `position` is the
    state to checkpoint.
    """

    def __init__(self, order: list[int], *, prompts_per_step: int, generator_index: int, num_generators: int):
        self.order = order
        self.prompts_per_step = prompts_per_step
        self.share = prompts_per_step // num_generators
        self.offset = generator_index * self.share
        self.position = 0

    def take(self, count: int) -> list[int]:
        """The next `count` dataset indices of this generator."""
        indices = []
        for k in range(self.position, self.position + count):
            step, slot = divmod(k, self.share)
            indices.append(self.order[(step * self.prompts_per_step + self.offset + slot) % len(self.order)])
        self.position += count
        return indices


# ---------------------------------------------------------------------------------------------------
# stream-mode transport seams


class KeyValueStore(Protocol):
    """The part of torch.distributed.Store that `StreamControl` uses."""

    def set(self, key: str, value: str | bytes) -> None: ...

    def get(self, key: str) -> bytes: ...

    def check(self, keys: list[str]) -> bool: ...

    def add(self, key: str, amount: int) -> int: ...


class StreamControl:
    """Counters every rank reads through a key-value store: how many weight syncs the trainer started
    (every generator takes part in each), whether the run is over, and how many times a generator
    asked for the current weights again (its engine was replaced, or a sync failed half-way).
    Generators poll them between decoding steps, so the reads must be cheap."""

    _SYNCS = "stream/syncs_announced"
    _STOP = "stream/stop"
    _WANTED = "stream/weights_wanted"

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


class RolloutOutbox:
    """A generator's sending side in stream mode: a thread sends finished batches while the generator
    samples the next one. `put` waits while one batch is already queued (back-pressure from a full
    trainer buffer), calling `while_waiting` so the generator can still take new weights meanwhile."""

    def __init__(self, send: Callable[[RolloutBatch | None, dict[str, float]], None], *, timeout_s: float):
        self._send = send
        self.timeout_s = timeout_s
        self._queue: queue.Queue[tuple[RolloutBatch | None, dict[str, float]]] = queue.Queue(maxsize=1)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="rollout-outbox", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            batch, metrics = self._queue.get()
            try:
                self._send(batch, metrics)
            except BaseException as e:  # re-raised in the generator's thread by put/close
                self._error = e
                return
            if batch is None:
                return

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


# ---------------------------------------------------------------------------------------------------
# generator role


@dataclass
class GeneratorSetup:
    """What a generator role needs besides its executors."""

    samples_per_prompt: int  # completions per prompt (the group size G)
    prompts_per_request: int  # prompts per generate call (this generator's share of a step)
    max_new_tokens: int
    dynamic_sampling: bool  # drop groups whose rewards are all equal and sample more prompts
    max_sampling_rounds: int  # lock step: generate calls per batch at most (dynamic sampling)


class GeneratorRole:
    """Receive weights -> generate and score -> hand over a batch, on one generator rank."""

    def __init__(
        self,
        *,
        generator: Generator,
        rewarder: Rewarder,
        receive_weights: Callable[[], int],
        prompts: PromptStream,
        encode: Callable[[int], list[int]],
        reference: Callable[[int], str],
        question: Callable[[int], str],
        decode: Callable[[RolloutBatch], list[str]],
        setup: GeneratorSetup,
        timeline: Timeline,
        sample_log: TextIO | None = None,
        before_request: Callable[[int], None] | None = None,
        replace_engines: bool = False,
    ) -> None:
        self.generator = generator
        self.rewarder = rewarder
        self._receive = receive_weights
        self.prompts = prompts
        self._encode = encode
        self._reference = reference
        self._question = question
        self._decode = decode
        self.setup = setup
        self.timeline = timeline
        self.sample_log = sample_log
        self.before_request = before_request  # stream mode: called with each request's number (faults)
        self.replace_engines = replace_engines  # stream mode: restart a dead engine instead of failing
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
            version = self._receive()
        self.generator.policy_version = version
        return version

    def make_batch(self, tick: int) -> tuple[RolloutBatch, dict[str, float]]:
        """Lock step: this generator's groups for `tick`.

        With dynamic sampling, groups whose rewards are all equal are dropped and further prompts are
        sampled until the share is full, for at most `max_sampling_rounds` generate calls; a share still
        short then is topped up with dropped groups (they carry no advantage under a group baseline).
        """
        self.tick = tick
        share = self.setup.prompts_per_request
        kept: list[RolloutBatch] = []
        filtered: list[RolloutBatch] = []
        last: dict[str, float] = {}
        for _ in range(self.setup.max_sampling_rounds if self.setup.dynamic_sampling else 1):
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
        G = self.setup.samples_per_prompt
        start = time.perf_counter()
        extra = {"between_steps": between_steps} if between_steps is not None else {}
        with self.timeline.phase("generate", self.tick):
            batch = self.generator.generate(
                [self._encode(i) for i in indices],
                samples_per_prompt=G,
                max_new_tokens=self.setup.max_new_tokens,
                **extra,
            )
        generate_s = time.perf_counter() - start
        texts = self._decode(batch)
        references = [self._reference(i) for i in indices for _ in range(G)]
        start = time.perf_counter()
        with self.timeline.phase("score", self.tick):
            batch.rewards_B = torch.tensor(self.rewarder.score(texts, references), dtype=torch.float32)
        score_s = time.perf_counter() - start
        self._log_samples(batch, indices, texts)
        self.totals["generate_s_total"] += generate_s
        self.totals["busy_s_total"] += generate_s + score_s
        self.totals["groups_total"] += len(indices)
        metrics = {
            "generate_s": generate_s,
            "score_s": score_s,
            "num_completion_tokens": float(batch.num_completion_tokens),
            "reward_mean": float(batch.rewards_B.mean()),
        }
        if not self.setup.dynamic_sampling:
            return batch, [], metrics
        keep, drop = [], []
        for group in _groups(batch):
            (keep if float(group.rewards_B.max() - group.rewards_B.min()) > 0 else drop).append(group)
        self.totals["filtered_total"] += len(drop)
        return (concat_rollouts(keep) if keep else None), drop, metrics

    def _log_samples(self, batch: RolloutBatch, indices: list[int], texts: list[str]) -> None:
        if self.sample_log is None:
            return
        G = self.setup.samples_per_prompt
        for j, text in enumerate(texts):
            record = {
                "tick": self.tick,
                "policy_version": int(batch.policy_version_B[j]),
                "question": self._question(indices[j // G]),
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
                    indices, retry = retry or self.prompts.take(self.setup.prompts_per_request), []
                    if self.before_request is not None:
                        self.before_request(requests)
                    batch, dropped, metrics = self._sample(indices, between_steps if in_flight else None)
                    requests += 1
                    if batch is None:  # every group filtered by dynamic sampling
                        starved += 1
                        if starved < self.setup.max_sampling_rounds:
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
        restart = getattr(self.generator, "restart_engine", None)
        if restart is None or not self.replace_engines:
            raise error
        first_line = str(error).splitlines()[0]
        print(f"generator: {first_line}: restarting the engine", file=sys.stderr, flush=True)
        start = time.perf_counter()
        restart()
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


# ---------------------------------------------------------------------------------------------------
# trainer role


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
            "generate_s": max(d["generate_s_total"] for d in deltas),
            "groups": sum(d["groups_total"] for d in deltas),
            "filtered": sum(d["filtered_total"] for d in deltas),
            "generator_idle_frac": sum(idle) / len(idle) if idle else float("nan"),
            "engine_restarts": sum(d["engine_restarts_total"] for d in deltas),
        }


def staleness_histogram(batch: RolloutBatch, current_version: int, max_lag: int) -> dict[str, float]:
    """The fraction of completion tokens `k` versions behind `current_version`, k = 0..max_lag."""
    lags_BC = batch.token_lags_BC(current_version)
    mask_BC = batch.completion_mask_BC.bool()
    total = max(int(mask_BC.sum()), 1)
    return {
        f"staleness/lag_{k}_frac": float(((lags_BC == k) & mask_BC).sum()) / total for k in range(max_lag + 1)
    }


class TrainerRole:
    """Take a batch -> train -> send weights, on a trainer rank (every trainer rank has one)."""

    def __init__(
        self,
        *,
        trainer: Trainer,
        send_weights: Callable[[int], None],
        max_policy_lag: int,
        timeline: Timeline,
        clock: Callable[[], float] = time.perf_counter,
        tolerate_sync_failures: bool = False,
    ) -> None:
        self.trainer = trainer
        # Where a generator's engine can be replaced: a sync that failed on a dead engine is logged and
        # training goes on; the replaced engine (and any generator the failure reached) asks for the
        # weights again (`answer_weight_requests`).
        self.tolerate_sync_failures = tolerate_sync_failures
        self.sync_failures = 0
        self._send = send_weights
        self.max_policy_lag = max_policy_lag
        self.timeline = timeline
        self.clock = clock  # the loop clock: stops while the controller evaluates inside the loop
        self.last_sync_s = float("nan")
        self.generator_stats = GeneratorStats()
        self._answered = 0  # requests for weights answered (StreamControl.weights_wanted)
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
                self._send(self.policy_version)
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
        start = time.perf_counter()
        with self.timeline.phase("train", self.tick):
            train_metrics = self.trainer.train_step(batch)  # every trainer rank; metrics are global
        train_s = time.perf_counter() - start
        now = self.clock()
        step_s = now - self._last_step_end if self._last_step_end is not None else float("nan")
        self._last_step_end = now
        tokens = whole.num_completion_tokens
        gen = self.generator_stats.step()
        generate_s = gen.get("generate_s", float("nan"))
        return {
            "train/reward_mean": float(whole.rewards_B.mean()),
            "time/step_s": step_s,
            "time/train_s": train_s,
            "time/generate_s": generate_s,
            "time/weight_sync_s": self.last_sync_s,
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
            "idle/trainer_frac": 1.0 - train_s / step_s if step_s == step_s and step_s > 0 else float("nan"),
            **staleness_histogram(whole, version, self.max_policy_lag),
            **{f"train/{k}": v for k, v in train_metrics.items()},
        }

    def stream(
        self,
        *,
        steps: int,
        take: Callable[[], RolloutBatch],
        relay: Callable[[RolloutBatch], RolloutBatch],
        control: StreamControl | None,
        on_step: Callable[[dict[str, float]], None],
    ) -> None:
        """Stream mode: `steps` times take a batch (`take`, e.g. from the `RolloutBuffer`), keep this
        rank's part (`relay`), train and send the new weights; then tell the generators to stop.

        `control` is None on trainer ranks other than the first (they neither announce nor stop).
        """
        for step in range(steps):
            self.tick = step
            with self.timeline.phase("rollouts", step):
                whole = take()  # the first trainer rank answers requests for weights while it waits
            record = self.train(relay(whole), whole)
            on_step(record)
            if control is not None:
                control.announce()
            self.send_weights()
        if control is not None:
            control.stop()

    def answer_weight_requests(self, control: StreamControl) -> None:
        """Sends the current weights again when a restarted generator asked for them (stream mode)."""
        wanted = control.weights_wanted()
        if wanted > self._answered:
            self._answered = wanted
            control.announce()
            self.send_weights()


def drain_into_buffer(
    buffer: RolloutBuffer,
    receive: Callable[[], tuple[RolloutBatch | None, dict[str, float]]],
    stats: GeneratorStats,
    generator: int,
    *,
    timeout_s: float,
) -> int:
    """Trainer side of one generator's stream: receive batches into `buffer` until its end marker.

    Batches arriving after the buffer closed (the run is over) are received and discarded, so the
    generator's sending thread never blocks. Returns the number of batches discarded.
    """
    discarded = 0
    while True:
        batch, metrics = receive()
        stats.update(generator, metrics)
        if batch is None:
            return discarded
        try:
            buffer.put(batch, timeout_s=timeout_s)
        except BufferClosed:
            discarded += 1
