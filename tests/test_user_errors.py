"""What a user meets when a run cannot go on: one line and an exit code, every process ended, nothing lost.

Each test does to a real run what a user or the machine does: Ctrl-C in the terminal (SIGINT to the
whole process group), a scheduler's SIGTERM to the launcher and, after its grace period, SIGKILL, a
second run started on a folder in use, an output folder that cannot be created or written, a disk that
fills up during a checkpoint (a real 40 MiB tmpfs, mounted in a private mount namespace), and a rank
that the kernel's out-of-memory killer kills (a real memory cgroup limit).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from llamarl.control.run.checkpoint import find_latest

REPO = Path(__file__).resolve().parents[1]


def app_command(model: Path, data: Path, out: Path, *extra: str) -> list[str]:
    return [
        sys.executable, str(REPO / "apps" / "gsm8k_rl"), "--model", str(model), "--data", str(data),
        "--output-dir", str(out), "--prompts-per-step", "2", "--samples-per-prompt", "2",
        "--max-new-tokens", "8", "--eval-size", "0", "--no-save-model", "--no-wandb", *extra,
    ]  # fmt: skip


def app_env() -> dict[str, str]:
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    env.pop("LLAMARL_FAULT", None)
    return env


def steps_done(out: Path) -> int:
    try:
        lines = (out / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return 0
    return sum("train/reward_mean" in line for line in lines)


PROGRESS_BAR = re.compile(r"rl steps:[^\r\n\]]*\]")


def said(stderr: str) -> list[str]:
    """The lines a user reads in `stderr`: its lines without the run's progress bar (which redraws
    itself after carriage returns, and may share a line with what follows it)."""
    text = PROGRESS_BAR.sub("", stderr)
    return [line.strip() for line in re.split(r"[\r\n]", text) if line.strip()]


def wait_for(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


def processes_of_session(sid: int) -> list[psutil.Process]:
    alive = []
    for p in psutil.process_iter(["pid"]):
        try:
            if os.getsid(p.pid) == sid and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(p)
        except (psutil.Error, ProcessLookupError, PermissionError):
            continue
    return alive


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    ("how", "signum"), [("ctrl-c", signal.SIGINT), ("sigterm", signal.SIGTERM)], ids=["ctrl-c", "sigterm"]
)
def test_an_interrupted_stream_run_ends_every_process_says_where_its_checkpoint_is_and_resumes(
    tiny_model_dir, gsm8k_dir, tmp_path, how, signum
):
    out = tmp_path / "run"
    command = app_command(
        tiny_model_dir, gsm8k_dir, out, "--mode", "stream", "--steps", "200", "--checkpoint-every", "1"
    )
    process = subprocess.Popen(
        command, env=app_env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,  # its own session and process group, as a terminal gives a command
    )  # fmt: skip
    try:
        wait_for(lambda: steps_done(out) >= 3, 400, "three steps")
        if how == "ctrl-c":
            os.killpg(process.pid, signal.SIGINT)  # what the terminal does: every process of the group
        else:
            process.send_signal(signal.SIGTERM)  # what a scheduler does: the command it started
        _, stderr = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 128 + signum, stderr[-3000:]
    # One line: interrupted, every process ended, where the checkpoint is (no traceback from anyone,
    # no log line of torch elastic's).
    assert "Traceback" not in stderr, stderr[-3000:]
    found = find_latest(out / "checkpoints")
    assert found is not None and found.step >= 2
    assert said(stderr) == [
        f"gsm8k_rl: interrupted ({signal.Signals(signum).name}): every process of the run stopped; "
        f"the last checkpoint is {found.path} (policy_version {found.step}); --resume continues from it"
    ]
    wait_for(lambda: not processes_of_session(process.pid), 30, "every process of the run to end")
    if how == "sigterm":
        return
    # Nothing half-written is ever chosen: the resumed run continues from that checkpoint.
    steps = command.index("--steps") + 1
    command[steps] = str(found.step + 2)
    resumed = subprocess.run(
        [*command, "--resume"], env=app_env(), cwd=REPO, capture_output=True, text=True, timeout=500
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["resumed_from_step"] == found.step and summary["final_policy_version"] == found.step + 2


@pytest.mark.timeout(600)
def test_a_run_holds_its_folder_and_a_launcher_killed_with_sigkill_takes_every_process_along(
    tiny_model_dir, gsm8k_dir, tmp_path
):
    """A second run on a folder in use is refused in one line naming the first; SIGKILL to the launcher
    (a scheduler once its grace period is over) ends every process of the run (ranks, the server they
    fork from, reward workers) within 10 s; the lock the killed run left blocks nothing, and `--resume`
    there, with no checkpoint to resume from, says in one line that it starts fresh."""
    out = tmp_path / "run"
    command = app_command(tiny_model_dir, gsm8k_dir, out, "--steps", "200")
    first = subprocess.Popen(
        command, env=app_env(), cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,
    )  # fmt: skip
    try:
        wait_for(lambda: steps_done(out) >= 1, 400, "a first step")
        second = subprocess.run(
            app_command(tiny_model_dir, gsm8k_dir, out, "--steps", "1"),
            env=app_env(), cwd=REPO, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert second.returncode == 2, second.stderr[-3000:]
        [line] = said(second.stderr)
        assert re.fullmatch(
            rf"gsm8k_rl: error: output\.dir \(--output-dir\) {re.escape(str(out))} is in use by another run "
            rf"\(pid {first.pid} on {re.escape(socket.gethostname())}, since [0-9: -]+\w*\): "
            r"wait for it to end, or give another --output-dir",
            line,
        ), line
        first.kill()
        first.wait()
        wait_for(lambda: not processes_of_session(first.pid), 10, "every process of the killed run to end")
    finally:
        for process in processes_of_session(first.pid):
            with contextlib.suppress(psutil.Error):
                process.kill()
    resumed = subprocess.run(
        [*command[: command.index("--steps")], "--steps", "1", "--resume"],
        env=app_env(), cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert said(resumed.stderr) == [
        f"--resume: no complete checkpoint in {out / 'checkpoints'}: starting fresh"
    ]
    assert not (out / "errors").exists()  # a run in which nothing went wrong leaves no error records


@pytest.mark.parametrize("problem", ["create", "write"])
def test_an_output_folder_that_cannot_be_created_or_written_is_one_line(
    tiny_model_dir, gsm8k_dir, tmp_path, problem
):
    if problem == "create":
        (tmp_path / "a_file").write_text("not a folder")
        out = tmp_path / "a_file" / "run"
        expected = f"gsm8k_rl: error: output.dir (--output-dir) {out}: cannot create it (Not a directory)"
    else:
        out = Path("/sys/kernel")  # a folder that exists and takes no new files, not even from root
        expected = f"gsm8k_rl: error: output.dir (--output-dir) {out}: cannot write in it (Permission denied)"
    result = subprocess.run(
        app_command(tiny_model_dir, gsm8k_dir, out, "--steps", "1"),
        env=app_env(), cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(expected), lines


def memory_cgroup(name: str, limit_bytes: int) -> Path:
    """A child of this process's memory cgroup (v1 or v2) limited to `limit_bytes`; processes join it by
    writing their pid to its cgroup.procs. Needs the right to create cgroups (root, as CI runs)."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):  # v1
            group = Path("/sys/fs/cgroup/memory") / path.lstrip("/") / name
            limit_file = "memory.limit_in_bytes"
            break
    else:  # v2: the unified hierarchy
        path = next(line.split(":", 2)[2] for line in Path("/proc/self/cgroup").read_text().splitlines())
        group = Path("/sys/fs/cgroup") / path.lstrip("/") / name
        limit_file = "memory.max"
    group.mkdir(exist_ok=True)
    (group / limit_file).write_text(str(limit_bytes))
    return group


