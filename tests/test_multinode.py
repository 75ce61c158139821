"""Several machines, for real: two launchers on this machine, each a "node" with ranks of its own, run
the same command and form one job through torch elastic (c10d rendezvous on a free local port).

Each node runs in a session of its own, so killing its process group (the ":node" fault) takes its
launcher and every rank it started, as a machine that goes down would.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from llamarl.comm.testing import free_port

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 90  # --timeout: the deadline of every wait, machines joining included


class Node:
    """One machine's launcher: the app started in a session of its own, from its own folder."""

    def __init__(self, name: str, cwd: Path, args: list[str], fault: str | None = None) -> None:
        cwd.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
        env.pop("LLAMARL_FAULT", None)
        if fault:
            env["LLAMARL_FAULT"] = fault
        self.name = name
        self.stdout = (cwd / f"{name}.stdout").open("w")
        self.stderr_path = cwd / f"{name}.stderr"
        self.stderr = self.stderr_path.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, str(REPO / "apps" / "gsm8k_rl"), *args],
            cwd=cwd,
            env=env,
            stdout=self.stdout,
            stderr=self.stderr,
            start_new_session=True,  # its own process group: the machine the ":node" fault kills
        )

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            self.stdout.close()
            self.stderr.close()

    def out(self) -> str:
        return Path(self.stdout.name).read_text()

    def err(self) -> str:
        return self.stderr_path.read_text()

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)


def job_args(model: Path, data: Path, port: int, output_dir: str, *extra: str) -> list[str]:
    return [
        "--model", str(model), "--data", str(data), "--output-dir", output_dir,
        "--steps", "3", "--prompts-per-step", "2", "--samples-per-prompt", "2", "--max-new-tokens", "8",
        "--eval-size", "0", "--no-save-model", "--no-wandb", "--timeout", str(TIMEOUT_S),
        "--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{port}", *extra,
    ]  # fmt: skip


def start_two_nodes(
    tmp_path: Path, args: list[str], port: int, *, faults: tuple[str | None, str | None] = (None, None)
) -> tuple[Node, Node]:
    """Node a first (it hosts the rendezvous, so it is torch elastic's node 0), then node b."""
    a = Node("a", tmp_path / "a", args, faults[0])
    deadline = time.monotonic() + TIMEOUT_S
    while not _listening(port):  # the first launcher hosts the rendezvous store
        assert a.proc.poll() is None and time.monotonic() < deadline, a.err()[-3000:]
        time.sleep(0.2)
    return a, Node("b", tmp_path / "b", args, faults[1])


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def holder_of_summary(a: Node, b: Node) -> tuple[Node, Node]:
    """(the node that printed the summary, the other one)."""
    return (a, b) if '"final_policy_version"' in a.out() else (b, a)


@pytest.fixture
def nodes():
    started: list[Node] = []
    yield started
    for node in started:  # a failed assertion must not leave a machine running
        node.kill()


