"""Starts the ranks of a run through torch elastic (what `torchrun` uses) and reports failures once.

Every rank runs `llamarl.control.launch.spmd.run_rank`. When any rank raises or dies, torch elastic
stops the others. With `max_restarts` R > 0 it then starts all ranks again, up to R times, and every
restarted rank resumes from the latest complete checkpoint by itself. When no restart is left the
launcher shows the first rank's original error (written by the rank itself to OUTPUT_DIR/errors/) once,
and raises `RunFailed`; Ctrl-C or SIGTERM stops every rank and raises `RunInterrupted`, which says
where the last checkpoint is (`llamarl.control.launch.failures`).

Several machines: the same command on each (`--nnodes N --rdzv-endpoint HOST:PORT`) joins one
rendezvous, whose id every machine derives alike (`launch.rdzv_id`); torch elastic gives the machines
their ranks in order. The machine that holds the first trainer rank gets the summary; the others learn
where it is. A machine that goes away is named by the others (`llamarl.control.launch.nodes`); with
`max_restarts` the job waits (up to `launch.timeout_s`) for it to come back and resumes from the latest
checkpoint. Under `torchrun` (or Slurm's srun of it), each process is one rank: `run_this_rank`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing.forkserver
import os
import signal
import socket
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous.api import RendezvousError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from llamarl.comm import free_port
from llamarl.control.config import ConfigError, RunConfig, replace_in
from llamarl.control.launch import lifeline
from llamarl.control.launch.devices import check_placement
from llamarl.control.launch.failures import (
    OomBaseline,
    RunFailed,
    RunInterrupted,
    describe_killed,
    describe_record,
    discard_unused_error_records,
    last_checkpoint_note,
    read_error_records,
    timed_out,
)
from llamarl.control.launch.memory import ProcessTreeMemory, memory_summary, own_peak
from llamarl.control.launch.nodes import describe_lost
from llamarl.control.launch.output_dir import hold_output_dir, prepare_output_dir, write_resolved_config
from llamarl.control.launch.progress import describe_stall, read_progress, stalled_rank
from llamarl.control.launch.rank import rank_main, run_rank_process
from llamarl.control.outputs.report import write_report
from llamarl.control.run.channels.weights import FIRST_TRAINER_RANK
from llamarl.control.run.faults import ERRORS_DIR
from llamarl.control.tasks import Task
from llamarl.control.tasks.registry import load_task

__all__ = ["Launched", "RunFailed", "RunInterrupted", "launch", "run_this_rank"]

SHUTDOWN_TIMEOUT_S = 30  # after Ctrl-C or SIGTERM, how long ranks get to close before they are killed
# What every rank imports, loaded once in the server the ranks fork from: the ranks' code and the parts
# of transformers that every causal LM's module imports (transformers loads those lazily).
RANK_PRELOAD = [
    "llamarl.control.launch.spmd",
    *(f"transformers.{m}" for m in ("generation", "masking_utils", "modeling_layers", "modeling_utils")),
]


@dataclass(frozen=True)
class Launched:
    """What a finished job left on this machine."""

    summary: dict[str, Any] | None
    """the trainer's summary, on the machine of the first trainer rank (None on the others)"""
    summary_path: Path
    """OUTPUT_DIR/summary.json, on the machine of the first trainer rank"""
    summary_host: str
    """that machine (torch elastic's MASTER_ADDR)"""


@dataclass(frozen=True)
class _Job:
    """One launch of the ranks on this machine: where they meet and what they run."""

    config: RunConfig
    task: Task
    train_rows: list[dict]
    eval_rows: list[dict]
    endpoint: str
    run_id: str
    errors_dir: Path
    log_dir: Path


