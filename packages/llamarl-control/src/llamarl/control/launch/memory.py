"""Memory counted honestly: the peak resident memory of every process of a run, not only the ranks'.

A rank's own `getrusage(RUSAGE_SELF)` misses the processes it starts: its vLLM engine, its reward
workers, their helpers. `ProcessTreeMemory` samples a process and all its descendants (psutil) from a
daemon thread every `interval_s`, and keeps each process's peak: the kernel's own high-water mark
(`VmHWM` in /proc/PID/status, exact however short the peak) where Linux gives it, else the largest RSS
sampled. A process that exits between two samples keeps the peak read at the last sample before.

Two totals. `peak_rss_mb_total` sums per-process peaks: an upper bound of what the processes held at
any one instant (their peaks may fall at different times, and every process counts the pages it shares
with others in full: each process that imports torch counts libtorch's ~250 MB of library pages, each
rank forked from one server counts the pages it still shares with it). `peak_pss_mb_total` is the
largest sampled sum of proportional set sizes (PSS: a page shared by n processes counts 1/n in each):
what the processes held together at one instant, each page once (`PeakAtOnce`). The launcher samples it
over the whole run; tools/bench_modes.py measures TRL both ways too.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import psutil

MB = 1 << 20


class ProcessTreeMemory:
    """Peak RSS of the calling process (`label`) and of every process below it, sampled in the background.

    `start()` begins sampling, `stop()` takes a last sample and ends the thread; `processes()` lists the
    peaks so far. Descendants are labelled by what they run (`describe_process`); `worker_label` names
    the multiprocessing children of this process (a generator rank's are its reward workers).
    """

    def __init__(
        self,
        label: str,
        *,
        worker_label: str = "worker process",
        interval_s: float = 0.5,
        at_once: bool = False,
    ) -> None:
        self.label = label
        self.worker_label = worker_label
        self.interval_s = interval_s
        self._root = psutil.Process()
        self._peaks: dict[int, dict[str, Any]] = {}
        # The whole tree's memory at one instant (`peak_mb`), if asked for.
        self.at_once = PeakAtOnce() if at_once else None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> ProcessTreeMemory:
        """Samples now and then every `interval_s` until `stop()`."""
        self.sample()
        self._thread = threading.Thread(target=self._run, name="memory-sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Ends the sampling thread after one last sample (idempotent)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10 * self.interval_s + 5)
            self._thread = None
        self.sample()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def sample(self) -> None:
        """Reads the peak of this process and of each descendant alive now, and their PSS together."""
        try:
            children = self._root.children(recursive=True)
        except psutil.Error:
            children = []
        if self.at_once is not None:
            self.at_once.sample([self._root, *children])
        for process in [self._root, *children]:
            try:
                peak = _peak_rss_bytes(process)
                label = self.label if process.pid == self._root.pid else None
                with self._lock:
                    known = self._peaks.get(process.pid)
                    if known is None:
                        known = self._peaks[process.pid] = {
                            "process": label
                            or describe_process(process, self._root.pid, self.label, self.worker_label),
                            "pid": process.pid,
                            "peak_rss_mb": 0.0,
                        }
                    known["peak_rss_mb"] = max(known["peak_rss_mb"], peak / MB)
            except psutil.Error:  # exited (or not ours) between the listing and the read
                continue

    def processes(self) -> list[dict[str, Any]]:
        """[{"process": label, "pid": pid, "peak_rss_mb": peak}, ...]: this process first, then its
        descendants in the order they were first seen."""
        with self._lock:
            return [dict(p) for p in self._peaks.values()]


class PeakAtOnce:
    """The most memory a set of processes held together at one instant: their proportional set sizes
    summed (a page shared among them counted once), in MB (`peak_mb`).

    Reading a PSS makes the kernel walk every page the process maps (about 20 ms per GB, so every half
    second over a run's 8 GB would take a third of a core), so `sample` reads PSS only when the
    processes' summed RSS (cheap) is 5% above its value at the last read, and at most once a second:
    near the instants at which their memory peaks (a peak that recurs, each training step's, is read
    at one of its returns if the first came too soon)."""

    RISE = 1.05  # RSS creeps up by pages all run long: only a real rise is worth a read
    MIN_INTERVAL_S = 1.0

    def __init__(self) -> None:
        self.peak_mb = 0.0
        self._rss_at_read = 0
        self._read_at = -float("inf")

    def sample(self, processes: list[psutil.Process]) -> None:
        rss = sum(rss_bytes(p) for p in processes)
        now = time.monotonic()
        if rss <= self._rss_at_read * self.RISE or now - self._read_at < self.MIN_INTERVAL_S:
            return
        self._rss_at_read, self._read_at = rss, now
        self.peak_mb = max(self.peak_mb, sum(_pss_now(p) for p in processes) / MB)


def rss_bytes(process: psutil.Process) -> int:
    """The process's resident memory now (0 once it is gone)."""
    try:
        return process.memory_info().rss
    except psutil.Error:  # gone meanwhile
        return 0


def _pss_now(process: psutil.Process) -> int:
    """The process's PSS (smaps_rollup); its RSS where the kernel does not give PSS; 0 once it is gone."""
    pss = _proc_bytes(process.pid, "smaps_rollup", "Pss:")
    return rss_bytes(process) if pss is None else pss


def _peak_rss_bytes(process: psutil.Process) -> int:
    """The process's peak resident memory: the kernel's high-water mark where Linux reports it, else now."""
    peak = _proc_bytes(process.pid, "status", "VmHWM:")
    return process.memory_info().rss if peak is None else peak


def _proc_bytes(pid: int, file: str, field: str) -> int | None:
    """A kB figure of /proc/PID/FILE (its line starting with `field`) in bytes; None where it is not."""
    try:
        for line in Path(f"/proc/{pid}/{file}").read_text().splitlines():
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def describe_process(
    process: psutil.Process, root_pid: int, root_label: str, worker_label: str = "worker process"
) -> str:
    """What a descendant of a rank is, from its command line: the vLLM engine, a worker, a helper."""
    try:
        command = " ".join(process.cmdline())
        parent = process.ppid()
    except psutil.Error:
        return f"{root_label} child"
    if "vllm/server.py" in command:  # llamarl.exec.generate.vllm.server, run as a script
        what = "vllm engine"
    # The module it runs, not the bare name: every spawned child's command line carries the launcher's
    # "-Wignore:resource_tracker:UserWarning".
    elif "multiprocessing.resource_tracker import" in command:
        what = "multiprocessing resource tracker"
    elif "multiprocessing" in command or "spawn_main" in command:
        what = worker_label if parent == root_pid else "engine helper"
    else:
        what = f"child ({process.name()})"
    return f"{root_label} {what}"


def memory_summary(processes: list[dict[str, Any]], peak_pss_mb_total: float | None = None) -> dict[str, Any]:
    """The summary's memory figures (MB): every process's peak, their sum and, where sampled, the
    largest PSS of all of them at once."""
    figures = {
        "memory_per_process": processes,
        "peak_rss_mb_total": sum(p["peak_rss_mb"] for p in processes),
    }
    if peak_pss_mb_total is not None:
        figures["peak_pss_mb_total"] = peak_pss_mb_total
    return figures


def own_peak(label: str) -> dict[str, Any]:
    """The calling process's peak RSS so far, as one entry of `memory_per_process`."""
    process = psutil.Process()
    return {"process": label, "pid": process.pid, "peak_rss_mb": _peak_rss_bytes(process) / MB}
