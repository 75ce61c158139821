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

import atexit
import contextlib
import json
import logging
import multiprocessing.forkserver
import os
import signal
import socket
import sys
import time
import traceback
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous.api import RendezvousError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from llamarl.comm import free_port
from llamarl.control.cli import RESOLVED_CONFIG, write_config
from llamarl.control.config import ConfigError, RunConfig, replace_in
from llamarl.control.launch.devices import check_placement, pin_rank, this_rank_placement
from llamarl.control.launch.failures import (
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
from llamarl.control.launch.memory import memory_summary, own_peak
from llamarl.control.launch.nodes import NodeWatch, describe_lost, nodes_as_records
from llamarl.control.launch.threads import rank_threads
from llamarl.control.outputs.report import write_report
from llamarl.control.run.channels.weights import FIRST_TRAINER_RANK
from llamarl.control.run.faults import ERRORS_DIR
from llamarl.control.tasks import Task
from llamarl.control.tasks.registry import load_task, register_task

__all__ = ["Launched", "RunFailed", "RunInterrupted", "launch", "run_this_rank"]

EXIT_GRACE_S = 2.0  # how long a failed rank waits before exiting, see _run_rank
SHUTDOWN_TIMEOUT_S = 30  # after Ctrl-C or SIGTERM, how long ranks get to close before they are killed
# Ranks are the big consumers of memory: the kernel's out-of-memory killer takes them before the
# launcher, which then lives to say what happened.
RANK_OOM_SCORE_ADJ = 300
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


def launch(
    config: RunConfig, train_rows: list[dict], eval_rows: list[dict], task: Task | None = None
) -> Launched:
    """Runs the job on `config.world_size` ranks (this machine's share of them with `launch.nnodes` >
    1) and returns what it left here. `task`: the task object when it was given in code
    (`llamarl.control.train`); by default the one `config.task` names.

    Writes the resolved config to OUTPUT_DIR/config.toml first: `--config` reruns it.

    Raises:
        ConfigError: the ranks do not fit this machine's GPUs (one line, before any rank starts).
        RunFailed: a rank failed, a machine was lost, or the machines never met (one line, or the
            first failed rank's traceback).
        RunInterrupted: Ctrl-C or SIGTERM stopped every rank (says where the last checkpoint is).
    """
    task = task if task is not None else load_task(config.task.name, config.task.module)
    launch = config.launch
    ranks_per_node = config.world_size // launch.nnodes
    check_placement(config, ranks_per_node=ranks_per_node, cuda_devices=torch.cuda.device_count())
    output_dir = config.output_dir
    prepare_output_dir(output_dir)
    _write_resolved_config(config)
    # Shared by every machine where OUTPUT_DIR is: never cleared here (another machine's rank may
    # already have written into it); each rank removes its own stale record when it starts.
    errors_dir = output_dir / ERRORS_DIR
    errors_dir.mkdir(exist_ok=True)
    if launch.nnodes == 1 and launch.rdzv_endpoint is None:
        endpoint, run_id = f"127.0.0.1:{free_port('127.0.0.1')}", f"llamarl-{uuid.uuid4().hex[:8]}"
    else:
        # The c10d rendezvous key is built from the run id: every machine must give the same one.
        endpoint, run_id = launch.rdzv_endpoint or "", launch.run_id
    # Each machine logs into a folder of its own, also where OUTPUT_DIR is shared.
    log_dir = output_dir / "logs" / f"{socket.gethostname()}-{os.getpid()}"
    launch_config = LaunchConfig(
        min_nodes=launch.nnodes,
        max_nodes=launch.nnodes,
        nproc_per_node=ranks_per_node,
        run_id=run_id,
        rdzv_backend="c10d",
        rdzv_endpoint=endpoint,
        rdzv_configs={"join_timeout": launch.timeout_s},
        max_restarts=launch.max_restarts,  # restarted ranks resume from the latest checkpoint
        monitor_interval=0.2,
        start_method="forkserver",
        logs_specs=DefaultLogsSpecs(log_dir=str(log_dir)),
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
    started_at = time.time()
    try:
        with (
            _ranks_log_cpp_errors_only(),
            _ranks_keep_freed_memory(),
            _rank_fork_server(),
            _fresh_store_per_formation(),
            MemoryWatch() as memory,
        ):
            results = elastic_launch(launch_config, _rank_main)(
                config, task, train_rows, eval_rows, str(errors_dir)
            )
    except SignalException as e:  # Ctrl-C or SIGTERM: torch elastic stopped every rank
        raise _interrupted(output_dir, int(e.sigval)) from None
    except KeyboardInterrupt:  # before torch elastic took over the signals
        raise _interrupted(output_dir, signal.SIGINT) from None
    except ChildFailedError as e:
        raise _first_failure(errors_dir, e, memory, output_dir, config, since=started_at) from None
    except RendezvousError as e:
        raise RunFailed(
            _rendezvous_failure(config, endpoint, e, formed=_ranks_started(log_dir)), rank=None
        ) from None
    summary_path = output_dir / "summary.json"
    # elastic_launch returns this machine's ranks only, by global rank; each says where the summary is.
    summary_host = next(iter(results.values()))["summary_host"]
    if FIRST_TRAINER_RANK not in results:
        return Launched(summary=None, summary_path=summary_path, summary_host=summary_host)
    summary = results[FIRST_TRAINER_RANK]["summary"]
    # The ranks measured their own run; the whole command also pays for process start and model loads,
    # and this process (the launcher) holds memory too.
    added = {
        "wall_s": time.perf_counter() - start,
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


def run_this_rank(
    config: RunConfig, train_rows: list[dict], eval_rows: list[dict], task: Task | None = None
) -> Launched | None:
    """This process's rank, when `torchrun` (or srun of it) started it: the same body as the ranks
    `launch` starts. Returns what `launch` returns on the first trainer rank, None on the others.

    Raises:
        ConfigError: torchrun started another number of ranks than the config has, or they do not fit
            this machine's GPUs.
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
    prepare_output_dir(output_dir)
    if int(os.environ["RANK"]) == FIRST_TRAINER_RANK:
        _write_resolved_config(config)
    errors_dir = output_dir / ERRORS_DIR
    errors_dir.mkdir(exist_ok=True)
    task = task if task is not None else load_task(config.task.name, config.task.module)
    result = _run_rank(config, task, train_rows, eval_rows, str(errors_dir), draw_report=True)
    if result["summary"] is None:
        return None
    return Launched(result["summary"], output_dir / "summary.json", result["summary_host"])


def under_torchrun() -> bool:
    """Whether this process is a rank that `torchrun` started (not a launcher that starts ranks)."""
    return "TORCHELASTIC_RUN_ID" in os.environ and "LOCAL_RANK" in os.environ


def _write_resolved_config(config: RunConfig) -> None:
    """OUTPUT_DIR/config.toml, replaced atomically: every machine writes it, maybe into one folder."""
    path = config.output_dir / RESOLVED_CONFIG
    partial = path.with_name(f".{path.name}.{socket.gethostname()}-{os.getpid()}")
    write_config(config, partial)
    os.replace(partial, path)


@contextlib.contextmanager
def _rank_fork_server() -> Iterator[None]:
    """Ranks fork from one server process that imported their code once (`RANK_PRELOAD`), instead of
    each importing torch, transformers and llamarl afresh: about 5 CPU seconds saved per rank, and per
    rank that torch elastic restarts. The server stops with the job, so that the ranks of a next job
    launched from the same process inherit the environment of that launch, not of this one."""
    multiprocessing.set_forkserver_preload(RANK_PRELOAD)
    try:
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


def _rank_main(
    config: RunConfig, task: Task, train_rows: list[dict], eval_rows: list[dict], errors_dir: str
) -> dict[str, Any]:
    """The body of every rank `launch` starts. On error it records its traceback and exits non-zero
    without printing (the launcher prints the first failure once); SIGINT and SIGTERM stop it (its side
    closes its engines and workers) the same way, with exit code 128 + the signal."""
    try:
        # The launcher draws the report once the ranks are gone (with its own memory in it), so the
        # first trainer rank does not draw one too before it exits.
        result = _run_rank(config, task, train_rows, eval_rows, errors_dir, draw_report=False)
        atexit.register(_exit_without_finalizing)  # runs first, once torch elastic has the result
        return result
    except Interrupted as e:
        os._exit(128 + e.signum)
    except BaseException:
        os._exit(1)


def _exit_without_finalizing() -> None:
    """Ends a rank whose run is over and whose result torch elastic has read (it waits for that before
    the rank's process may exit). What Python's own exit would add is seconds of collecting every object
    of a process that held a model and the dataset's rows (the launcher waits for it), and libraries'
    reports of objects left alive at exit: nothing of the run. Everything the rank opened is closed."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(0)


def _run_rank(
    config: RunConfig,
    task: Task,
    train_rows: list[dict],
    eval_rows: list[dict],
    errors_dir: str,
    *,
    draw_report: bool,
) -> dict[str, Any]:
    """One rank, start to end: {"summary": the summary on the first trainer rank (else None),
    "summary_host": the machine that has it}; the first trainer rank draws report.png if
    `draw_report`. A failure is recorded in `errors_dir`, then raised as `RunFailed`."""
    rank = int(os.environ.get("RANK", -1))
    record_path = Path(errors_dir, f"rank{rank}.json")
    nodes = NodeWatch()
    try:
        raise_on_interrupt()
        reserve_error_record(record_path)  # also replaces a previous run's record
        _prefer_for_oom_kill()
        # Before any CUDA work: this rank's GPU becomes the current device (FSDP2 shards land there).
        pin_rank(this_rank_placement(config))
        torch.set_num_threads(rank_threads(config))
        _quiet_libraries()
        _init_default_group(config.launch.timeout_s)
        nodes.start()
        register_task(task)  # a task given in code is known by its name here too
        if _restarted():
            # torch elastic restarted the ranks after a failure: continue from the latest checkpoint.
            config = replace_in(config, **{"checkpoint.resume": True})
        from llamarl.control.launch.spmd import (
            run_rank,  # the ranks' code: not imported by the launcher itself
        )

        # closes its side, also on failure
        summary = run_rank(config, train_rows, eval_rows, draw_report=draw_report)
        nodes.stop()
        dist.destroy_process_group()
        return {"summary": summary, "summary_host": os.environ.get("MASTER_ADDR", socket.gethostname())}
    except BaseException as e:
        # A rank failing because a machine went away names that machine (its heartbeat stood still).
        lost = nodes_as_records(nodes.lost_nodes()) if dist.is_initialized() else []
        nodes.stop()
        record = {**error_record(rank, e, traceback.format_exc()), "lost_nodes": lost}
        failed_at = record["time"]
        write_error_record(record_path, record)
        if isinstance(e, Interrupted):
            raise
        # Torch elastic reports only the first exit it sees. A rank failing because a peer was killed
        # (closed connection) must not exit before the launcher has seen that peer's death, or the
        # run would be blamed on the wrong rank; a short grace period orders the two exits.
        time.sleep(max(0.0, failed_at + EXIT_GRACE_S - time.time()))
        message = describe_lost(lost) if lost else f"rank {rank} failed: {record['error']}"
        restarts_left = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) - int(
            os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        )
        if lost and restarts_left > 0:
            # Nothing else tells the user why the job stalls: it waits for the machine to come back.
            print(
                f"rank {rank}: {message}; the job restarts when every machine is back "
                f"(within launch.timeout_s; {restarts_left} restarts left)",
                file=sys.stderr,
                flush=True,
            )
        raise RunFailed(message, rank=rank) from None


def _prefer_for_oom_kill() -> None:
    with contextlib.suppress(OSError):  # not Linux, or not allowed: the kernel picks as it would anyway
        Path("/proc/self/oom_score_adj").write_text(str(RANK_OOM_SCORE_ADJ))


def _restarted() -> bool:
    """Whether this formation of the ranks follows a failure: any rank was restarted by its machine's
    agent. Asked of every rank, since a machine that came back after a loss counts its attempts from 0."""
    count = torch.tensor([int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))])
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    return int(count) > 0


def _init_default_group(timeout_s: float) -> None:
    """The default (gloo) process group: rollouts and small control messages, all CPU tensors.

    `launch` has torch elastic make a fresh store for every formation of the ranks (plain env:// init).
    Under torchrun the ranks reach the agent's store, which outlives a restart; with plain env:// init
    a restarted rank could read the gloo address a killed rank of the previous attempt left there and
    time out connecting to it (seen here: restarted ranks that never met). Prefixing the keys with the
    attempt number keeps every attempt to its own (a machine that comes back after a loss counts from
    0 again: run torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 where machines may come back).
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


def _first_failure(
    errors_dir: Path,
    error: ChildFailedError,
    memory: MemoryWatch | None,
    output_dir: Path,
    config: RunConfig | None = None,
    *,
    since: float = 0.0,
) -> RunFailed | RunInterrupted:
    """The failure that started it: a rank killed by a signal, a machine lost, else the earliest recorded
    error (records older than `since`, the launch, are another run's).

    Later errors are usually peers noticing the first one (a closed connection), and ranks that
    torch elastic stopped (SIGTERM) after it, so they are not shown. Only when every failed rank was
    stopped by a signal sent to it (not to the launcher) is the run reported as interrupted.
    """
    records = {r: record for r, record in read_error_records(errors_dir).items() if record["time"] >= since}
    # A rank that died without raising (killed, out of memory, segfault) recorded nothing.
    for rank, failure in sorted(error.failures.items()):
        if rank not in records and failure.exitcode < 0 and failure.signal_name() != "SIGTERM":
            role = None if config is None else config.role_of(rank)
            line = describe_killed(rank, failure.pid, failure.signal_name(), memory, role=role)
            return RunFailed(line, rank=rank)
    failed = [r for r in records.values() if not r.get("interrupted")]
    if failed:
        first = min(failed, key=lambda r: r["time"])
        if first.get("lost_nodes"):
            return RunFailed(describe_lost(first["lost_nodes"]), rank=first["rank"])
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
