"""A small multi-process harness for testing distributed code for real, on CPU, with gloo.

``run_distributed(fn, world_size, *args)`` spawns ``world_size`` processes that each call
``fn(rank, world_size, rendezvous, *args)``. Every child runs with one torch thread (test machines are
small and shared). A child that raises has its traceback re-raised in the parent, naming its rank, and
the other children are killed; a run that exceeds ``timeout_s`` kills every child and raises. The
rendezvous offers a free port on the loopback interface and a fresh file path, never a fixed port.

``fn`` may live in a pytest test module collected with ``--import-mode=importlib`` (such modules cannot
be imported by name in a spawned child): the harness ships the module's file path and loads it there.
``args`` and the values returned by ``fn`` must be picklable plain data (ints, strings, tensors, ...).

Importing torch takes tens of seconds on a loaded 2-core machine, so the processes are kept in a pool
and reused by later calls (each call still gets a fresh rendezvous; a default process group a call left
initialised is destroyed after it). A worker that fails, dies or overruns is killed and replaced. Set
``LLAMARL_TEST_FRESH_PROCESSES=1`` (or pass ``fresh=True``) for brand-new processes on every call.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import importlib
import importlib.util
import multiprocessing as mp
import os
import pickle
import queue
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from llamarl.comm.transport import free_port

__all__ = [
    "DistributedPool",
    "DistributedTestError",
    "Rendezvous",
    "free_port",
    "run_distributed",
    "wait_until",
]


@dataclass(frozen=True, kw_only=True)
class Rendezvous:
    """Where the processes of one ``run_distributed`` call meet."""

    host: str  # loopback address every child can reach
    port: int  # a port that was free when the run started; use it for one TCPStore
    file: str  # a path that does not exist yet, in a directory removed after the run (file:// init)
    tmpdir: str  # a scratch directory shared by all ranks of this run

    @property
    def init_method(self) -> str:
        """A ``torch.distributed.init_process_group`` init method: ``file://`` on ``self.file``."""
        return f"file://{self.file}"


# After one rank fails, how long the others get to report their own failures (or results).
FAILURE_GRACE_S = 3.0


class DistributedTestError(RuntimeError):
    """A child failed (its traceback is in the message) or the run timed out."""


def _load_callable(module_name: str, module_file: str | None, qualname: str) -> Callable[..., Any]:
    """Find ``fn`` in a child: import its module by name, or load it from its file."""
    module = sys.modules.get(module_name)
    if module is None:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            if module_file is None:
                raise
            spec = importlib.util.spec_from_file_location(module_name, module_file)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            sys.modules[module_name] = module
            spec.loader.exec_module(module)
    obj: Any = module
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _run_task(task: tuple[Any, ...]) -> tuple[int, int, str, Any]:
    call_id, fn_ref, rank, world_size, rendezvous, args = task
    try:
        fn = _load_callable(*fn_ref)
        value = fn(rank, world_size, rendezvous, *args)
        # Plain pickle copies tensor bytes; the queue's own pickler would pass shared-memory handles
        # that die with this process.
        return call_id, rank, "ok", pickle.dumps(value)
    except BaseException:
        return call_id, rank, "error", traceback.format_exc()
    finally:
        import torch.distributed as dist

        # A call that left torch's default group up must not leak it into the next call.
        if dist.is_available() and dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
        # Objects of this call caught in reference cycles (a process group held by an exception's
        # frames) are destroyed now, in the process that owns their threads, not in a child that a
        # later call forks, where those threads do not exist.
        gc.collect()


def _worker_main(tasks: Any, results: Any) -> None:
    import torch

    # Test machines are small and shared: one intra-op thread per rank.
    torch.set_num_threads(1)
    parent = os.getppid()
    while True:
        try:
            task = tasks.get(timeout=1.0)
        except queue.Empty:
            if os.getppid() != parent:
                return  # the test process is gone: do not linger as an orphan
            continue
        if task is None:
            return
        results.put(_run_task(task))


