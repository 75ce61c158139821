"""`ProcessRewarder`: runs a task's reward functions in worker processes, with a per-sample deadline.

Reward functions are untrusted in the ways that matter here: sympy can run for minutes on a
pathological expression, a user's function can sleep, loop, crash its process, raise or return NaN.
Each worker is a light process of its own (`llamarl.exec.reward.worker`) with a socket to the parent;
the parent hands one job (one sample, or with a batched reward function a share of the batch) to an
idle worker and waits on all sockets with a deadline:

- a job whose worker misses its deadline scores 0; the worker is killed and replaced;
- a worker that dies scores its job 0 and is replaced;
- a reward function that raises, or returns anything but a finite number, scores 0 on its samples
  (`llamarl.exec.reward.functions.score_samples`);
- when every worker holds a job it has waited on for `PATIENCE_S` without computing (a sleep, a
  network call, a lock: read from /proc), the pool starts as many workers again, up to
  `MAX_EXTRA_WORKERS` beyond `num_workers`, so that the other samples do not queue behind them: a
  function that hangs on every sample costs about one deadline per batch (of up to that many samples),
  not one per sample. The extra workers stop once the batch is scored. Workers that compute are never
  joined by more: CPU-bound scoring keeps the `num_workers` cores it was given.

So `score()` always returns, and every failure is counted (`num_timeouts`, `num_errors`) and reported
in one line per batch and kind of failure, naming the reward function and the (first) sample.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import pickle
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from pathlib import Path

from llamarl.exec.config import RewardConfig
from llamarl.exec.reward.functions import Messages, as_rewards, one_line
from llamarl.exec.reward.worker import WHERE

log = logging.getLogger(__name__)

PATIENCE_S = 0.25
"""A job held this long by a worker that is not computing counts as waiting (see the module doc)."""
MAX_EXTRA_WORKERS = 16
"""Workers started beyond `num_workers` while every worker waits (a light worker holds ~40 MB)."""
_WAITING_CPU_SHARE = 0.2  # a worker that spent less of its job's time on a CPU than this is waiting
_START_TIMEOUT_S = 120.0  # a worker that cannot import its reward functions in this long is broken
_ENTRY = "from llamarl.exec.reward.worker import main; main()"


def _main_script() -> tuple[str | None, str | None]:
    """The parent's main module (its name, else its file), for a worker to run should a reward function
    live there; what multiprocessing's spawn would run (a package's `__main__` is never re-run)."""
    main = sys.modules.get("__main__")
    name = getattr(getattr(main, "__spec__", None), "name", None)
    if name is not None:
        return (None, None) if name == "__main__" or name.endswith(".__main__") else (name, None)
    path = getattr(main, "__file__", None)
    return (None, os.path.abspath(path) if path else None)


def _cpu_seconds(pid: int) -> float | None:
    """The CPU time a process has used (Linux /proc), or None where it cannot be read."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    fields = stat[stat.rindex(b")") + 2 :].split()  # after the command name, which may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