def launch(
    config: RunConfig, train_rows: list[dict], eval_rows: list[dict], task: Task | None = None
) -> Launched:
    """Runs the job on `config.world_size` ranks (this machine's share of them with `launch.nnodes` >
    1) and returns what it left here. `task`: the task object when it was given in code
    (`llamarl.control.train`); by default the one `config.task` names.

    Holds the output folder for the run (`llamarl.control.launch.output_dir`) and writes the resolved
    config to OUTPUT_DIR/config.toml first: `--config` reruns it.

    Raises:
        ConfigError: the ranks do not fit this machine's GPUs, or another run holds the output folder
            (one line, before any rank starts).
        RunFailed: a rank failed, a machine was lost, or the machines never met (one line, or the
            first failed rank's traceback).
        RunInterrupted: Ctrl-C or SIGTERM stopped every rank (says where the last checkpoint is).
    """
    task = task if task is not None else load_task(config.task.name, config.task.module)
    check_placement(
        config,
        ranks_per_node=config.world_size // config.launch.nnodes,
        cuda_devices=torch.cuda.device_count(),
    )
    endpoint, run_id = _rendezvous(config)
    output_dir = config.output_dir
    with hold_output_dir(output_dir, run_id):
        write_resolved_config(config)
        # Shared by every machine where OUTPUT_DIR is: never cleared here (another machine's rank may
        # already have written into it); each rank removes its own stale record when it starts.
        errors_dir = output_dir / ERRORS_DIR
        errors_dir.mkdir(exist_ok=True)
        # Each machine logs into a folder of its own, also where OUTPUT_DIR is shared.
        log_dir = output_dir / "logs" / f"{socket.gethostname()}-{os.getpid()}"
        config = _resume_only_from_a_checkpoint(config)
        job = _Job(config, task, train_rows, eval_rows, endpoint, run_id, errors_dir, log_dir)
        start = time.perf_counter()
        try:
            results, memory = _run_ranks(job)
        finally:
            if config.launch.nnodes == 1:  # (elsewhere other machines' ranks may still use theirs)
                discard_unused_error_records(errors_dir)
                with contextlib.suppress(OSError):  # a run that nothing went wrong in leaves no errors/
                    errors_dir.rmdir()
        return _finish(config, results, memory, wall_s=time.perf_counter() - start)


def run_this_rank(
    config: RunConfig, train_rows: list[dict], eval_rows: list[dict], task: Task | None = None
) -> Launched | None:
    """This process's rank, when `torchrun` (or srun of it) started it: the same body as the ranks
    `launch` starts. Returns what `launch` returns on the first trainer rank, None on the others.
    The first trainer rank holds the output folder for the run.

    Raises:
        ConfigError: torchrun started another number of ranks than the config has, they do not fit
            this machine's GPUs, or another run holds the output folder.
        RunFailed: this rank failed (one line; the traceback is in OUTPUT_DIR/errors/rank{r}.json).
    """
    world_size, local_world_size = int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_WORLD_SIZE"])
    if world_size != config.world_size:
        raise ConfigError(
            f"torchrun started {world_size} ranks; this config has {config.world_size} "
            "(ranks.num_trainers + ranks.num_generators): give torchrun --nnodes x --nproc-per-node that many"
        )
    check_placement(config, ranks_per_node=local_world_size, cuda_devices=torch.cuda.device_count())
    output_dir = config.output_dir
    first = int(os.environ["RANK"]) == FIRST_TRAINER_RANK
    prepare_output_dir(output_dir)
    job = os.environ.get("TORCHELASTIC_RUN_ID", "torchrun")
    with hold_output_dir(output_dir, job) if first else contextlib.nullcontext():
        if first:
            write_resolved_config(config)
        errors_dir = output_dir / ERRORS_DIR
        errors_dir.mkdir(exist_ok=True)
        task = task if task is not None else load_task(config.task.name, config.task.module)
        result = run_rank_process(config, task, train_rows, eval_rows, str(errors_dir), draw_report=True)
    if result["summary"] is None:
        return None
    return Launched(result["summary"], output_dir / "summary.json", result["summary_host"])


def under_torchrun() -> bool:
    """Whether this process is a rank that `torchrun` started (not a launcher that starts ranks)."""
    return "TORCHELASTIC_RUN_ID" in os.environ and "LOCAL_RANK" in os.environ


def _rendezvous(config: RunConfig) -> tuple[str, str]:
    """(endpoint, run id) where this machine's ranks meet the others: on one machine a free local port
    and a fresh id; on several, the ones every machine is given (the c10d rendezvous key is built from
    the run id: every machine must give the same one)."""
    launch = config.launch
    if launch.nnodes == 1 and launch.rdzv_endpoint is None:
        return f"127.0.0.1:{free_port('127.0.0.1')}", f"llamarl-{uuid.uuid4().hex[:8]}"
    return launch.rdzv_endpoint or "", launch.run_id


