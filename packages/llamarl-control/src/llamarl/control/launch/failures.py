"""How a run ends when it does not finish: interrupts, failed ranks, and what the user is told.

Every way a run can end early is one line for the user and an exit code, with the details on disk:

- Ctrl-C or SIGTERM (a scheduler's preemption): every rank stops where it is, closes its engines and
  reward workers, and exits; torch elastic ends any rank that does not within its shutdown timeout.
  The launcher then says where the last complete checkpoint is (`RunInterrupted`); a checkpoint whose
  write was cut short is never chosen on resume (`llamarl.control.run.checkpoint`).
- A rank that raised: its original error once (`RunFailed`), as one line when it is an error a user
  meets rather than a bug (a full disk, an unwritable folder, a checkpoint that cannot be written,
  a missed deadline), else with its traceback; every rank's record stays in OUTPUT_DIR/errors/.
- A rank killed by a signal: which signal, and when the kernel's out-of-memory killer did it, that
  (the kernel log's line for that process, or the memory cgroup's OOM count), with the memory the
  rank and the machine had at the launcher's last look (its `ProcessTreeMemory`).
"""

from __future__ import annotations

import contextlib
import errno
import json
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from llamarl.control.launch.memory import ProcessTreeMemory

# Exit codes of the apps: a run that failed, and one that was interrupted (128 + the signal, as shells do).
EXIT_FAILED = 1


class RunFailed(RuntimeError):
    """A rank failed; `str()` is the original error, `rank` the rank that raised it first."""

    def __init__(self, message: str, *, rank: int | None) -> None:
        super().__init__(message)
        self.rank = rank


class RunInterrupted(RuntimeError):
    """The run was stopped by a signal (Ctrl-C, SIGTERM); `str()` says where its last checkpoint is."""

    def __init__(self, message: str, *, signum: int) -> None:
        super().__init__(message)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class Interrupted(KeyboardInterrupt):
    """Raised in a rank's main thread by SIGINT or SIGTERM (a KeyboardInterrupt, so that no
    `except Exception` on the way swallows it): the rank closes its side and exits."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def raise_on_interrupt() -> None:
    """In a rank: SIGINT and SIGTERM raise `Interrupted` once; a second one while the rank cleans up
    is ignored (torch elastic kills a rank that takes too long)."""

    def handler(signum: int, frame: FrameType | None) -> None:
        # Ignored by a Python handler that does nothing, not by SIG_IGN: Ctrl-C's SIGINT and torch
        # elastic's SIGTERM often arrive together, and Python runs the handler of the second after the
        # first raised; were it SIG_IGN by then, Python would raise "OSError: Signal 15 ignored due to
        # race condition" in the middle of the rank's cleanup, and print its traceback.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, _ignore)
        raise Interrupted(signum)

    previous_hook = sys.unraisablehook

    def deliver_again(unraisable: Any) -> None:
        # A signal that comes while Python runs a finalizer (a `__del__`, a weakref callback of the
        # garbage collector) raises there, where Python prints the exception and swallows it: the rank
        # would run on with both signals ignored until torch elastic kills it. So the signal is sent
        # again to the main thread shortly, once the finalizer is over, to land in the rank's own code.
        error = unraisable.exc_value
        if not isinstance(error, Interrupted):
            previous_hook(unraisable)
            return
        signal.signal(error.signum, handler)  # finalizers that raise Interrupted run in the main thread
        main = threading.main_thread().ident
        assert main is not None
        resend = threading.Timer(0.05, signal.pthread_kill, args=(main, error.signum))
        resend.daemon = True
        resend.start()

    sys.unraisablehook = deliver_again
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, handler)


def _ignore(signum: int, frame: FrameType | None) -> None:
    """A signal handler that does nothing."""


# --------------------------------------------------------------------------------------------------
# what a failed rank left


# Errors a user meets (the disk, the folder, a deadline, a checkpoint that cannot be written) rather than
# bugs: their message says it all, so they are shown as one line (the traceback stays in OUTPUT_DIR/errors).
_USER_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EROFS, errno.EPERM, errno.EIO}


def is_user_error(error: BaseException) -> bool:
    """Whether `error` is one a user meets rather than a bug (shown as one line)."""
    return (
        type(error).__name__ in ("CheckpointError", "TrainingStopped")
        or isinstance(error, (MemoryError, TimeoutError))
        or (isinstance(error, OSError) and error.errno in _USER_ERRNOS)
    )


def timed_out(record: dict[str, Any]) -> bool:
    """Whether a rank's recorded error is a wait that ran out of time (its peer may be the cause)."""
    text = record["error"].lower()
    return record["error"].startswith("TimeoutError") or "timed out" in text or "timeout" in text


