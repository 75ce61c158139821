"""The processes of a run die with their launcher, however it dies (`kill -9` included).

A scheduler that cancels a job sends SIGTERM, waits, then sends SIGKILL to the process it started: the
launcher. Nothing of the launcher runs after a SIGKILL, and the ranks are not its children: they fork
from a server process (`multiprocessing`'s forkserver, `llamarl.control.launch.launcher`), which itself
stays up while any rank lives (every rank holds the pipe it watches). Left alone, the ranks, their
vLLM engines and reward workers run on for minutes, holding the machine's memory and GPUs.

So the kernel tells them, with a parent-death signal (Linux `prctl(PR_SET_PDEATHSIG)`, kept across
exec, cleared by fork, and sent when the *thread* that created the process exits):

- the fork server asks for `END_RUN_SIGNAL` when the launcher goes. It was started by the launcher's
  thread that runs the whole job (`launcher._rank_fork_server` starts it there, not in a thread of torch
  elastic's that may end). Its handler stops every process below the server (so that none can start
  another), kills them all (ranks, engines, workers, their helpers), and exits. The server's main loop
  waits in `select`, so the handler runs at once.
- each rank asks for SIGKILL when the fork server goes (set right after the fork, before the rank runs
  any of its own code), in case the server dies by other means.

The fork server imports this module first (`multiprocessing.set_forkserver_preload`); importing it arms
the server only in a process whose parent is the launcher that asked for it (`SERVER_PARENT_ENV`).
Where `prctl` is not available (not Linux) nothing is armed and processes end as they did before.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
from types import FrameType

import psutil

SERVER_PARENT_ENV = "LLAMARL_FORK_SERVER_PARENT"
"""Set by the launcher to its pid while it starts the fork server: the server arms itself for it."""
END_RUN_SIGNAL = signal.SIGRTMIN + 5
"""The fork server's parent-death signal: a real-time signal nothing else sends (SIGTERM and SIGUSR1 are
a scheduler's to send to a whole job)."""
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>

_server_pid: int | None = None  # in the fork server (and inherited by each rank it forks): its pid


def ask_for_parent_death_signal(signum: int) -> bool:
    """Has the kernel send `signum` to this process when its parent (the thread that started it) exits;
    False where that is not available."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def die_with_parent(parent: int, signum: int) -> None:
    """`signum` to this process when `parent` exits; at once if it has exited already (its children
    then belong to another process), since the kernel sends nothing for a death that came first."""
    if ask_for_parent_death_signal(signum) and os.getppid() != parent:
        os.kill(os.getpid(), signum)


def end_the_run(signum: int, frame: FrameType | None) -> None:
    """The fork server's handler of `END_RUN_SIGNAL`: every process below it is stopped, then killed,
    then the server exits."""
    stopped = freeze_descendants(psutil.Process())
    for process in stopped:
        with contextlib.suppress(psutil.Error):
            process.kill()
    os._exit(128 + int(signum))


def freeze_descendants(root: psutil.Process, rounds: int = 20) -> list[psutil.Process]:
    """Stops (SIGSTOP) every process below `root`, until a listing finds none it had not stopped: a
    stopped process starts no other, so none escapes the kill that follows. Returns them."""
    seen: dict[int, psutil.Process] = {}
    for _ in range(rounds):
        try:
            new = [p for p in root.children(recursive=True) if p.pid not in seen]
        except psutil.Error:
            break
        if not new:
            break
        for process in new:
            seen[process.pid] = process
            with contextlib.suppress(psutil.Error):
                process.suspend()
    return list(seen.values())


def _rank_dies_with_its_server() -> None:
    """In each process the fork server forks (a rank), before it runs: SIGKILL when the server exits;
    the server's own handler is not the rank's. Processes the rank forks later do nothing here."""
    global _server_pid
    server, _server_pid = _server_pid, None
    if server is None:
        return
    signal.signal(END_RUN_SIGNAL, signal.SIG_DFL)
    die_with_parent(server, signal.SIGKILL)


def _arm_fork_server() -> None:
    """In the fork server: end the run when the launcher exits; each rank forked dies with the server."""
    global _server_pid
    _server_pid = os.getpid()
    signal.signal(END_RUN_SIGNAL, end_the_run)
    os.register_at_fork(after_in_child=_rank_dies_with_its_server)
    launcher = int(os.environ.pop(SERVER_PARENT_ENV))  # (not passed on to the ranks' environment)
    die_with_parent(launcher, END_RUN_SIGNAL)


if os.environ.get(SERVER_PARENT_ENV) == str(os.getppid()):
    _arm_fork_server()