def _resume_only_from_a_checkpoint(config: RunConfig) -> RunConfig:
    """`--resume` where the folder has no checkpoint to resume from: says so in one line, before any
    rank starts, and starts fresh. (On several machines, whose folders may differ, the first trainer
    rank says it.)"""
    if not config.checkpoint.resume or config.launch.nnodes > 1:
        return config
    from llamarl.control.run.checkpoint import CHECKPOINTS_DIR, find_latest

    root = config.output_dir / CHECKPOINTS_DIR
    if find_latest(root) is not None:
        return config
    print(f"--resume: no complete checkpoint in {root}: starting fresh", file=sys.stderr, flush=True)
    return replace_in(config, **{"checkpoint.resume": False})


def _launch_config(job: _Job) -> LaunchConfig:
    """Torch elastic's settings for `job` on this machine."""
    launch = job.config.launch
    return LaunchConfig(
        min_nodes=launch.nnodes,
        max_nodes=launch.nnodes,
        nproc_per_node=job.config.world_size // launch.nnodes,
        run_id=job.run_id,
        rdzv_backend="c10d",
        rdzv_endpoint=job.endpoint,
        rdzv_configs={"join_timeout": launch.timeout_s},
        max_restarts=launch.max_restarts,  # restarted ranks resume from the latest checkpoint
        monitor_interval=0.2,
        start_method="forkserver",
        logs_specs=DefaultLogsSpecs(log_dir=str(job.log_dir)),
        shutdown_timeout=SHUTDOWN_TIMEOUT_S,
    )


def _run_ranks(job: _Job) -> tuple[dict[int, Any], ProcessTreeMemory]:
    """Starts this machine's ranks through torch elastic and waits for them: their results by global
    rank, and the memory of every process of the run as the launcher saw it. A failure or an interrupt
    is raised as one `RunFailed` or `RunInterrupted`."""
    # A rank that dies without cleaning up (killed, or failed: it exits at once) leaves a semaphore of
    # its progress bar registered with the launcher's multiprocessing resource tracker, which would warn
    # about it in two lines of noise after the one that says what happened: the tracker (started with
    # this process's warning options) is told to keep quiet about it.
    sys.warnoptions.append("ignore:resource_tracker:UserWarning")
    _quiet_torch_elastic()
    started_at, baseline = time.time(), OomBaseline.now()
    memory = ProcessTreeMemory("launcher", at_once=True)
    try:
        with (
            _ranks_log_cpp_errors_only(),
            _ranks_keep_freed_memory(),
            _rank_fork_server(),
            _fresh_store_per_formation(),
            memory,
        ):
            results = elastic_launch(_launch_config(job), rank_main)(
                job.config, job.task, job.train_rows, job.eval_rows, str(job.errors_dir)
            )
    except SignalException as e:  # Ctrl-C or SIGTERM: torch elastic stopped every rank
        raise _interrupted(job.config.output_dir, int(e.sigval)) from None
    except KeyboardInterrupt:  # before torch elastic took over the signals
        raise _interrupted(job.config.output_dir, signal.SIGINT) from None
    except ChildFailedError as e:
        failure = _first_failure(job.errors_dir, e, job.config, memory, baseline, since=started_at)
        raise failure from None
    except RendezvousError as e:
        formed = _ranks_started(job.log_dir)
        raise RunFailed(_rendezvous_failure(job.config, job.endpoint, e, formed=formed), rank=None) from None
    return results, memory


def _finish(
    config: RunConfig, results: dict[int, Any], memory: ProcessTreeMemory, *, wall_s: float
) -> Launched:
    """What the job left here; on the machine of the first trainer rank, its summary completed with
    what only the launcher knows (the whole command's wall time, its own memory), and the report."""
    output_dir = config.output_dir
    summary_path = output_dir / "summary.json"
    # elastic_launch returns this machine's ranks only, by global rank; each says where the summary is.
    summary_host = next(iter(results.values()))["summary_host"]
    if FIRST_TRAINER_RANK not in results:
        return Launched(summary=None, summary_path=summary_path, summary_host=summary_host)
    summary = results[FIRST_TRAINER_RANK]["summary"]
    # The ranks measured their own run; the whole command also pays for process start and model loads,
    # and this process (the launcher) holds memory too.
    assert memory.at_once is not None
    added = {
        "wall_s": wall_s,
        **memory_summary([*summary["memory_per_process"], own_peak("launcher")], memory.at_once.peak_mb),
    }
    summary.update(added)
    summary_path.write_text(json.dumps({**json.loads(summary_path.read_text()), **added}, indent=2) + "\n")
    # The report, with the launcher in its memory line. A picture never fails a finished run.
    try:
        write_report(output_dir)
    except Exception as e:
        print(f"warning: could not draw {output_dir / 'report.png'}: {e}", file=sys.stderr)
    return Launched(summary=summary, summary_path=summary_path, summary_host=summary_host)


