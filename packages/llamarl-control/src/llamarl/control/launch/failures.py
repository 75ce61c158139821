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
  rank and the machine had at the launcher's last look (`MemoryWatch`).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

from llamarl.control.config import ConfigError
from llamarl.control.launch.memory import PeakAtOnce, rss_bytes

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
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
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


# --------------------------------------------------------------------------------------------------
# the output folder


def prepare_output_dir(path: Path) -> None:
    """Creates the output folder and checks that files can be written in it; a folder that cannot
    be is a one-line `ConfigError` naming the setting."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"output.dir (--output-dir) {path}: cannot create it ({_reason(e)})") from None
    probe = path / f".write-test-{os.getpid()}"
    try:
        probe.write_bytes(b"llamarl")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"output.dir (--output-dir) {path}: cannot write in it ({_reason(e)})") from None


def _reason(error: OSError) -> str:
    return error.strerror or type(error).__name__


# --------------------------------------------------------------------------------------------------
# what a failed rank left


# Errors a user meets (the disk, the folder, a deadline, a checkpoint that cannot be written) rather than
# bugs: their message says it all, so they are shown as one line (the traceback stays in OUTPUT_DIR/errors).
_USER_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EROFS, errno.EPERM, errno.EIO}


def is_user_error(error: BaseException) -> bool:
    """Whether `error` is one a user meets rather than a bug (shown as one line)."""
    return (
        type(error).__name__ == "CheckpointError"
        or isinstance(error, (MemoryError, TimeoutError))
        or (isinstance(error, OSError) and error.errno in _USER_ERRNOS)
    )


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


class MemoryWatch:
    """Samples, twice a second, the memory of every process under the launcher (each rank with its
    engines and workers) and what the machine has left: the evidence for a rank the kernel killed; and
    the most the whole run held at once, the launcher included (`at_once`).
    Also reads the memory cgroup's OOM-kill count at start, to tell later whether the kernel's OOM
    killer struck in between."""

    def __init__(self, period_s: float = 0.5) -> None:
        self.period_s = period_s
        self.rss_mb: dict[int, float] = {}  # pid of a rank -> its tree's RSS at the last look
        self.peak_rss_mb: dict[int, float] = {}
        self.at_once = PeakAtOnce()  # every process of the run, this one too
        self.available_mb: float | None = None
        self.total_mb: float | None = None
        self.oom_kills_at_start = cgroup_oom_kills()
        self.started_uptime_s = uptime_s()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="memory-watch", daemon=True)

    def __enter__(self) -> MemoryWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        import psutil

        me = psutil.Process()
        while not self._stop.wait(self.period_s):
            try:
                everything = [me, *me.children(recursive=True)]  # one walk of the process table
                for child in rank_processes(me):
                    tree = [child, *_descendants(child, everything)]
                    rss = sum(rss_bytes(p) for p in tree) / 2**20
                    self.rss_mb[child.pid] = rss
                    self.peak_rss_mb[child.pid] = max(rss, self.peak_rss_mb.get(child.pid, 0.0))
                self.at_once.sample(everything)
                memory = psutil.virtual_memory()
                self.available_mb, self.total_mb = memory.available / 2**20, memory.total / 2**20
            except psutil.Error:
                continue


def _descendants(root: Any, processes: list[Any]) -> list[Any]:
    """Those of `processes` (psutil, listed parents first) below `root`, from their parent pids."""
    below = {root.pid}
    found = []
    for process in processes:
        try:
            if process.ppid() in below:
                below.add(process.pid)
                found.append(process)
        except Exception:  # gone meanwhile
            continue
    return found


def rank_processes(launcher: Any) -> list[Any]:
    """The launcher's rank processes (psutil): the children of the server they fork from
    (`multiprocessing`'s forkserver), or its own children when ranks are spawned directly."""
    ranks = []
    for child in launcher.children():
        try:
            forks_ranks = "multiprocessing.forkserver" in " ".join(child.cmdline())
        except Exception:  # gone meanwhile
            continue
        ranks.extend(child.children() if forks_ranks else [child])
    return ranks


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
    rank: int, pid: int, signal_name: str, watch: MemoryWatch | None, *, role: str | None = None
) -> str:
    """One line for a rank that died of a signal, saying whether the out-of-memory killer did it, and
    which executor it was when `role` is given ("rank 3 (reward) died ...")."""
    who = f"rank {rank}" if role is None else f"rank {rank} ({role})"
    memory = ""
    if watch is not None and pid in watch.peak_rss_mb:
        memory = f"; it used {watch.peak_rss_mb[pid]:.0f} MB with its engines and workers"
        if watch.available_mb is not None and watch.total_mb is not None:
            memory += (
                f", the machine had {watch.available_mb:.0f} of {watch.total_mb:.0f} MB free at the last look"
            )
    if signal_name != "SIGKILL":
        return f"{who} died ({signal_name}; pid {pid}{memory})"
    advice = "; use fewer or shorter sequences per step, or more memory"
    log = kernel_log()
    line = (
        None if log is None else kernel_oom_line(log, pid, since_s=watch.started_uptime_s if watch else None)
    )
    if line is not None:
        killer = f"the kernel's out-of-memory killer killed it ({line})"
        return f"{who} died (SIGKILL): {killer}{memory}{advice}"
    before, after = (watch.oom_kills_at_start if watch else None), cgroup_oom_kills()
    if before is not None and after is not None and after > before:
        return (
            f"{who} died (SIGKILL): the kernel's out-of-memory killer killed {after - before} "
            f"process(es) of this run's memory cgroup meanwhile (pid {pid}){memory}{advice}"
        )
    if log is not None:
        return (
            f"{who} died (SIGKILL): not by the out-of-memory killer (none in the kernel log; "
            f"pid {pid}{memory})"
        )
    return (
        f"{who} died (SIGKILL; pid {pid}{memory}); the kernel log is not readable here to tell whether "
        "the out-of-memory killer did it"
    )


# --------------------------------------------------------------------------------------------------
# interrupts


def last_checkpoint_note(output_dir: Path) -> str:
    """Where a stopped run's last complete checkpoint is, and how to continue from it."""
    from llamarl.control.run.checkpoint import CHECKPOINTS_DIR, find_latest

    found = find_latest(output_dir / CHECKPOINTS_DIR)
    if found is None:
        return "no checkpoint was written (--checkpoint-every N saves one every N steps)"
    return f"the last checkpoint is {found.path} (policy_version {found.step}); --resume continues from it"
