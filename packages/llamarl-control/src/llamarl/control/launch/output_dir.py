"""The output folder of a run: created and checked before any rank starts, and held by one run at a time.

Two runs writing into one folder would interleave their metrics, samples and checkpoints, and the second
would overwrite the first's config.toml while it runs. So a run holds OUTPUT_DIR/.llamarl.lock for its
life: an exclusive `flock` (the kernel drops it when the process ends however it ends: a run that died
never blocks the next one, `--resume` included), and in the file who holds it (host, pid, since when,
the job) for the message of a run that is refused.

Several machines of one job may share the folder: every machine's launcher writes its config.toml
there, and its ranks their files. The first to come holds the lock; the others find it held by the same
job (the rendezvous id every machine derives alike) and go on without holding it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from llamarl.control.cli import RESOLVED_CONFIG, write_config
from llamarl.control.config import ConfigError, RunConfig, replace_in

LOCK_FILE = ".llamarl.lock"
# The holder writes who it is just after it takes the lock: how long a refused run waits to read it.
HOLDER_WAIT_S = 2.0


def prepare_output_dir(path: Path) -> None:
    """Creates the output folder and checks that files can be written in it; a folder that cannot
    be is a one-line `ConfigError` naming the setting."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"output.dir (--output-dir) {path}: cannot create it ({_reason(e)})") from None
    probe = path / f".write-test-{os.getpid()}"
    try:
        probe.write_bytes(b"llamarl")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"output.dir (--output-dir) {path}: cannot write in it ({_reason(e)})") from None


def refuse_if_in_use(path: Path) -> None:
    """Prepares `path` and refuses in one line when another run holds it now: said first, before the
    model and the data load (the run takes the lock itself later, in `hold_output_dir`)."""
    prepare_output_dir(path)
    lock_path = path / LOCK_FILE
    if not lock_path.is_file():
        return
    fd = os.open(lock_path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        raise ConfigError(_in_use(path, _read_holder(lock_path))) from None
    finally:
        os.close(fd)  # (drops the shared lock, if taken)


@contextlib.contextmanager
def hold_output_dir(path: Path, job: str) -> Iterator[None]:
    """Prepares `path` (`prepare_output_dir`) and holds it for job `job` while the context lasts.

    Raises:
        ConfigError: another run holds it (one line naming that run's host, pid and start).
    """
    prepare_output_dir(path)
    lock_path = path / LOCK_FILE
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            _write_holder(fd, job)
        except BlockingIOError:
            holder = _read_holder(lock_path)
            if holder is None or holder.get("job") != job:  # not another machine of this job
                raise ConfigError(_in_use(path, holder)) from None
        yield
    finally:
        os.close(fd)  # drops the lock


def write_resolved_config(config: RunConfig) -> None:
    """OUTPUT_DIR/config.toml, replaced atomically: every machine writes it, maybe into one folder."""
    from llamarl.control.tasks.registry import task_origin

    path = config.output_dir / RESOLVED_CONFIG
    partial = path.with_name(f".{path.name}.{socket.gethostname()}-{os.getpid()}")
    origin = None if config.task.module else task_origin(config.task.name)
    # A task given in code (a script's `main(TASK)`) is recorded by where it can be imported again, so
    # that `--config OUTPUT_DIR/config.toml` reruns it from any app (`apps/task_rl`) as well.
    write_config(replace_in(config, **{"task.module": origin}) if origin else config, partial)
    os.replace(partial, path)


def _write_holder(fd: int, job: str) -> None:
    holder = {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "since": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "job": job,
    }
    data = json.dumps(holder).encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)


def _read_holder(lock_path: Path) -> dict[str, Any] | None:
    """Who holds the lock, as it wrote; None if it wrote nothing readable within `HOLDER_WAIT_S`."""
    deadline = time.monotonic() + HOLDER_WAIT_S
    while True:
        with contextlib.suppress(OSError, ValueError):
            holder = json.loads(lock_path.read_text())
            if isinstance(holder, dict):
                return holder
        if time.monotonic() > deadline:
            return None
        time.sleep(0.1)


def _in_use(path: Path, holder: dict[str, Any] | None) -> str:
    who = (
        f"pid {holder.get('pid')} on {holder.get('host')}, since {holder.get('since')}"
        if holder is not None
        else f"{path / LOCK_FILE} does not say which"
    )
    return (
        f"output.dir (--output-dir) {path} is in use by another run ({who}): "
        "wait for it to end, or give another --output-dir"
    )


def _reason(error: OSError) -> str:
    return error.strerror or type(error).__name__
