"""`ProcessRewarder`: runs a reward function in worker processes, with a per-sample timeout.

Verifiers are untrusted in the ways that matter here: sympy can run for minutes on a pathological
expression, and a parser can crash or raise. Each worker is a spawned process with its own pipe; the
parent hands one sample at a time to an idle worker and waits on all pipes with a deadline. A sample
whose worker misses its deadline scores 0 and that worker is killed and replaced; a worker that dies
scores its sample 0 and is replaced; an exception in the reward function scores 0 with a warning. So
`score()` always returns, within about `timeout_s` x (samples per worker) in the worst case.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import signal
import time
from collections.abc import Callable
from multiprocessing.connection import Connection, wait

from llamarl.exec.config import RewardConfig
from llamarl.exec.rewards import get_reward_fn

log = logging.getLogger(__name__)

_START_TIMEOUT_S = 120.0  # a worker that cannot import its reward function in this long is broken


def _worker_main(conn: Connection, reward_fn: Callable[[str, str], float]) -> None:
    """Worker loop: receive (index, completion, reference), send (index, score, error or None)."""
    # Ctrl-C (and a scheduler's SIGTERM) reach every process of the run: a worker ends with its rank
    # (which stops it, or whose exit closes the pipe), never with a traceback of its own.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    conn.send(("ready", None, None))
    while True:
        try:
            task = conn.recv()
        except EOFError:  # the parent went away
            return
        if task is None:
            return
        index, completion, reference = task
        try:
            score, error = float(reward_fn(completion, reference)), None
        except Exception as e:  # a verifier bug must cost one sample, not the run
            score, error = 0.0, f"{type(e).__name__}: {e}"
        conn.send((index, score, error))


class _Worker:
    """One worker process and the parent's end of its pipe."""

    def __init__(self, ctx, reward_fn: Callable[[str, str], float]) -> None:
        self.conn, child_conn = ctx.Pipe()
        self.process = ctx.Process(target=_worker_main, args=(child_conn, reward_fn), daemon=True)
        self.process.start()
        child_conn.close()
        self.ready = False
        self.task: int | None = None  # index of the sample it is scoring
        self.deadline = time.monotonic() + _START_TIMEOUT_S  # until ready, then per sample

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
    """Scores completions against references in worker processes; implements `Rewarder`.

    `reward_fn`: a name in `llamarl.exec.rewards.REWARD_FNS`, or a module-level function
    (completion, reference) -> float, picklable by reference (workers are spawned).

    Attributes:
        num_timeouts: samples that hit the timeout since construction.
        num_errors: samples whose reward function raised or whose worker died.
    """

    def __init__(self, reward_fn: str | Callable[[str, str], float], config: RewardConfig) -> None:
        self.config = config
        self.reward_fn = get_reward_fn(reward_fn) if isinstance(reward_fn, str) else reward_fn
        self._ctx = mp.get_context("spawn")  # fork would copy the parent's threads and CUDA state
        self._workers: list[_Worker] = []
        self.num_timeouts = 0
        self.num_errors = 0

    def setup(self) -> None:
        """Starts the workers (each imports the reward function's module once)."""
        while len(self._workers) < self.config.num_workers:
            self._workers.append(_Worker(self._ctx, self.reward_fn))

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

    def score(self, completions: list[str], references: list[str]) -> list[float]:
        """One score per completion, in order; 0.0 for samples that time out or fail."""
        if len(completions) != len(references):
            raise ValueError(f"{len(completions)} completions but {len(references)} references")
        self.setup()
        scores = [0.0] * len(completions)
        todo = list(range(len(completions)))[::-1]  # popped from the end: samples go out in order
        remaining = len(completions)
        while remaining:
            now = time.monotonic()
            for worker in self._workers:
                if worker.ready and worker.task is None and todo:
                    index = todo.pop()
                    worker.conn.send((index, completions[index], references[index]))
                    worker.task, worker.deadline = index, now + self.config.timeout_s
            busy = [w for w in self._workers if w.task is not None or not w.ready]
            deadline = min(w.deadline for w in busy)
            ready_conns = wait([w.conn for w in busy], timeout=max(0.0, deadline - time.monotonic()))
            for worker in list(self._workers):
                if worker.conn in ready_conns:
                    remaining -= self._receive(worker, scores, completions)
                elif time.monotonic() >= worker.deadline and (worker.task is not None or not worker.ready):
                    remaining -= self._replace(worker, scores, timed_out=True)
        return scores

    def _receive(self, worker: _Worker, scores: list[float], completions: list[str]) -> int:
        """Handles a readable pipe; returns the number of samples finished (0 or 1)."""
        try:
            index, score, error = worker.conn.recv()
        except (EOFError, OSError):  # the worker died (segfault, OOM kill, os._exit in a verifier)
            return self._replace(worker, scores, timed_out=False)
        if index == "ready":
            worker.ready = True
            return 0
        if error is not None:
            self.num_errors += 1
            log.warning("reward function failed on sample %d (scored 0): %s", index, error)
        scores[index] = score if error is None else 0.0
        worker.task = None
        return 1

    def _replace(self, worker: _Worker, scores: list[float], *, timed_out: bool) -> int:
        """Kills `worker`, starts a fresh one in its place; its sample (if any) scores 0."""
        index = worker.task
        if index is None and not worker.ready:
            if timed_out:
                raise RuntimeError(
                    f"a reward worker did not start within {_START_TIMEOUT_S:.0f} s; is the reward function "
                    "importable in a fresh process?"
                )
            raise RuntimeError("a reward worker died while starting (is the reward function picklable?)")
        worker.kill()
        self._workers[self._workers.index(worker)] = _Worker(self._ctx, self.reward_fn)
        if index is None:
            return 0
        scores[index] = 0.0
        if timed_out:
            self.num_timeouts += 1
            log.warning(
                "reward function timed out after %.1f s on sample %d (scored 0)", self.config.timeout_s, index
            )
        else:
            self.num_errors += 1
            log.warning("reward worker died on sample %d (scored 0)", index)
        return 1
