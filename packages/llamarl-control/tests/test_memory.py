"""ProcessTreeMemory: the peaks of a process and of the processes it starts, labelled, and summed."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil
import pytest

from llamarl.comm.testing import wait_until
from llamarl.control.launch.memory import ProcessTreeMemory, memory_summary, own_peak

# A child that touches 300 MB, frees it, then idles: its peak is far above what it holds at the end.
CHILD = (
    "import time; b = bytearray(300 << 20); b[::4096] = b'x' * len(b[::4096]); del b; "
    "print('freed', flush=True); time.sleep(30)"
)


@pytest.mark.timeout(60)
def test_a_child_s_peak_is_counted_after_it_freed_its_memory():
    memory = ProcessTreeMemory("rank 9 generator", interval_s=0.1).start()
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "freed"  # (the test's timeout bounds this wait)
        time.sleep(0.3)  # a sample or two of the child holding little
        memory.stop()
    finally:
        child.kill()
        child.wait()
    processes = {p["pid"]: p for p in memory.processes()}
    assert processes[child.pid]["process"] == "rank 9 generator child (python)"
    assert processes[child.pid]["peak_rss_mb"] > 300  # the kernel's high-water mark, not the RSS now
    ours = processes[own_peak("x")["pid"]]
    assert ours["process"] == "rank 9 generator" and ours["peak_rss_mb"] > 10
    summary = memory_summary(memory.processes())
    assert summary["peak_rss_mb_total"] == pytest.approx(sum(p["peak_rss_mb"] for p in processes.values()))


@pytest.mark.timeout(60)
def test_spawned_workers_are_told_from_the_resource_tracker_by_what_they_run():
    # The launcher adds -Wignore:resource_tracker:UserWarning to every spawned child's command line: a
    # reward worker is still a worker, and only the tracker itself is the tracker.
    import multiprocessing as mp

    from llamarl.control.launch.memory import describe_process

    ctx = mp.get_context("spawn")
    warnoptions = list(sys.warnoptions)
    sys.warnoptions.append("ignore:resource_tracker:UserWarning")
    try:
        worker = ctx.Process(target=time.sleep, args=(30,))
        worker.start()
    finally:
        sys.warnoptions[:] = warnoptions
    try:
        import psutil

        me = psutil.Process()
        # Spawning forks, then execs: until the exec, the child's command line is still this process's.
        wait_until(
            lambda: "spawn_main" in " ".join(psutil.Process(worker.pid).cmdline()),
            timeout_s=20,
            what="the spawned worker's own command line",
        )
        labels = {
            p.pid: describe_process(p, me.pid, "rank 1 generator", "reward worker") for p in me.children()
        }
        assert labels[worker.pid] == "rank 1 generator reward worker", labels
        assert "rank 1 generator multiprocessing resource tracker" in labels.values(), labels
    finally:
        worker.kill()
        worker.join()


# A parent that touches 200 MB, then forks 3 children that keep it (copy-on-write, never written): four
# processes, each with 200 MB resident, holding 200 MB together.
SHARING = (
    "import os, sys, time; b = bytearray(200 << 20); b[::4096] = b'x' * len(b[::4096]); "
    "kids = [os.fork() or time.sleep(30) for _ in range(3)]; print('forked', flush=True); time.sleep(30)"
)


@pytest.mark.timeout(60)
def test_pages_shared_by_forked_processes_count_once_in_the_pss_total_and_in_full_in_each_rss():
    memory = ProcessTreeMemory("launcher", interval_s=0.1, at_once=True)
    parent = subprocess.Popen([sys.executable, "-c", SHARING], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout.readline().strip() == "forked"
        time.sleep(0.5)  # the children are up and resident
        forks = [child.pid for child in psutil.Process(parent.pid).children()]
        memory.start()
        memory.stop()
    finally:
        for child in psutil.Process(parent.pid).children():
            child.kill()
        parent.kill()
        parent.wait()
    ours = {parent.pid, *forks}  # (the test process may have other children: distributed test workers)
    shared = [p for p in memory.processes() if p["pid"] in ours and p["peak_rss_mb"] > 200]
    assert len(shared) == 4  # the parent and its 3 forks each count the 200 MB in their RSS
    rss_total = memory_summary(memory.processes())["peak_rss_mb_total"]
    assert rss_total > 800
    # Together they hold the 200 MB once: 600 MB less than their RSS summed (less a margin for the pages
    # of the interpreters, which count in full in RSS too).
    assert 200 < memory.at_once.peak_mb < rss_total - 450