class _Worker:
    """One worker process, the parent's end of its socket, and the job it holds."""

    def __init__(self, payload: bytes, main_script: tuple[str | None, str | None]) -> None:
        parent_end, child_end = socket.socketpair()
        self._where_file = tempfile.TemporaryFile()  # noqa: SIM115 (closed in kill())
        self._where_file.truncate(WHERE.size)
        self.where = mmap.mmap(self._where_file.fileno(), WHERE.size)
        WHERE.pack_into(self.where, 0, -1, -1)
        fds = (child_end.fileno(), self._where_file.fileno())
        # The parent's sys.path, as multiprocessing's spawn gives it (a task file's folder included).
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        self.process = subprocess.Popen([sys.executable, "-c", _ENTRY, *map(str, fds)], pass_fds=fds, env=env)
        child_end.close()
        self.conn = Connection(parent_end.detach())
        self.conn.send((main_script, payload))
        self.ready = False
        self.job: list[int] | None = None  # indices of the samples it is scoring
        self.started = time.monotonic()  # of its job (before: of the process)
        self.deadline = self.started + _START_TIMEOUT_S  # until ready, then per job
        self._cpu_at_start = 0.0

    def give(self, job: list[int], batch: _Batch, timeout_s: float) -> None:
        """Sends it `job` (sample indices of `batch`) with a deadline of `timeout_s` per sample."""
        self.job, self.started = job, time.monotonic()
        self.deadline = self.started + timeout_s * len(job)
        self._cpu_at_start = _cpu_seconds(self.process.pid) or 0.0
        task = (job, *([part[i] for i in job] for part in (batch.prompts, batch.completions, batch.rows)))
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # dead: its socket reads EOF next
            self.conn.send(task)

    def waiting(self, now: float) -> bool:
        """Whether it has held its job for `PATIENCE_S` or more while hardly using a CPU."""
        held = now - self.started
        if self.job is None or held < PATIENCE_S:
            return False
        cpu = _cpu_seconds(self.process.pid)
        return cpu is not None and cpu - self._cpu_at_start < _WAITING_CPU_SHARE * held

    def calling(self) -> tuple[int, int]:
        """(reward function index, sample offset in its job) it is in now; -1 where unknown or all."""
        return WHERE.unpack_from(self.where, 0)

    def exit_code(self) -> int | None:
        """Its exit status, waiting a moment for it (it has closed its socket: it is on its way out)."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            return self.process.wait(timeout=2)
        return None

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=5)
        self.conn.close()
        self.where.close()
        self._where_file.close()

    def stop(self) -> None:
        """Tells it to exit (a starting one is killed: it holds nothing)."""
        if self.ready:
            with contextlib.suppress(BrokenPipeError, OSError):  # already dead: nothing to tell it
                self.conn.send(None)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=2)
        self.kill()


@dataclass
class _Batch:
    """One `score()` call: its samples, their scores, and the failures to report (line -> samples)."""

    prompts: list[Messages]
    completions: list[str]
    rows: list[dict]
    scores: list[float]
    failures: dict[str, list[int]] = field(default_factory=dict)

    def fail(self, index: int, error: str) -> None:
        """Records a failure to report (the score is the caller's: the other functions may count)."""
        self.failures.setdefault(error, []).append(index)

    def sample(self, index: int) -> str:
        """The sample as a line names it: its index, the prompt's last message and the completion."""
        prompt = self.prompts[index][-1].get("content", "") if self.prompts[index] else ""
        completion = self.completions[index]
        return (
            f"sample {index} (prompt {one_line(str(prompt), 40)!r}, completion {one_line(completion, 40)!r})"
        )

    def report(self) -> None:
        """One warning per kind of failure: the reward function, what went wrong, the first sample."""
        for error, indices in sorted(self.failures.items(), key=lambda item: item[1][0]):
            more = f" (and {len(indices) - 1} more samples of this batch)" if len(indices) > 1 else ""
            log.warning("%s; %s scored 0%s", error, self.sample(indices[0]), more)


class ProcessRewarder:
    """Scores samples with a task's weighted reward functions in worker processes; implements `Rewarder`.

    `rewards`: `Reward`s, functions (weight 1) or `(function, weight)` pairs; module-level functions,
    picklable by reference (workers import them). With a batched reward function the batch is split
    into one job per worker, each with a deadline of `timeout_s` per sample in it; otherwise each sample
    is a job of its own. See the module doc for what each failure costs.

    Attributes:
        num_timeouts: samples whose job hit its deadline since construction.
        num_errors: samples a reward function failed on (raised, returned no finite number), or whose
            worker died.
    """

    def __init__(self, rewards: Sequence, config: RewardConfig) -> None:
        self.config = config
        self.rewards = as_rewards(rewards)
        if not self.rewards:
            raise ValueError("a rewarder needs at least one reward function")
        self._batched = any(r.batched for r in self.rewards)
        self._payload: bytes | None = None
        self._workers: list[_Worker] = []
        self.num_timeouts = 0
        self.num_errors = 0

    @property
    def num_failures(self) -> int:
        """Samples scored 0 because a reward function failed or missed its deadline."""
        return self.num_timeouts + self.num_errors

    def setup(self) -> None:
        """Starts the workers (each imports the reward functions' modules once)."""
        if self._payload is None:
            self._payload = pickle.dumps(self.rewards)
        while len(self._workers) < self.config.num_workers:
            self._workers.append(self._new_worker())

    def _new_worker(self) -> _Worker:
        assert self._payload is not None
        return _Worker(self._payload, _main_script())

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

    def score(
        self,
        prompts: list[Messages],
        completions: list[str],
        rows: list[dict],
        *,
        progress: Callable[[], None] | None = None,
    ) -> list[float]:
        """One weighted reward per sample, in order; 0.0 for samples whose scoring timed out or failed.
        `progress` is called each time a worker's job ends (scored, failed or timed out)."""
        if not len(prompts) == len(completions) == len(rows):
            raise ValueError(f"{len(prompts)} prompts, {len(completions)} completions and {len(rows)} rows")
        self.setup()
        batch = _Batch(prompts, completions, rows, scores=[0.0] * len(completions))
        jobs = self._jobs(len(completions))
        remaining = len(completions)
        try:
            while remaining:
                now = time.monotonic()
                for worker in self._workers:
                    if worker.ready and worker.job is None and jobs:
                        worker.give(jobs.pop(), batch, self.config.timeout_s)
                self._grow(jobs, now)
                busy = [w for w in self._workers if w.job is not None or not w.ready]
                wake = min(w.deadline for w in busy)
                if jobs:  # check again soon whether the workers now all wait
                    wake = min(wake, now + PATIENCE_S / 2)
                readable = wait([w.conn for w in busy], timeout=max(0.0, wake - time.monotonic()))
                for worker in busy:
                    if worker.conn in readable:
                        remaining -= self._receive(worker, batch)
                    elif time.monotonic() >= worker.deadline:
                        remaining -= self._lost(worker, batch, timed_out=True)
                    else:
                        continue
                    if progress is not None:
                        progress()
        finally:
            self._shrink()
            batch.report()
        return batch.scores

    def _jobs(self, num: int) -> list[list[int]]:
        """The jobs of a batch of `num` samples, last first (popped from the end: they go out in order)."""
        if self._batched:
            size = max(1, -(-num // self.config.num_workers))
            jobs = [list(range(first, min(first + size, num))) for first in range(0, num, size)]
        else:
            jobs = [[i] for i in range(num)]
        return jobs[::-1]

    def _grow(self, jobs: list[list[int]], now: float) -> None:
        """Starts as many workers again as wait on their job, when all of them do (see the module doc)."""
        if not jobs or any(w.job is None for w in self._workers):  # idle or starting: help is on its way
            return
        waiting = sum(w.waiting(now) for w in self._workers)
        if waiting < len(self._workers):
            return
        room = self.config.num_workers + MAX_EXTRA_WORKERS - len(self._workers)
        for _ in range(min(waiting, room, len(jobs))):
            self._workers.append(self._new_worker())

    def _shrink(self) -> None:
        """Stops the workers started beyond `num_workers` for this batch."""
        while len(self._workers) > self.config.num_workers:
            self._workers.pop().stop()

    def _receive(self, worker: _Worker, batch: _Batch) -> int:
        """Handles a readable socket; returns the number of samples finished."""
        try:
            job, values, errors = worker.conn.recv()
        except (EOFError, OSError):  # the worker died (segfault, OOM kill, os._exit in a reward function)
            return self._lost(worker, batch, timed_out=False)
        if job == "ready":
            worker.ready = True
            return 0
        for index, value, error in zip(job, values, errors, strict=True):
            batch.scores[index] = value
            if error is not None:
                self.num_errors += 1
                batch.fail(index, error)
        worker.job = None
        return len(job)

    def _lost(self, worker: _Worker, batch: _Batch, *, timed_out: bool) -> int:
        """Kills `worker` (past its deadline, or dead), starts a fresh one in its place if the pool is
        short of `num_workers`; its job's samples score 0. Returns the number of samples finished."""
        job = worker.job
        if job is None and not worker.ready:
            if timed_out:
                raise RuntimeError(
                    f"a reward worker did not start within {_START_TIMEOUT_S:.0f} s; are the reward "
                    "functions importable in a fresh process?"
                )
            raise RuntimeError(
                f"a reward worker died while starting (exit code {worker.exit_code()}); are the reward "
                "functions importable in a fresh process? (its error is printed above)"
            )
        k, _ = worker.calling()
        culprit = f"reward function {self.rewards[k].name!r}" if k >= 0 else "the reward functions"
        code = None if timed_out else worker.exit_code()
        worker.kill()
        self._workers.remove(worker)
        if len(self._workers) < self.config.num_workers:
            self._workers.append(self._new_worker())
        if job is None:
            return 0
        if timed_out:
            self.num_timeouts += len(job)
            error = f"{culprit} timed out after {self.config.timeout_s * len(job):.1f} s"
        else:
            self.num_errors += len(job)
            error = f"the reward worker died (exit code {code}) in {culprit}"
        for index in job:
            batch.scores[index] = 0.0
            batch.fail(index, error)
        return len(job)