def error_record(rank: int, error: BaseException, traceback_text: str) -> dict[str, Any]:
    """What a failed rank writes to OUTPUT_DIR/errors/rank{r}.json."""
    return {
        "rank": rank,
        "time": time.time(),
        "error": f"{type(error).__name__}: {error}",
        "user_error": is_user_error(error),
        "interrupted": isinstance(error, Interrupted),
        "traceback": traceback_text,
    }


ERROR_RECORD_BYTES = 64 << 10


def reserve_error_record(path: Path) -> None:
    """Writes `path` full of spaces at the start of a rank, so that its error record can be written
    over them later even when the disk has filled up meanwhile (a full disk is one of the errors)."""
    with contextlib.suppress(OSError):
        path.write_bytes(b" " * ERROR_RECORD_BYTES)


def write_error_record(path: Path, record: dict[str, Any]) -> None:
    """Writes `record` as JSON over the reserved spaces (the traceback shortened to fit)."""
    data = json.dumps(record).encode()
    if len(data) > ERROR_RECORD_BYTES:
        keep = max(0, len(record["traceback"]) - (len(data) - ERROR_RECORD_BYTES) - 100)
        data = json.dumps({**record, "traceback": "...\n" + record["traceback"][-keep:]}).encode()
    with contextlib.suppress(OSError), path.open("r+b" if path.exists() else "wb") as f:
        f.write(data)
        f.truncate(len(data))


def discard_unused_error_record(path: Path) -> None:
    """Removes a reserved record that no error was written over (spaces only): a rank that did not fail
    (or was killed before it could write) leaves no file."""
    with contextlib.suppress(OSError):
        if not path.read_bytes().strip():
            path.unlink()


def discard_unused_error_records(errors_dir: Path) -> None:
    """`discard_unused_error_record` for every rank's record in `errors_dir`."""
    for path in errors_dir.glob("rank*.json"):
        discard_unused_error_record(path)


def read_error_records(errors_dir: Path) -> dict[int, dict[str, Any]]:
    records = {}
    for path in errors_dir.glob("rank*.json"):
        try:
            record = json.loads(path.read_text())  # spaces only: a rank that did not fail
        except (OSError, json.JSONDecodeError):
            continue
        records[record["rank"]] = record
    return records


def describe_record(record: dict[str, Any], errors_dir: Path) -> str:
    """A failed rank's error: one line for an error a user meets, else its traceback."""
    if record.get("user_error"):
        message = " ".join(record["error"].split())  # one line, whatever the message held
        return f"rank {record['rank']} failed: {message} (details: {errors_dir}/rank{record['rank']}.json)"
    return f"rank {record['rank']} failed:\n{record['traceback'].rstrip()}"


# --------------------------------------------------------------------------------------------------
# the out-of-memory killer


@dataclass(frozen=True)
class OomBaseline:
    """What the kernel's out-of-memory killer had done when the run started, to tell later whether it
    struck meanwhile: the memory cgroup's OOM-kill count, and the kernel log's clock."""

    oom_kills: int | None
    uptime_s: float | None

    @classmethod
    def now(cls) -> OomBaseline:
        return cls(oom_kills=cgroup_oom_kills(), uptime_s=uptime_s())