@pytest.mark.timeout(600)
def test_a_rank_killed_by_the_out_of_memory_killer_is_reported_as_such(tiny_model_dir, gsm8k_dir, tmp_path):
    """The run gets a real 4 GiB memory cgroup; at its first step the trainer allocates until the kernel's
    out-of-memory killer kills it (LLAMARL_FAULT 0:1:oom). The launcher says so in one line, quoting the
    kernel's record, with the memory the rank used."""
    group = memory_cgroup(f"llamarl-oom-test-{os.getpid()}", 4 << 30)
    out = tmp_path / "run"
    try:
        result = subprocess.run(
            app_command(tiny_model_dir, gsm8k_dir, out, "--mode", "sync", "--steps", "3"),
            env={**app_env(), "LLAMARL_FAULT": "0:1:oom"}, cwd=REPO, capture_output=True, text=True,
            timeout=500, preexec_fn=lambda: (group / "cgroup.procs").write_text(str(os.getpid())),
        )  # fmt: skip
    finally:
        for _ in range(50):  # the cgroup goes once its processes are gone
            try:
                group.rmdir()
                break
            except OSError:
                time.sleep(0.2)
    assert result.returncode == 1, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.strip() and "rl steps" not in line]
    assert len(lines) == 1, "\n".join(lines)
    assert lines[0].startswith(
        "gsm8k_rl: rank 0 (trainer) died (SIGKILL): the kernel's out-of-memory killer killed it ("
    ), lines
    assert "Killed process" in lines[0] and "MB with its engines and workers" in lines[0], lines