class DistributedPool:
    """Spawned worker processes, reused across ``run`` calls; worker ``i`` plays rank ``i``."""

    def __init__(self, *, host: str = "127.0.0.1") -> None:
        self.host = host
        self._ctx = mp.get_context("spawn")
        self._workers: list[tuple[Any, Any, Any] | None] = []  # (process, tasks, results)
        self._next_call = 0

    def _worker(self, rank: int) -> tuple[Any, Any, Any]:
        while len(self._workers) <= rank:
            self._workers.append(None)
        worker = self._workers[rank]
        if worker is None or not worker[0].is_alive():
            tasks, results = self._ctx.Queue(), self._ctx.Queue()
            proc = self._ctx.Process(
                target=_worker_main,
                args=(tasks, results),
                name=f"llamarl-rank{rank}",
                # Not a daemon, so a test may fork a child from its rank (to kill a real process);
                # the pool is closed at exit, and a worker whose parent vanished stops by itself.
                daemon=False,
            )
            proc.start()
            worker = (proc, tasks, results)
            self._workers[rank] = worker
        return worker

    def _kill(self, rank: int) -> None:
        worker = self._workers[rank]
        if worker is not None:
            proc, tasks, results = worker
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=5.0)
            for q in (tasks, results):
                q.cancel_join_thread()
                q.close()
            self._workers[rank] = None

    def run(
        self,
        fn: Callable[..., Any],
        world_size: int,
        *args: Any,
        timeout_s: float = 120.0,
        may_die: tuple[int, ...] = (),
    ) -> list[Any]:
        """Run ``fn(rank, world_size, rendezvous, *args)`` on ranks ``0..world_size-1``; see the module doc.

        Ranks in ``may_die`` may exit without a result (their value is None) without failing the run.
        """
        module = sys.modules.get(fn.__module__)
        fn_ref = (fn.__module__, getattr(module, "__file__", None), fn.__qualname__)
        self._next_call += 1
        call_id = self._next_call
        with tempfile.TemporaryDirectory(prefix="llamarl-dist-") as tmpdir:
            rendezvous = Rendezvous(
                host=self.host,
                port=free_port(self.host),
                file=os.path.join(tmpdir, "rendezvous"),
                tmpdir=tmpdir,
            )
            workers = [self._worker(rank) for rank in range(world_size)]
            for rank, (_, tasks, _) in enumerate(workers):
                tasks.put((call_id, fn_ref, rank, world_size, rendezvous, args))
            reports = _Reports(workers, call_id, may_die)
            failure = reports.wait(timeout_s)
            for rank in range(world_size):
                # Failed runs may leave ranks blocked on dead peers; dead ranks need replacing.
                if failure is not None or not workers[rank][0].is_alive():
                    self._kill(rank)
        if failure is not None:
            raise DistributedTestError(failure)
        return [reports.values[r] for r in range(world_size)]

    def close(self) -> None:
        """Stop every worker."""
        for rank, worker in enumerate(self._workers):
            if worker is not None:
                try:
                    worker[1].put(None)
                    worker[0].join(timeout=2.0)
                except Exception:
                    pass
                self._kill(rank)
        self._workers.clear()


