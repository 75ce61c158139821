"""tools/gpu_check.sh's logic, checked on the CPU (`--cpu`): the weight sync compared bitwise, the DCP
round trip and the trace for the simulator's GPU calibration, through the same code the GPU run takes
(the app runs are the apps' own tests here)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from llamarl.sim import gpu_calibration

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(400)
def test_the_gpu_check_runs_its_checks_on_the_cpu_and_prints_one_table(tmp_path):
    result = subprocess.run(
        [
            "bash",
            str(REPO / "tools" / "gpu_check.sh"),
            "--cpu",
            "--checks",
            "sync,dcp,moe,trace",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=380,
        env={**os.environ, "PYTHON": sys.executable, "GPU_CHECK_TIMEOUT_S": "360"},
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    table = [line for line in result.stdout.splitlines() if line.startswith("| ")]
    assert table[0].split("|")[1].strip() == "check" and len(table) == 6, result.stdout
    rows = {line.split("|")[1].strip(): line for line in table[1:]}
    assert "| ok " in rows["weight sync -> hf"] and "bitwise equal" in rows["weight sync -> hf"]
    assert "| ok " in rows["dcp round trip"] and "AdamW moments equal" in rows["dcp round trip"]
    assert "| ok " in rows["gpu trace"], result.stdout
    # Same weights, float32 on both sides on the CPU: replay leaves no token routed apart.
    assert "| ok " in rows["moe routing replay [r3]"] and "routed apart" in rows["moe routing replay [off]"]
    # The trace is what the simulator's from-run calibrates a GPU from.
    trace = gpu_calibration.read_trace(tmp_path / gpu_calibration.TRACE_NAME)
    calibration = gpu_calibration.calibrate(trace)
    assert {"eager"} <= set(calibration.decode) and 0 < calibration.fitted["train_mfu"] <= 1
