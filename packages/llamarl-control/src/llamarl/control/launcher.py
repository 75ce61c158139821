"""Starts the ranks of a run through torch elastic (what `torchrun` uses) and reports failures once.

Every rank runs `llamarl.control.spmd.run_rank`. When any rank raises or dies, torch elastic
stops the others. With `max_restarts` R > 0 it then starts all ranks again, up to R times, and every
restarted rank resumes from the latest complete checkpoint by itself. When no restart is left the
launcher shows the first rank's original error (written by the rank itself to OUTPUT_DIR/errors/) once,
and raises `RunFailed`; Ctrl-C or SIGTERM stops every rank and raises `RunInterrupted`, which says
where the last checkpoint is (`llamarl.control.failures`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import sys
import time
import traceback
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from llamarl.control.cli import RESOLVED_CONFIG, write_config
from llamarl.control.config import RunConfig, replace_in
from llamarl.control.failures import (
    Interrupted,
    MemoryWatch,
    RunFailed,
    RunInterrupted,
    describe_killed,
    describe_record,
    error_record,
    last_checkpoint_note,
    prepare_output_dir,
    raise_on_interrupt,
    read_error_records,
    reserve_error_record,
    write_error_record,
)
from llamarl.control.faults import ERRORS_DIR
from llamarl.control.net import free_port
from llamarl.control.spmd import run_rank
from llamarl.control.tasks import Example

__all__ = ["RunFailed", "RunInterrupted", "launch"]

EXIT_GRACE_S = 2.0  # how long a failed rank waits before exiting, see _rank_main
SHUTDOWN_TIMEOUT_S = 30  # after Ctrl-C or SIGTERM, how long ranks get to close before they are killed
# Ranks are the big consumers of memory: the kernel's out-of-memory killer takes them before the
# launcher, which then lives to say what happened.
RANK_OOM_SCORE_ADJ = 300


def launch(config: RunConfig, train_examples: list[Example], eval_examples: list[Example]) -> dict[str, Any]:
    """Runs the job on `config.world_size` ranks and returns the trainer's summary.

    Writes the resolved config to OUTPUT_DIR/config.toml first: `--config` reruns it.
    """
    output_dir = config.output_dir
    prepare_output_dir(output_dir)
    write_config(config, output_dir / RESOLVED_CONFIG)
    errors_dir = output_dir / ERRORS_DIR
    shutil.rmtree(errors_dir, ignore_errors=True)
    errors_dir.mkdir()
    launch = config.launch
    endpoint = launch.rdzv_endpoint or f"127.0.0.1:{free_port('127.0.0.1')}"
    launch_config = LaunchConfig(
        min_nodes=launch.nnodes,
        max_nodes=launch.nnodes,
        nproc_per_node=config.world_size // launch.nnodes,
        run_id=f"llamarl-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint=endpoint,
        rdzv_configs={"join_timeout": launch.timeout_s},
        max_restarts=launch.max_restarts,  # restarted ranks resume from the latest checkpoint
        monitor_interval=0.2,
        start_method="spawn",
        logs_specs=DefaultLogsSpecs(log_dir=str(output_dir / "logs")),
        shutdown_timeout=SHUTDOWN_TIMEOUT_S,
    )
    # A rank that dies without cleaning up (killed, or failed: it exits at once) leaves a semaphore of
    # its progress bar registered with the launcher's multiprocessing resource tracker, which would warn
    # about it in two lines of noise after the one that says what happened: the tracker (started with
    # this process's warning options) is told to keep quiet about it.
    sys.warnoptions.append("ignore:resource_tracker:UserWarning")
    # torch elastic logs every child failure at ERROR with its traceback; we show it once ourselves.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    logging.getLogger("torch.multiprocessing").setLevel(logging.ERROR)  # "Terminating process ..." notes
    start = time.perf_counter()
    try:
        with MemoryWatch() as memory:
            results = elastic_launch(launch_config, _rank_main)(
                config, train_examples, eval_examples, str(errors_dir)
            )
    except SignalException as e:  # Ctrl-C or SIGTERM: torch elastic stopped every rank
        raise _interrupted(output_dir, int(e.sigval)) from None
    except KeyboardInterrupt:  # before torch elastic took over the signals
        raise _interrupted(output_dir, signal.SIGINT) from None
    except ChildFailedError as e:
        raise _first_failure(errors_dir, e, memory, output_dir, config) from None
    summary = results[0]
    # The ranks measured their own run; the whole command also pays for process start and model loads.
    summary["wall_s"] = time.perf_counter() - start
    summary_path = output_dir / "summary.json"
    summary_path.write_text(
        json.dumps({**json.loads(summary_path.read_text()), "wall_s": summary["wall_s"]}, indent=2) + "\n"
    )
    return summary


def _rank_main(
    config: RunConfig, train_examples: list[Example], eval_examples: list[Example], errors_dir: str
) -> dict[str, Any] | None:
    """The body of every rank. On error it records its traceback and exits non-zero without printing;
    SIGINT and SIGTERM stop it (its side closes its engines and workers) the same way."""
    record_path = Path(errors_dir, f"rank{os.environ.get('RANK', -1)}.json")
    try:
        raise_on_interrupt()
        reserve_error_record(record_path)
        _prefer_for_oom_kill()
        if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
            # torch elastic restarted the ranks after a failure: continue from the latest checkpoint.
            config = replace_in(config, **{"checkpoint.resume": True})
        torch.set_num_threads(config.ranks.threads_per_rank or _default_threads(config))
        _quiet_libraries()
        _init_default_group(config.launch.timeout_s)
        summary = run_rank(config, train_examples, eval_examples)  # closes its side, also on failure
        dist.destroy_process_group()
        return summary
    except BaseException as e:
        rank = int(os.environ.get("RANK", -1))
        record = error_record(rank, e, traceback.format_exc())
        write_error_record(record_path, record)
        if isinstance(e, Interrupted):
            os._exit(128 + e.signum)
        # Torch elastic reports only the first exit it sees. A rank failing because a peer was killed
        # (closed connection) must not exit before the launcher has seen that peer's death, or the
        # run would be blamed on the wrong rank; a short grace period orders the two exits.
        time.sleep(max(0.0, record["time"] + EXIT_GRACE_S - time.time()))
        os._exit(1)  # no traceback on stderr: the launcher prints the first failure once


def _prefer_for_oom_kill() -> None:
    with contextlib.suppress(OSError):  # not Linux, or not allowed: the kernel picks as it would anyway
        Path("/proc/self/oom_score_adj").write_text(str(RANK_OOM_SCORE_ADJ))


def _init_default_group(timeout_s: float) -> None:
    """The default (gloo) process group, on a store namespace of its own for each restart attempt.

    Under torch elastic the ranks reach the agent's store, which outlives a restart; with plain env://
    init a restarted rank could read the gloo address a killed rank of the previous attempt left there
    and time out connecting to it (seen here: restarted ranks that never met). Prefixing the keys with
    the attempt number keeps every attempt to its own.
    """
    timeout = timedelta(seconds=timeout_s)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
        dist.init_process_group("gloo", timeout=timeout)
        return
    agent_store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout
    )
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore(f"llamarl/attempt{attempt}/", agent_store),
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        timeout=timeout,
    )


def _quiet_libraries() -> None:
    """Per-rank progress bars of model loading would interleave with the run's own progress bar."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def _default_threads(config: RunConfig) -> int:
    cores = os.cpu_count() or 1
    if config.schedule.mode == "sync":
        return cores  # ranks take turns, so each may use every core
    per_node = config.world_size // config.launch.nnodes
    return max(1, cores // per_node)


def _first_failure(
    errors_dir: Path,
    error: ChildFailedError,
    memory: MemoryWatch | None,
    output_dir: Path,
    config: RunConfig | None = None,
) -> RunFailed | RunInterrupted:
    """The failure that started it: a rank killed by a signal, else the earliest recorded error.

    Later errors are usually peers noticing the first one (a closed connection), and ranks that
    torch elastic stopped (SIGTERM) after it, so they are not shown. Only when every failed rank was
    stopped by a signal sent to it (not to the launcher) is the run reported as interrupted.
    """
    records = read_error_records(errors_dir)
    # A rank that died without raising (killed, out of memory, segfault) recorded nothing.
    for rank, failure in sorted(error.failures.items()):
        if rank not in records and failure.exitcode < 0 and failure.signal_name() != "SIGTERM":
            line = describe_killed(rank, failure.pid, failure.signal_name(), memory)
            if config is not None:  # which executor died: "rank 3 (reward) died ..."
                line = line.replace(f"rank {rank} ", f"rank {rank} ({config.role_of(rank)}) ", 1)
            return RunFailed(line, rank=rank)
    failed = [r for r in records.values() if not r.get("interrupted")]
    if failed:
        first = min(failed, key=lambda r: r["time"])
        return RunFailed(describe_record(first, errors_dir), rank=first["rank"])
    if records:  # SIGINT or SIGTERM sent to the ranks themselves
        first = min(records.values(), key=lambda r: r["time"])
        return _interrupted(output_dir, signal.Signals[first["error"].split(": ", 1)[1]])
    rank, failure = error.get_first_failure()
    return RunFailed(f"rank {rank} exited with code {failure.exitcode}", rank=rank)


def _interrupted(output_dir: Path, signum: int) -> RunInterrupted:
    name = signal.Signals(signum).name
    return RunInterrupted(
        f"interrupted ({name}): every process of the run stopped; {last_checkpoint_note(output_dir)}",
        signum=int(signum),
    )
