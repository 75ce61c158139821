"""The server the ranks fork from: each job's ranks see that job's environment, the launcher still
finds its ranks (for their memory) below the server, and the server and everything below it die with
the launcher, however it dies."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import subprocess
import sys
import time

import psutil
import pytest

from llamarl.comm.testing import wait_until
from llamarl.control.launch import launcher
from llamarl.control.launch.memory import ProcessTreeMemory

# Targets are library functions: a forked child finds them by module name (this test module's name is
# not importable there).


def test_each_job_forks_its_ranks_from_a_server_with_the_environment_of_its_launch(monkeypatch, tmp_path):
    monkeypatch.setattr(launcher, "RANK_PRELOAD", [])  # what the server imports does not matter here
    context = multiprocessing.get_context("forkserver")
    seen = []
    for value in ("first", "second"):
        monkeypatch.setenv("LLAMARL_TEST_LAUNCH", value)
        report = tmp_path / value
        with launcher._rank_fork_server():
            child = context.Process(target=os.system, args=(f'echo "$LLAMARL_TEST_LAUNCH" > {report}',))
            child.start()
            child.join(timeout=60)
        seen.append(report.read_text().strip())
    # A server kept from the first job would hand its environment ("first") to the second job's ranks.
    assert seen == ["first", "second"]


def test_the_launcher_finds_its_ranks_below_the_fork_server(monkeypatch):
    monkeypatch.setattr(launcher, "RANK_PRELOAD", [])
    context = multiprocessing.get_context("forkserver")
    with launcher._rank_fork_server():
        ranks = [context.Process(target=time.sleep, args=(60,)) for _ in range(2)]
        for rank in ranks:
            rank.start()
        try:
            memory = ProcessTreeMemory("launcher")
            memory.sample()
            server = multiprocessing.forkserver._forkserver._forkserver_pid
            for rank in ranks:
                held = memory.tree_rss_mb(rank.pid)
                assert held is not None and held > 1
                # the server's own memory is shared with the ranks, not theirs
                assert held == pytest.approx(psutil.Process(rank.pid).memory_info().rss / 2**20, rel=0.2)
            assert memory.tree_rss_mb(server) > sum(memory.tree_rss_mb(rank.pid) for rank in ranks)
        finally:
            for rank in ranks:
                rank.kill()
                rank.join(timeout=30)


# A launcher in small: two ranks forked from the server, each with a child of its own (an engine, a
# reward worker), all sleeping.
_LAUNCHER = """
import multiprocessing, subprocess, sys, time
from llamarl.control.launch import launcher

launcher.RANK_PRELOAD = []
with launcher._rank_fork_server():
    context = multiprocessing.get_context("forkserver")
    child = [sys.executable, "-c", "import time; time.sleep(120)", "rank-child"]
    for _ in range(2):
        context.Process(target=subprocess.run, args=(child,)).start()
    time.sleep(120)
"""


def _processes_of_session(sid: int) -> list[psutil.Process]:
    alive = []
    for process in psutil.process_iter():
        try:
            if os.getsid(process.pid) == sid and process.status() != psutil.STATUS_ZOMBIE:
                alive.append(process)
        except (psutil.Error, OSError):
            continue
    return alive


def _rank_children(sid: int) -> int:
    count = 0
    for process in _processes_of_session(sid):
        with contextlib.suppress(psutil.Error):
            count += process.cmdline()[-1:] == ["rank-child"]
    return count


@pytest.mark.timeout(120)
def test_a_launcher_killed_with_sigkill_takes_the_fork_server_its_ranks_and_their_children_along():
    launcher_process = subprocess.Popen([sys.executable, "-c", _LAUNCHER], start_new_session=True)
    sid = launcher_process.pid
    try:
        wait_until(lambda: _rank_children(sid) == 2, timeout_s=60, what="the ranks' children to start")
        assert len(_processes_of_session(sid)) >= 6  # launcher, server, tracker, 2 ranks, 2 children
        launcher_process.kill()  # what a scheduler does once its grace period is over
        launcher_process.wait()
        deadline = time.monotonic() + 10
        while _processes_of_session(sid) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = [(p.pid, p.name()) for p in _processes_of_session(sid)]
        assert not left, f"still running 10 s after the launcher was killed: {left}"
    finally:
        for process in _processes_of_session(sid):
            with contextlib.suppress(psutil.Error):
                process.kill()


# A training step in small: allocates and fills tensors of 4 to 64 MiB, frees them, seven times over;
# prints the fewest page faults of the last three rounds (glibc's reuse settles over a few rounds, not
# always by the fifth: 16k faults, one 64 MiB tensor mapped afresh, were seen there once).
_LAST_ROUND_FAULTS = """
import resource, torch
def faults(): return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
rounds = []
for _ in range(7):
    before = faults()
    held = [torch.empty(mb << 18).fill_(1.0) for mb in (4, 16, 64, 4, 16, 64)]
    del held
    rounds.append(faults() - before)
print(min(rounds[-3:]))
"""


def _last_round_faults(tmp_path, name: str) -> int:

    report = tmp_path / name
    context = multiprocessing.get_context("forkserver")
    with launcher._rank_fork_server():
        child = context.Process(
            target=os.system, args=(f"{sys.executable} -c '{_LAST_ROUND_FAULTS}' > {report}",)
        )
        child.start()
        child.join(timeout=120)
    return int(report.read_text())


def test_ranks_keep_the_memory_they_free_for_their_next_allocations(monkeypatch, tmp_path):
    monkeypatch.setattr(launcher, "RANK_PRELOAD", [])
    for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"):
        monkeypatch.delenv(name, raising=False)
    plain = _last_round_faults(tmp_path, "plain")
    with launcher._ranks_keep_freed_memory():
        kept = _last_round_faults(tmp_path, "kept")
    # 168 MiB a round is 43k pages: glibc maps most afresh each round (each page faults in again) unless
    # told to keep what was freed (glibc 2.36 needs a few rounds to reuse it all).
    assert plain > 20_000 and kept < plain // 4, (plain, kept)
    assert "MALLOC_TRIM_THRESHOLD_" not in os.environ  # the launcher's own environment is left as it was
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "1")  # a user's own setting stays
    with launcher._ranks_keep_freed_memory():
        assert os.environ["MALLOC_TRIM_THRESHOLD_"] == "1"