def _quiet_torch_elastic() -> None:
    """Torch elastic logs every child failure at ERROR with its traceback, and a warning on every signal
    ("Received 15 death signal, shutting down workers"): the launcher says what happened once, itself.
    Some of its modules set their logger's own level (WARNING), so each is quietened, not only the
    parent; and one race of its shutdown, printed as an ignored exception, is not printed."""
    for name in [*logging.root.manager.loggerDict, "torch.distributed.elastic"]:
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    logging.getLogger("torch.multiprocessing").setLevel(logging.ERROR)  # "Terminating process ..." notes
    previous_hook = sys.unraisablehook

    def without_elastic_keepalive_race(unraisable: Any) -> None:
        # After Ctrl-C, torch elastic's rendezvous keep-alive thread can be collected in itself, and
        # its finalizer's join of that thread raises "cannot join current thread", which Python prints
        # as a traceback under the run's one line (a race: seen once in the suite's Ctrl-C test).
        error, files = unraisable.exc_value, []
        trace = unraisable.exc_traceback
        while trace is not None:
            files.append(trace.tb_frame.f_code.co_filename)
            trace = trace.tb_next
        keepalive = os.path.join("elastic", "rendezvous", "utils.py")
        if (
            isinstance(error, RuntimeError)
            and str(error) == "cannot join current thread"
            and any(name.endswith(keepalive) for name in files)
        ):
            return
        previous_hook(unraisable)

    sys.unraisablehook = without_elastic_keepalive_race


@contextlib.contextmanager
def _rank_fork_server() -> Iterator[None]:
    """Ranks fork from one server process that imported their code once (`RANK_PRELOAD`), instead of
    each importing torch, transformers and llamarl afresh: about 5 CPU seconds saved per rank, and per
    rank that torch elastic restarts. The server stops with the job, so that the ranks of a next job
    launched from the same process inherit the environment of that launch, not of this one.

    The server and every process below it die with this process, however it dies
    (`llamarl.control.launch.lifeline`, imported first). It is started here, by the thread that waits
    for the whole job, since the kernel's parent-death signal comes when the thread that started a
    process exits (torch elastic may start ranks from short-lived threads: TORCH_MP_PARALLEL_START)."""
    multiprocessing.set_forkserver_preload([lifeline.__name__, *RANK_PRELOAD])
    try:
        with _environ(lifeline.SERVER_PARENT_ENV, str(os.getpid())):
            multiprocessing.forkserver.ensure_running()
        yield
    finally:
        multiprocessing.forkserver._forkserver._stop()  # CPython's one way to stop it


@contextlib.contextmanager
def _fresh_store_per_formation() -> Iterator[None]:
    """Has torch elastic give every formation of the ranks a store of its own (hosted by the first
    rank on a port chosen for that formation) instead of one shared by the agent across restarts.

    With the shared store, a restarted rank could read keys a rank of the previous attempt left there,
    and a machine that comes back after a loss counts its attempts from 0 while the others count from
    1, so no per-attempt key prefix is agreed on either. A fresh store per formation needs neither.
    """
    with _environ("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1"):
        yield


@contextlib.contextmanager
def _ranks_log_cpp_errors_only() -> Iterator[None]:
    """When a rank hosting a store dies (killed, out of memory), every other rank's next call on that
    store logs a C++ warning with a C++ stack trace before it raises: a dozen lines of noise after the
    one that says which rank died and why. So the ranks' C++ logs show errors only, unless the user
    set TORCH_CPP_LOG_LEVEL. Torch reads it once, when imported: it is set before the ranks start."""
    with _environ("TORCH_CPP_LOG_LEVEL", "ERROR", unless_set=True):
        yield


@contextlib.contextmanager
def _ranks_keep_freed_memory() -> Iterator[None]:
    """Has glibc's malloc in the ranks keep the memory they free for their next allocations instead of
    handing it back to the kernel, unless the user set these variables.

    A training step allocates and frees tensors of megabytes by the thousand (activations, gradients,
    chunks of logits). By default glibc maps each large one afresh and unmaps it when freed, so the
    kernel faults in and zero-fills every page again: about 400k page faults (1.6 GB zeroed) per
    SmolLM2-135M step here, which also takes memory bandwidth from the generator decoding beside it.
    Measured (async GSM8K bench, bf16): 134 -> 147 tokens/s, train 10.9 -> 9.3 s; the price is memory
    a rank holds between its peaks: the trainer's peak 3.8 -> 4.2 GB. glibc reads them at process
    start: the fork server the ranks come from starts after this."""
    with (
        _environ("MALLOC_MMAP_THRESHOLD_", str(4 << 30), unless_set=True),
        _environ("MALLOC_TRIM_THRESHOLD_", str(64 << 30), unless_set=True),
    ):
        yield