class _Reports:
    """What the ranks of one ``DistributedPool.run`` call reported: values, failures, silent deaths."""

    def __init__(self, workers: list[tuple[Any, Any, Any]], call_id: int, may_die: tuple[int, ...]) -> None:
        self.workers = workers  # (process, tasks, results) per rank
        self.call_id = call_id
        self.may_die = may_die
        self.values: dict[int, Any] = {}
        self.failures: dict[int, str] = {}  # rank -> why it failed
        self.dead_since: dict[int, float] = {}

    def wait(self, timeout_s: float) -> str | None:
        """Polls until every rank reported, or one failed (then waits ``FAILURE_GRACE_S`` more for the
        others' reports), or ``timeout_s`` passed; returns the failures' text, None when all succeeded."""
        deadline = time.monotonic() + timeout_s
        grace_until: float | None = None  # after a first failure: how long to wait for the others
        while len(self.values) + len(self.failures) < len(self.workers):
            if grace_until is not None and time.monotonic() > grace_until:
                break
            progressed = self.poll()
            if self.failures and grace_until is None:
                # A rank that fails often makes its peers fail too (a reset connection): wait a
                # moment for their reports, so the root cause is shown, not only its echo.
                grace_until = time.monotonic() + FAILURE_GRACE_S
            if not self.failures and time.monotonic() > deadline:
                pending = [r for r in range(len(self.workers)) if r not in self.values]
                self.failures[-1] = f"timed out after {timeout_s:.0f}s; ranks still running: {pending}"
                break
            if not progressed:
                time.sleep(0.02)
        return "\n".join(self.failures[r] for r in sorted(self.failures)) if self.failures else None

    def poll(self) -> bool:
        """Reads at most one report from each rank still running; whether any came."""
        progressed = False
        for rank in range(len(self.workers)):
            if rank not in self.values and rank not in self.failures:
                progressed = self._poll_rank(rank) or progressed
        return progressed

    def _poll_rank(self, rank: int) -> bool:
        proc, _, results = self.workers[rank]
        try:
            got_call, got_rank, status, payload = results.get_nowait()
        except queue.Empty:
            if not proc.is_alive():
                # Give a report still in the pipe a moment before calling it a death.
                first = self.dead_since.setdefault(rank, time.monotonic())
                if time.monotonic() - first > 0.5:
                    if rank in self.may_die:
                        self.values[rank] = None
                    else:
                        self.failures[rank] = (
                            f"rank {rank} exited with code {proc.exitcode} without a traceback"
                        )
            return False
        if got_call != self.call_id:
            return True  # a stale report from a call that was abandoned
        if status == "ok":
            self.values[got_rank] = pickle.loads(payload)
        else:
            self.failures[got_rank] = f"rank {got_rank} failed:\n{payload}"
        return True


_POOL: DistributedPool | None = None


def _shared_pool() -> DistributedPool:
    global _POOL
    if _POOL is None:
        _POOL = DistributedPool()
        atexit.register(_POOL.close)
    return _POOL


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 120.0,
    may_die: tuple[int, ...] = (),
    fresh: bool = False,
) -> list[Any]:
    """Run ``fn(rank, world_size, rendezvous, *args)`` in ``world_size`` processes (one thread each).

    Returns the values returned by ``fn``, indexed by rank. Raises ``DistributedTestError`` when a child
    raises, when one dies without a traceback (e.g. killed by a signal; unless its rank is in
    ``may_die``), or when the run exceeds ``timeout_s``: with every failing child's traceback and rank
    (after a first failure the others get ``FAILURE_GRACE_S`` to report), the rest killed. Processes
    come from a shared pool unless ``fresh`` (or ``LLAMARL_TEST_FRESH_PROCESSES=1``) asks for new ones.
    """
    if fresh or os.environ.get("LLAMARL_TEST_FRESH_PROCESSES") == "1":
        pool = DistributedPool()
        try:
            return pool.run(fn, world_size, *args, timeout_s=timeout_s, may_die=may_die)
        finally:
            pool.close()
    return _shared_pool().run(fn, world_size, *args, timeout_s=timeout_s, may_die=may_die)


def wait_until(
    read: Callable[[], Any],
    until: Callable[[Any], bool] = bool,
    *,
    timeout_s: float,
    what: str,
    poll_s: float = 0.02,
) -> Any:
    """Polls ``read()`` until ``until(value)`` holds (default: the value is truthy) and returns that value.

    What a test waits on with it is an event another process makes (a file, a key in a store, a version
    reported), never a guess of how long that takes: a fast machine returns at once, a loaded one waits
    longer, and only a missing event waits out ``timeout_s``, then raises ``TimeoutError`` naming
    ``what`` and the last value read.
    """
    deadline = time.monotonic() + timeout_s
    value = read()
    while not until(value):
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout_s:.0f} s for {what}; last read {value!r}")
        time.sleep(poll_s)
        value = read()
    return value
