"""A small multi-process harness for testing distributed code for real, on CPU, with gloo.

``run_distributed(fn, world_size, *args)`` spawns ``world_size`` processes that each call
``fn(rank, world_size, rendezvous, *args)``. Every child runs with one torch thread (test machines are
small and shared). A child that raises has its traceback re-raised in the parent, naming its rank, and
the other children are killed; a run that exceeds ``timeout_s`` kills every child and raises. The
rendezvous offers a free port on the loopback interface and a fresh file path, never a fixed port.

``fn`` may live in a pytest test module collected with ``--import-mode=importlib`` (such modules cannot
be imported by name in a spawned child): the harness ships the module's file path and loads it there.
``args`` and the values returned by ``fn`` must be picklable plain data (ints, strings, tensors, ...).
"""

from __future__ import annotations

import importlib
import importlib.util
import multiprocessing as mp
import os
import pickle
import queue
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["DistributedTestError", "Rendezvous", "free_port", "run_distributed"]


def free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port that was free on ``host`` a moment ago (the OS picks it; never a fixed port)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


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


def _child_main(
    fn_ref: tuple[str, str | None, str],
    rank: int,
    world_size: int,
    rendezvous: Rendezvous,
    args: tuple[Any, ...],
    results: Any,
) -> None:
    import torch

    # Test machines are small and shared: one intra-op thread per rank.
    torch.set_num_threads(1)
    try:
        fn = _load_callable(*fn_ref)
        value = fn(rank, world_size, rendezvous, *args)
        # Plain pickle copies tensor bytes; the queue's own pickler would pass shared-memory handles
        # that die with this process.
        results.put((rank, "ok", pickle.dumps(value)))
        results.close()
        results.join_thread()
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
        # Flush the queue's feeder thread before leaving, so the parent sees the traceback.
        results.close()
        results.join_thread()
        os._exit(1)


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 120.0,
    host: str = "127.0.0.1",
) -> list[Any]:
    """Run ``fn(rank, world_size, rendezvous, *args)`` in ``world_size`` spawned processes.

    Returns the list of values returned by ``fn``, indexed by rank. Raises ``DistributedTestError``
    with the first failing child's traceback (and its rank) after killing the others, when a child
    dies without a traceback (e.g. killed by a signal), or when the run exceeds ``timeout_s``.
    """
    module = sys.modules.get(fn.__module__)
    fn_ref = (fn.__module__, getattr(module, "__file__", None), fn.__qualname__)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    values: dict[int, Any] = {}
    with tempfile.TemporaryDirectory(prefix="llamarl-dist-") as tmpdir:
        rendezvous = Rendezvous(
            host=host, port=free_port(host), file=os.path.join(tmpdir, "rendezvous"), tmpdir=tmpdir
        )
        procs = [
            ctx.Process(
                target=_child_main,
                args=(fn_ref, rank, world_size, rendezvous, args, results),
                name=f"llamarl-rank{rank}",
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for proc in procs:
            proc.start()
        deadline = time.monotonic() + timeout_s
        failure: str | None = None
        try:
            while len(values) < world_size and failure is None:
                try:
                    rank, status, payload = results.get(timeout=0.05)
                except queue.Empty:
                    if time.monotonic() > deadline:
                        pending = [r for r in range(world_size) if r not in values]
                        failure = f"timed out after {timeout_s:.0f}s; ranks still running: {pending}"
                        break
                    # A child that died without reporting (SIGKILL, os._exit, segfault) is a failure,
                    # unless its report is still in flight: give the queue a moment first.
                    for r, proc in enumerate(procs):
                        if r not in values and proc.exitcode is not None and proc.exitcode != 0:
                            time.sleep(0.2)
                            try:
                                rank, status, payload = results.get(timeout=0.5)
                            except queue.Empty:
                                failure = f"rank {r} exited with code {proc.exitcode} without a traceback"
                            break
                    else:
                        continue
                    if failure is not None:
                        break
                if status == "ok":
                    values[rank] = pickle.loads(payload)
                else:
                    failure = f"rank {rank} failed:\n{payload}"
        finally:
            for proc in procs:
                proc.join(timeout=5.0 if failure is None else 0.0)
            for proc in procs:
                if proc.is_alive():
                    proc.kill()
                    proc.join(timeout=5.0)
            results.close()
        if failure is not None:
            raise DistributedTestError(failure)
    return [values[r] for r in range(world_size)]
