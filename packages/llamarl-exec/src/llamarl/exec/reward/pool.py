"""`ProcessRewarder`: runs a task's reward functions in worker processes, with a per-sample deadline.

Reward functions are untrusted in the ways that matter here: sympy can run for minutes on a
pathological expression, a user's function can loop, crash its process or raise. Each worker is a
spawned process with its own pipe; the parent hands one job (one sample, or with a batched reward
function a share of the batch) to an idle worker and waits on all pipes with a deadline. A job whose
worker misses its deadline scores 0 and that worker is killed and replaced; a worker that dies scores
its job 0 and is replaced; a reward function that raises scores 0 on its samples, with a warning. So
`score()` always returns, within about `timeout_s` x (samples per worker) in the worst case, and every
failure is counted (`num_timeouts`, `num_errors`).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import time
from collections.abc import Sequence
from multiprocessing.connection import wait

from llamarl.exec.config import RewardConfig
from llamarl.exec.reward.functions import Messages, Reward, as_rewards
from llamarl.exec.reward.worker import worker_main

log = logging.getLogger(__name__)

_START_TIMEOUT_S = 120.0  # a worker that cannot import its reward functions in this long is broken


class _Worker:
    """One worker process and the parent's end of its pipe."""

    def __init__(self, ctx, rewards: tuple[Reward, ...]) -> None:
        self.conn, child_conn = ctx.Pipe()
        self.process = ctx.Process(target=worker_main, args=(child_conn, rewards), daemon=True)
        self.process.start()
        child_conn.close()
        self.ready = False
        self.job: list[int] | None = None  # indices of the samples it is scoring
        self.deadline = time.monotonic() + _START_TIMEOUT_S  # until ready, then per job

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=5)
        self.conn.close()

    def stop(self) -> None:
        with contextlib.suppress(BrokenPipeError, OSError):  # already dead: nothing to tell it
            self.conn.send(None)
        self.process.join(timeout=2)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=5)
        self.conn.close()


class ProcessRewarder:
    """Scores samples with a task's weighted reward functions in worker processes; implements `Rewarder`.

    `rewards`: `Reward`s, functions (weight 1) or `(function, weight)` pairs; module-level functions,
    picklable by reference (workers are spawned). With a batched reward function the batch is split
    into one job per worker, each with a deadline of `timeout_s` per sample in it; otherwise each sample
    is a job of its own.

    Attributes:
        num_timeouts: samples whose job hit its deadline since construction.
        num_errors: samples a reward function failed on, or whose worker died.
    """

    def __init__(self, rewards: Sequence, config: RewardConfig) -> None:
        self.config = config
        self.rewards = as_rewards(rewards)
        if not self.rewards:
            raise ValueError("a rewarder needs at least one reward function")
        self._batched = any(r.batched for r in self.rewards)
        self._ctx = mp.get_context("spawn")  # fork would copy the parent's threads and CUDA state
        self._workers: list[_Worker] = []
        self.num_timeouts = 0
        self.num_errors = 0

    @property
    def num_failures(self) -> int:
        """Samples scored 0 because a reward function failed or missed its deadline."""
        return self.num_timeouts + self.num_errors

    def setup(self) -> None:
        """Starts the workers (each imports the reward functions' modules once)."""
        while len(self._workers) < self.config.num_workers:
            self._workers.append(_Worker(self._ctx, self.rewards))

    def close(self) -> None:
        """Stops every worker."""
        for worker in self._workers:
            worker.stop()
        self._workers = []

    def __enter__(self) -> ProcessRewarder:
        self.setup()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def score(self, prompts: list[Messages], completions: list[str], rows: list[dict]) -> list[float]:
        """One weighted reward per sample, in order; 0.0 for samples whose scoring timed out or failed."""
        if not len(prompts) == len(completions) == len(rows):
            raise ValueError(f"{len(prompts)} prompts, {len(completions)} completions and {len(rows)} rows")
        self.setup()
        num = len(completions)
        scores = [0.0] * num
        if self._batched:
            size = max(1, -(-num // len(self._workers)))
            jobs = [list(range(first, min(first + size, num))) for first in range(0, num, size)]
        else:
            jobs = [[i] for i in range(num)]
        jobs.reverse()  # popped from the end: samples go out in order
        remaining = num
        while remaining:
            now = time.monotonic()
            for worker in self._workers:
                if worker.ready and worker.job is None and jobs:
                    job = jobs.pop()
                    worker.conn.send(
                        (
                            job,
                            [prompts[i] for i in job],
                            [completions[i] for i in job],
                            [rows[i] for i in job],
                        )
                    )
                    worker.job, worker.deadline = job, now + self.config.timeout_s * len(job)
            busy = [w for w in self._workers if w.job is not None or not w.ready]
            deadline = min(w.deadline for w in busy)
            ready_conns = wait([w.conn for w in busy], timeout=max(0.0, deadline - time.monotonic()))
            for worker in list(self._workers):
                if worker.conn in ready_conns:
                    remaining -= self._receive(worker, scores)
                elif time.monotonic() >= worker.deadline and (worker.job is not None or not worker.ready):
                    remaining -= self._replace(worker, scores, timed_out=True)
        return scores

    def _receive(self, worker: _Worker, scores: list[float]) -> int:
        """Handles a readable pipe; returns the number of samples finished."""
        try:
            job, values, errors = worker.conn.recv()
        except (EOFError, OSError):  # the worker died (segfault, OOM kill, os._exit in a reward function)
            return self._replace(worker, scores, timed_out=False)
        if job == "ready":
            worker.ready = True
            return 0
        for index, value, error in zip(job, values, errors, strict=True):
            scores[index] = value
            if error is not None:
                self.num_errors += 1
                log.warning("%s on sample %d (scored 0 for it)", error, index)
        worker.job = None
        return len(job)

    def _replace(self, worker: _Worker, scores: list[float], *, timed_out: bool) -> int:
        """Kills `worker`, starts a fresh one in its place; its job's samples (if any) score 0."""
        job = worker.job
        if job is None and not worker.ready:
            if timed_out:
                raise RuntimeError(
                    f"a reward worker did not start within {_START_TIMEOUT_S:.0f} s; are the reward "
                    "functions importable in a fresh process?"
                )
            raise RuntimeError("a reward worker died while starting (are the reward functions picklable?)")
        worker.kill()
        self._workers[self._workers.index(worker)] = _Worker(self._ctx, self.rewards)
        if job is None:
            return 0
        for index in job:
            scores[index] = 0.0
        shown = f"sample {job[0]}" if len(job) == 1 else f"samples {job[0]}..{job[-1]}"
        if timed_out:
            self.num_timeouts += len(job)
            log.warning(
                "reward functions timed out after %.1f s per sample on %s (scored 0)",
                self.config.timeout_s,
                shown,
            )
        else:
            self.num_errors += len(job)
            log.warning("reward worker died on %s (scored 0)", shown)
        return len(job)
