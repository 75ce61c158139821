"""The server the ranks fork from: each job's ranks see that job's environment, and the launcher still
finds its ranks (for their memory) below the server."""

from __future__ import annotations

import multiprocessing
import os
import time

import psutil

from llamarl.control.launch import launcher
from llamarl.control.launch.failures import rank_processes

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
            found = {p.pid for p in rank_processes(psutil.Process())}
            server = multiprocessing.forkserver._forkserver._forkserver_pid
            assert {rank.pid for rank in ranks} <= found
            assert server not in found  # the server's own memory is shared with the ranks, not theirs
        finally:
            for rank in ranks:
                rank.kill()
                rank.join(timeout=30)


# A training step in small: allocates and fills tensors of 4 to 64 MiB, frees them, five times over;
# prints the page faults of the last round.
_LAST_ROUND_FAULTS = """
import resource, torch
def faults(): return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    before = faults()
    held = [torch.empty(mb << 18).fill_(1.0) for mb in (4, 16, 64, 4, 16, 64)]
    del held
print(faults() - before)
"""


def _last_round_faults(tmp_path, name: str) -> int:
    import sys

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