def cgroup_oom_kills() -> int | None:
    """How many processes the kernel's OOM killer killed in this process's memory cgroup (v2
    memory.events, v1 memory.oom_control); None where neither is readable."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2
            candidates = [Path("/sys/fs/cgroup") / path.lstrip("/") / "memory.events"]
        elif "memory" in controllers.split(","):  # v1
            candidates = [Path("/sys/fs/cgroup/memory") / path.lstrip("/") / "memory.oom_control"]
        else:
            continue
        for file in candidates:
            try:
                for entry in file.read_text().splitlines():
                    key, _, value = entry.partition(" ")
                    if key == "oom_kill":
                        return int(value)
            except (OSError, ValueError):
                continue
    return None


def uptime_s() -> float | None:
    """Seconds since boot (the kernel log's clock)."""
    try:
        return float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def kernel_log() -> str | None:
    """The kernel's log (dmesg), or None where it is not readable."""
    try:
        result = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return result.stdout if result.returncode == 0 else None


def kernel_oom_line(log: str, pid: int, *, since_s: float | None) -> str | None:
    """The kernel log's line saying that the out-of-memory killer killed `pid` (at or after `since_s`
    seconds since boot, so that an earlier process with the same pid does not count)."""
    for line in reversed(log.splitlines()):
        if not re.search(rf"(Killed process |oom-kill:.*pid=){pid}\b", line):
            continue
        stamp = re.match(r"\[\s*(\d+\.\d+)\]", line)
        if since_s is not None and stamp is not None and float(stamp.group(1)) < since_s:
            return None
        return line.split("] ", 1)[-1].strip()
    return None


def describe_killed(
    rank: int,
    pid: int,
    signal_name: str,
    memory: ProcessTreeMemory | None,
    *,
    role: str | None = None,
    baseline: OomBaseline | None = None,
) -> str:
    """One line for a rank that died of a signal, saying whether the out-of-memory killer did it (by the
    kernel's log since `baseline`, or the memory cgroup's count), with what the rank's tree and the
    machine held at `memory`'s last look, and which executor it was when `role` is given ("rank 3
    (reward) died ...")."""
    who = f"rank {rank}" if role is None else f"rank {rank} ({role})"
    held = _memory_at_last_look(memory, pid)
    if signal_name != "SIGKILL":
        return f"{who} died ({signal_name}; pid {pid}{held})"
    advice = "; use fewer or shorter sequences per step, or more memory"
    log = kernel_log()
    since = baseline.uptime_s if baseline is not None else None
    line = None if log is None else kernel_oom_line(log, pid, since_s=since)
    if line is not None:
        killer = f"the kernel's out-of-memory killer killed it ({line})"
        return f"{who} died (SIGKILL): {killer}{held}{advice}"
    before, after = (baseline.oom_kills if baseline is not None else None), cgroup_oom_kills()
    if before is not None and after is not None and after > before:
        return (
            f"{who} died (SIGKILL): the kernel's out-of-memory killer killed {after - before} "
            f"process(es) of this run's memory cgroup meanwhile (pid {pid}){held}{advice}"
        )
    if log is not None:
        return (
            f"{who} died (SIGKILL): not by the out-of-memory killer (none in the kernel log; pid {pid}{held})"
        )
    return (
        f"{who} died (SIGKILL; pid {pid}{held}); the kernel log is not readable here to tell whether "
        "the out-of-memory killer did it"
    )


def _memory_at_last_look(memory: ProcessTreeMemory | None, pid: int) -> str:
    """ "; it held 3900 MB with its engines and workers, the machine had 120 of 16000 MB free at the
    last look" (empty when the launcher never saw process `pid`)."""
    tree_mb = None if memory is None else memory.tree_rss_mb(pid)
    if memory is None or tree_mb is None:
        return ""
    held = f"; it held {tree_mb:.0f} MB with its engines and workers"
    machine = memory.machine_mb()
    if machine is not None:
        held += f", the machine had {machine[0]:.0f} of {machine[1]:.0f} MB free"
    return held + " at the last look"


# --------------------------------------------------------------------------------------------------
# interrupts


def last_checkpoint_note(output_dir: Path) -> str:
    """Where a stopped run's last complete checkpoint is, and how to continue from it."""
    from llamarl.control.run.checkpoint import CHECKPOINTS_DIR, find_latest

    found = find_latest(output_dir / CHECKPOINTS_DIR)
    if found is None:
        return "no checkpoint was written (--checkpoint-every N saves one every N steps)"
    return f"the last checkpoint is {found.path} (policy_version {found.step}); --resume continues from it"