@contextlib.contextmanager
def _environ(name: str, value: str, *, unless_set: bool = False) -> Iterator[None]:
    """Sets environment variable `name` for the processes started meanwhile (the ranks), then puts
    back what was there; with `unless_set`, a value the user set stays."""
    before = os.environ.get(name)
    if not (unless_set and before is not None):
        os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def _ranks_started(log_dir: Path) -> bool:
    """Whether torch elastic started ranks on this machine (it makes their log folders first)."""
    return any(log_dir.glob("*/attempt_*"))


def _rendezvous_failure(config: RunConfig, endpoint: str, error: RendezvousError, *, formed: bool) -> str:
    """One line for a rendezvous that failed: machines that never formed the job, or, once it ran, the
    loss of the machine that hosts the rendezvous (every agent keeps talking to it)."""
    launch = config.launch
    if launch.nnodes == 1:
        return f"the ranks could not meet: {type(error).__name__}: {error}"
    if formed:
        return (
            f"the machine hosting the rendezvous ({endpoint}) was lost: the job stopped with it "
            f"({type(error).__name__})"
        )
    return (
        f"the {launch.nnodes} machines did not form the job at {endpoint} within {launch.timeout_s:.0f} s "
        f"({type(error).__name__}); run the same command, with the same --nnodes, --rdzv-endpoint and "
        f"--launch.rdzv-id ({launch.run_id}), on every machine"
    )


def _first_failure(
    errors_dir: Path,
    error: ChildFailedError,
    config: RunConfig,
    memory: ProcessTreeMemory,
    baseline: OomBaseline,
    *,
    since: float,
) -> RunFailed | RunInterrupted:
    """The failure that started it: a rank killed by a signal (named by the one rank -> role rule, with
    what `memory` saw of it and whether the out-of-memory killer struck since `baseline`), a machine
    lost, else the earliest recorded error (records older than `since`, the launch, are another run's).

    Later errors are usually peers noticing the first one (a closed connection), and ranks that
    torch elastic stopped (SIGTERM) after it, so they are not shown. Only when every failed rank was
    stopped by a signal sent to it (not to the launcher) is the run reported as interrupted.
    """
    records = {r: record for r, record in read_error_records(errors_dir).items() if record["time"] >= since}
    # A rank that died without raising (killed, out of memory, segfault) recorded nothing.
    for rank, failure in sorted(error.failures.items()):
        if rank not in records and failure.exitcode < 0 and failure.signal_name() != "SIGTERM":
            line = describe_killed(
                rank, failure.pid, failure.signal_name(), memory, role=config.role_of(rank), baseline=baseline
            )
            return RunFailed(line, rank=rank)
    failed = [r for r in records.values() if not r.get("interrupted")]
    if failed:
        first = min(failed, key=lambda r: r["time"])
        if first.get("lost_nodes"):
            return RunFailed(describe_lost(first["lost_nodes"]), rank=first["rank"])
        marks = {r: m for r, m in read_progress(errors_dir).items() if m.time >= since}  # this run's
        stalled = stalled_rank(marks, config, now=first["time"]) if timed_out(first) else None
        if stalled is not None and stalled.rank != first["rank"]:
            line = describe_stall(stalled, config, now=first["time"], gave_up=first["rank"])
            return RunFailed(line, rank=stalled.rank)
        return RunFailed(describe_record(first, errors_dir), rank=first["rank"])
    if records:  # SIGINT or SIGTERM sent to the ranks themselves
        first = min(records.values(), key=lambda r: r["time"])
        return _interrupted(config.output_dir, signal.Signals[first["error"].split(": ", 1)[1]])
    rank, failure = error.get_first_failure()
    return RunFailed(f"rank {rank} exited with code {failure.exitcode}", rank=rank)


def _interrupted(output_dir: Path, signum: int) -> RunInterrupted:
    name = signal.Signals(signum).name
    return RunInterrupted(
        f"interrupted ({name}): every process of the run stopped; {last_checkpoint_note(output_dir)}",
        signum=int(signum),
    )