@pytest.mark.timeout(400)
@pytest.mark.parametrize("mode", ["async", "stream"])
def test_two_machines_form_one_job_and_run_it_to_the_end(tiny_model_dir, gsm8k_dir, tmp_path, nodes, mode):
    """async: each machine writes into its own folder (no shared file system, the same relative
    --output-dir); stream: both into one shared folder."""
    port = free_port()
    output_dir = "run" if mode == "async" else str(tmp_path / "shared")
    args = job_args(tiny_model_dir, gsm8k_dir, port, output_dir, "--mode", mode)
    a, b = start_two_nodes(tmp_path, args, port)
    nodes += [a, b]
    assert a.wait(300) == 0, a.err()[-4000:]
    assert b.wait(60) == 0, b.err()[-4000:]
    holder, other = holder_of_summary(a, b)
    # One machine has the summary; the other says, in one line, where it is and exits 0 (after the
    # line of the generator it chose: hf, since machines on the CPU would each choose alone).
    summary_line = f"summary: {output_dir}/summary.json on "
    chose, where = other.out().strip().splitlines()
    assert chose.startswith("generator: hf (several machines on the CPU"), chose
    assert where.startswith(summary_line) and where.endswith("(the machine of the first trainer rank)")
    folder = {a: tmp_path / "a" / "run", b: tmp_path / "b" / "run"} if mode == "async" else {}
    holder_dir = folder.get(holder, tmp_path / "shared")
    summary = json.loads((holder_dir / "summary.json").read_text())
    assert summary["mode"] == mode and summary["steps"] == 3 and summary["final_policy_version"] == 3
    assert summary["num_trainers"] == 1 and summary["num_generators"] == 1
    # The generator (rank 1) ran on the other machine and logged its samples there.
    other_dir = folder.get(other, tmp_path / "shared")
    samples = [json.loads(line) for line in (other_dir / "samples.rank1.jsonl").read_text().splitlines()]
    assert samples and max(s["policy_version"] for s in samples) >= 1  # it received trained weights
    # Every machine logs into a folder of its own.
    log_folders = {p.name for d in {holder_dir, other_dir} for p in (d / "logs").iterdir() if p.is_dir()}
    assert len(log_folders) == 2, log_folders
    if mode == "async":
        assert not (other_dir / "summary.json").exists()


@pytest.mark.timeout(300)
def test_a_lost_machine_ends_the_job_with_one_line_naming_it(tiny_model_dir, gsm8k_dir, tmp_path, nodes):
    port = free_port()
    out = tmp_path / "shared"
    args = job_args(tiny_model_dir, gsm8k_dir, port, str(out), "--steps", "6")
    # Rank 1 (the generator) takes its whole machine down at the start of tick 2.
    a, b = start_two_nodes(tmp_path, args, port, faults=("1:2:node", "1:2:node"))
    nodes += [a, b]
    codes = {a: a.wait(300), b: b.wait(300)}
    ended = time.time()
    lost, survivor = (a, b) if codes[a] == -signal.SIGKILL else (b, a)
    assert codes[lost] == -signal.SIGKILL and codes[survivor] == 1, (codes, survivor.err()[-4000:])
    struck = json.loads((out / "errors" / "injected_fault.json").read_text())
    assert ended - struck["time"] < TIMEOUT_S
    # (The line may follow the unfinished progress bar of rank 0 on the same terminal line.)
    said = [line.partition("gsm8k_rl: ")[2] for line in survivor.err().splitlines() if "gsm8k_rl: " in line]
    assert len(said) == 1, survivor.err()[-3000:]
    assert said[0].startswith("node 1 (") and ", rank 1) was lost: " in said[0], said


@pytest.mark.timeout(500)
def test_a_machine_that_comes_back_resumes_the_job_from_the_latest_checkpoint(
    tiny_model_dir, gsm8k_dir, tmp_path, nodes
):
    port = free_port()
    out = tmp_path / "shared"
    args = job_args(
        tiny_model_dir, gsm8k_dir, port, str(out), "--steps", "4", "--checkpoint-every", "1",
        "--max-restarts", "1",
    )  # fmt: skip
    a, b = start_two_nodes(tmp_path, args, port, faults=("1:2:node", "1:2:node"))
    nodes += [a, b]
    # The machine of rank 1 goes down at the start of tick 2; the other waits for it to come back.
    deadline = time.monotonic() + 300
    while a.proc.poll() is None and b.proc.poll() is None:
        assert time.monotonic() < deadline, "no machine went down"
        time.sleep(0.5)
    lost, survivor = (a, b) if a.proc.poll() is not None else (b, a)
    assert lost.wait(10) == -signal.SIGKILL
    back = Node(f"{lost.name}2", tmp_path / lost.name, args)  # the same command, on the same machine
    nodes.append(back)
    assert survivor.wait(300) == 0, survivor.err()[-4000:]
    assert back.wait(60) == 0, back.err()[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["final_policy_version"] == 4
    assert summary["resumed_from_step"] >= 1
    assert "was lost: " in survivor.err() and "the job restarts when every machine is back" in survivor.err()
