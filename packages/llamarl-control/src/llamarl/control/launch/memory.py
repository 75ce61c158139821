"""Memory counted honestly: the peak resident memory of every process of a run, not only the ranks'.

A rank's own `getrusage(RUSAGE_SELF)` misses the processes it starts: its vLLM engine, its reward
workers, their helpers. `ProcessTreeMemory` is the one sampler of a process tree: from a daemon thread,
every `interval_s`, it reads the process it runs in and all its descendants (one read of
/proc/PID/status each), and keeps

- each process's peak: the kernel's own high-water mark (`VmHWM`, exact however short the peak) where
  Linux gives it, else the largest RSS sampled; a process that exits between two samples keeps the peak
  read at the last sample before. Each is labelled by what it runs (`describe_process`). The ranks use
  these for the summary.
- what each process held with every process below it at the last look that found it alive, and the
  machine's free memory at the last look: the launcher's evidence when the kernel's out-of-memory
  killer takes a rank (`tree_rss_mb`, `machine_mb`).
- optionally, the most the whole tree held at once (`PeakAtOnce`).

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import psutil

MB = 1 << 20

ProcessKind = Literal["main", "engine", "worker", "helper"]
"""What a process is to the run: "main", the process a sampler runs in (a rank, the launcher); "engine", a
vLLM engine; "worker", a worker process of the main one (a generator's reward workers); "helper",
everything else (an engine's helpers, the multiprocessing resource tracker, compilers the trainer runs)."""


@dataclass
class _Look:
    """One process at one sample: its parent, and its resident memory now and at its peak (bytes)."""

    ppid: int
    rss: int
    peak: int


@dataclass
class _Known:
    """One process as the sampler knows it over the run."""

    label: str
    kind: ProcessKind
    peak_rss_mb: float = 0.0


class ProcessTreeMemory:
    """Peak RSS of the calling process (`label`) and of every process below it, sampled in the background,
    and what each held at the last look.

    `start()` (or `with`) begins sampling, `stop()` takes a last sample and ends the thread; `processes()`
    lists the peaks so far. Descendants are labelled by what they run (`describe_process`); `worker_label`
    names the multiprocessing children of this process (a generator rank's are its reward workers).
    `at_once`: also track the most the whole tree held at one instant (`self.at_once.peak_mb`).
    """

    @classmethod
    def of_rank(cls, rank: int, role: str) -> ProcessTreeMemory:
        """The sampler of a rank's tree, its processes named for the summary ("rank 1 generator",
        "rank 1 generator reward worker", "rank 0 trainer worker process")."""
        workers = "reward worker" if role == "generator" else "worker process"
        return cls(f"rank {rank} {role}", worker_label=workers)

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
        self._known: dict[int, _Known] = {}
        self._tree_rss: dict[int, int] = {}  # pid -> its tree's RSS at the last look it was alive (bytes)
        self._machine_mb: tuple[float, float] | None = None
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

    def __enter__(self) -> ProcessTreeMemory:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def sample(self) -> None:
        """Reads every process of the tree alive now: its memory, its peak, its parent; and the
        machine's free memory."""
        try:
            processes = [self._root, *self._root.children(recursive=True)]  # one walk of the process table
        except psutil.Error:
            processes = [self._root]
        looks = {p.pid: look for p in processes if (look := _look(p)) is not None}
        if self.at_once is not None:
            self.at_once.sample(processes, sum(look.rss for look in looks.values()))
        memory = psutil.virtual_memory()
        with self._lock:
            for process in processes:
                if process.pid in looks:
                    self._remember(process, looks[process.pid])
            self._tree_rss.update(_tree_rss(looks))
            self._machine_mb = (memory.available / MB, memory.total / MB)

    def _remember(self, process: psutil.Process, look: _Look) -> None:
        known = self._known.get(process.pid)
        if known is None:
            if process.pid == self._root.pid:
                known = _Known(self.label, "main")
            else:
                what, kind = classify_process(process, self._root.pid, self.worker_label)
                known = _Known(f"{self.label} {what}", kind)
            self._known[process.pid] = known
        known.peak_rss_mb = max(known.peak_rss_mb, look.peak / MB)

    def processes(self) -> list[dict[str, Any]]:
        """[{"process": label, "pid": pid, "peak_rss_mb": peak, "kind": ProcessKind}, ...]: this process
        first, then its descendants in the order they were first seen."""
        with self._lock:
            return [
                {"process": k.label, "pid": pid, "peak_rss_mb": k.peak_rss_mb, "kind": k.kind}
                for pid, k in self._known.items()
            ]

    def tree_rss_mb(self, pid: int) -> float | None:
        """What process `pid` and every process below it held at the last look that found `pid` alive
        (MB): for a rank the kernel killed, what it held with its engines and workers just before.
        None if the sampler never saw `pid`."""
        with self._lock:
            held = self._tree_rss.get(pid)
        return None if held is None else held / MB

    def machine_mb(self) -> tuple[float, float] | None:
        """(available, total) memory of the machine at the last look, in MB."""
        with self._lock:
            return self._machine_mb


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

    def sample(self, processes: list[psutil.Process], rss_bytes_total: int) -> None:
        """Reads the PSS of `processes` if their RSS summed (`rss_bytes_total`) rose enough since."""
        now = time.monotonic()
        if rss_bytes_total <= self._rss_at_read * self.RISE or now - self._read_at < self.MIN_INTERVAL_S:
            return
        self._rss_at_read, self._read_at = rss_bytes_total, now
        self.peak_mb = max(self.peak_mb, sum(_pss_now(p) for p in processes) / MB)


def _tree_rss(looks: dict[int, _Look]) -> dict[int, int]:
    """Each process's RSS plus that of every process below it, from one look at all of them (bytes)."""
    totals = dict.fromkeys(looks, 0)
    for pid, look in looks.items():
        node, hops = pid, 0
        while node in looks and hops <= len(looks):  # up through its ancestors among them
            totals[node] += look.rss
            node, hops = looks[node].ppid, hops + 1
    return totals


def _look(process: psutil.Process) -> _Look | None:
    """The process's parent, RSS and peak RSS from one read of /proc/PID/status (psutil where there is
    none: no peak there but the RSS now); None once it is gone."""
    fields = _proc_fields(process.pid, "status", ("PPid", "VmRSS", "VmHWM"))
    if fields is not None and len(fields) == 3:
        return _Look(ppid=fields["PPid"], rss=fields["VmRSS"] * 1024, peak=fields["VmHWM"] * 1024)
    try:  # not Linux, or a kernel thread without Vm lines
        rss = process.memory_info().rss
        return _Look(ppid=process.ppid(), rss=rss, peak=rss)
    except psutil.Error:  # gone meanwhile
        return None


def _pss_now(process: psutil.Process) -> int:
    """The process's PSS (smaps_rollup); its RSS where the kernel does not give PSS; 0 once it is gone."""
    fields = _proc_fields(process.pid, "smaps_rollup", ("Pss",))
    if fields:
        return fields["Pss"] * 1024
    try:
        return process.memory_info().rss
    except psutil.Error:
        return 0


def _proc_fields(pid: int, file: str, names: tuple[str, ...]) -> dict[str, int] | None:
    """The figures of the lines "NAME: figure ..." of /proc/PID/FILE for `names` (kB for sizes); None
    where the file is not readable."""
    try:
        text = Path(f"/proc/{pid}/{file}").read_text()
    except OSError:
        return None
    found = {}
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        if name in names:
            try:
                found[name] = int(rest.split()[0])
            except (ValueError, IndexError):
                continue
    return found


def classify_process(process: psutil.Process, root_pid: int, worker_label: str) -> tuple[str, ProcessKind]:
    """What a descendant of a rank is, from its command line: (its name, its `ProcessKind`)."""
    try:
        command = " ".join(process.cmdline())
        parent = process.ppid()
        name = process.name()
    except psutil.Error:
        return "child", "helper"
    if "vllm/server.py" in command:  # llamarl.exec.generate.vllm.server, run as a script
        return "vllm engine", "engine"
    if "llamarl.exec.reward.worker" in command:  # `python -c` of llamarl.exec.reward.pool's workers
        return "reward worker", "worker"
    # The module it runs, not the bare name: every spawned child's command line carries the launcher's
    # "-Wignore:resource_tracker:UserWarning".
    if "multiprocessing.resource_tracker import" in command:
        return "multiprocessing resource tracker", "helper"
    if "multiprocessing" in command or "spawn_main" in command:
        return (worker_label, "worker") if parent == root_pid else ("engine helper", "helper")
    return f"child ({name})", "helper"


def describe_process(
    process: psutil.Process, root_pid: int, root_label: str, worker_label: str = "worker process"
) -> str:
    """How the summary names a descendant of a rank: "rank 1 generator reward worker"."""
    return f"{root_label} {classify_process(process, root_pid, worker_label)[0]}"


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
    look = _look(process)
    peak = 0 if look is None else look.peak
    return {"process": label, "pid": process.pid, "peak_rss_mb": peak / MB, "kind": "main"}