@pytest.mark.timeout(900)
def test_a_disk_that_fills_up_during_a_checkpoint_keeps_the_previous_one_for_the_resume(
    tiny_model_dir, gsm8k_dir, tmp_path
):
    """The output folder is a real 40 MiB tmpfs (mounted in a private user and mount namespace, so no
    privileges are needed): checkpoint 1 fits, checkpoint 2 does not. The run stops with one line
    naming the full disk and the checkpoint to resume from; the broken write leaves nothing that a
    resume would pick, and a resumed run continues from checkpoint 1."""
    driver = tmp_path / "driver.sh"
    out = tmp_path / "disk"
    out.mkdir()
    first = app_command(tiny_model_dir, gsm8k_dir, out / "run", "--steps", "3", "--checkpoint-every", "1")
    resumed = app_command(tiny_model_dir, gsm8k_dir, out / "run", "--steps", "3", "--resume")
    driver.write_text(
        "set -u\n"
        f"mount -t tmpfs -o size=40m tmpfs {out}\n"
        f"{' '.join(first)} 2> {tmp_path}/first.err; echo $? > {tmp_path}/first.rc\n"
        f"ls {out}/run/checkpoints > {tmp_path}/after_first.ls\n"
        f"{' '.join(resumed)} 2> {tmp_path}/resumed.err; echo $? > {tmp_path}/resumed.rc\n"
        f"cp {out}/run/summary.json {tmp_path}/summary.json\n"
    )
    subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", "bash", str(driver)],
        env=app_env(), cwd=REPO, timeout=850, check=True,
    )  # fmt: skip
    stderr = (tmp_path / "first.err").read_text()
    assert (tmp_path / "first.rc").read_text().strip() == "1", stderr[-3000:]
    lines = [line for line in stderr.splitlines() if line.strip() and "rl steps" not in line]
    assert len(lines) == 1, lines
    assert "No space left on device" in lines[0] and "step_00000001" in lines[0], lines
    assert (tmp_path / "after_first.ls").read_text().split() == ["step_00000001"]
    assert (tmp_path / "resumed.rc").read_text().strip() == "0", (tmp_path / "resumed.err").read_text()[
        -3000:
    ]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["resumed_from_step"] == 1 and summary["final_policy_version"] == 3
