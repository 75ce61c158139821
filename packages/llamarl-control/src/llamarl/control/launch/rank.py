"""One rank's process, around its side (`llamarl.control.launch.spmd`): what it sets up before the run
(signals, its error record, its device and threads, the default process group, the machines' heartbeat),
and how it ends: a result for torch elastic, or a failure recorded in OUTPUT_DIR/errors/rank{r}.json
that the launcher shows once.

The launcher refers to `rank_main` by name only (torch elastic sends it to the ranks): this module stays
light, and the ranks' own code is imported in the ranks.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import socket
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from llamarl.control.config import RunConfig, replace_in
from llamarl.control.launch.devices import pin_rank, this_rank_placement
from llamarl.control.launch.failures import (
    Interrupted,
    RunFailed,
    discard_unused_error_record,
    error_record,
    raise_on_interrupt,
    reserve_error_record,
    write_error_record,
)
from llamarl.control.launch.nodes import NodeWatch, describe_lost, nodes_as_records
from llamarl.control.launch.progress import ProgressMark, progress_path
from llamarl.control.launch.threads import rank_threads
from llamarl.control.tasks import Task
from llamarl.control.tasks.registry import register_task

EXIT_GRACE_S = 2.0  # how long a failed rank waits before exiting, see _failed
# Ranks are the big consumers of memory: the kernel's out-of-memory killer takes them before the
# launcher, which then lives to say what happened.
RANK_OOM_SCORE_ADJ = 300


def rank_main(
    config: RunConfig, task: Task, train_rows: list[dict], eval_rows: list[dict], errors_dir: str
) -> dict[str, Any]:
    """The body of every rank `launch` starts. On error it records its traceback and exits non-zero
    without printing (the launcher prints the first failure once); SIGINT and SIGTERM stop it (its side
    closes its engines and workers) the same way, with exit code 128 + the signal."""
    try:
        # The launcher draws the report once the ranks are gone (with its own memory in it), so the
        # first trainer rank does not draw one too before it exits.
        result = run_rank_process(config, task, train_rows, eval_rows, errors_dir, draw_report=False)
        atexit.register(_exit_without_finalizing)  # runs first, once torch elastic has the result
        return result
    except Interrupted as e:
        os._exit(128 + e.signum)
    except BaseException:
        os._exit(1)


def run_rank_process(
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
    progress = ProgressMark(progress_path(errors_dir, rank))  # read by the launcher if the run stalls
    try:
        config = _start(config, task, record_path, nodes)
        from llamarl.control.launch.spmd import (
            run_rank,  # the ranks' code: not imported by the launcher itself
        )

        # closes its side, also on failure
        summary = run_rank(config, train_rows, eval_rows, draw_report=draw_report, progress=progress)
        nodes.stop()
        dist.destroy_process_group()
        discard_unused_error_record(record_path)  # a rank that did not fail leaves no record
        progress.close()
        return {"summary": summary, "summary_host": os.environ.get("MASTER_ADDR", socket.gethostname())}
    except BaseException as e:
        record = _record(rank, e, nodes, record_path)
        if isinstance(e, Interrupted):
            raise
        raise _failed(rank, record) from None


def _start(config: RunConfig, task: Task, record_path: Path, nodes: NodeWatch) -> RunConfig:
    """Everything a rank sets up before its side: returns the config it runs (resuming after a restart)."""
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
    return config


def _record(rank: int, error: BaseException, nodes: NodeWatch, record_path: Path) -> dict[str, Any]:
    """Writes this rank's error record: the error, its traceback, and the machines found gone (a rank
    failing because a machine went away names that machine: its heartbeat stood still)."""
    lost = nodes_as_records(nodes.lost_nodes()) if dist.is_initialized() else []
    nodes.stop()
    record = {**error_record(rank, error, traceback.format_exc()), "lost_nodes": lost}
    write_error_record(record_path, record)
    return record


def _failed(rank: int, record: dict[str, Any]) -> RunFailed:
    """The failure this rank raises, once its grace period is over."""
    # Torch elastic reports only the first exit it sees. A rank failing because a peer was killed
    # (closed connection) must not exit before the launcher has seen that peer's death, or the
    # run would be blamed on the wrong rank; a short grace period orders the two exits.
    time.sleep(max(0.0, record["time"] + EXIT_GRACE_S - time.time()))
    lost = record["lost_nodes"]
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
    return RunFailed(message, rank=rank)


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
