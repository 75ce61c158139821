"""One run per output folder: a second run is refused in one line naming the first, another machine of
the same job goes on, and a run that died leaves nothing that blocks the next."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys

import pytest

from llamarl.control.config import ConfigError
from llamarl.control.launch.output_dir import LOCK_FILE, hold_output_dir

# Another process holds the folder for job "first" until its stdin closes (or it is killed).
HOLDER = """
import sys
from pathlib import Path
from llamarl.control.launch.output_dir import hold_output_dir

with hold_output_dir(Path(sys.argv[1]), "first"):
    print("holding", flush=True)
    sys.stdin.read()
"""


def _holder(folder) -> subprocess.Popen:
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(folder)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert holder.stdout.readline().strip() == "holding"
    return holder


@pytest.mark.timeout(60)
def test_a_folder_in_use_refuses_a_second_run_in_one_line_naming_the_first(tmp_path):
    folder = tmp_path / "run"
    holder = _holder(folder)
    try:
        with pytest.raises(ConfigError) as refused, hold_output_dir(folder, "second"):
            pass
        message = str(refused.value)
        assert "\n" not in message
        assert re.fullmatch(
            rf"output\.dir \(--output-dir\) {re.escape(str(folder))} is in use by another run "
            rf"\(pid {holder.pid} on {re.escape(socket.gethostname())}, "
            r"since \d{4}-\d\d-\d\d \d\d:\d\d:\d\d.*\): "
            r"wait for it to end, or give another --output-dir",
            message,
        ), message
        # Another machine of the same job (the same rendezvous id) shares the folder.
        with hold_output_dir(folder, "first"):
            pass
    finally:
        holder.communicate("")
    with hold_output_dir(folder, "second"):  # free once the first run ended
        pass


@pytest.mark.timeout(60)
def test_a_run_that_died_does_not_block_the_next(tmp_path):
    folder = tmp_path / "run"
    holder = _holder(folder)
    holder.kill()  # SIGKILL: nothing of it cleans up
    holder.wait()
    assert (folder / LOCK_FILE).exists()  # what it wrote stays, its lock went with it
    with hold_output_dir(folder, "next"):
        assert f'"pid": {os.getpid()}' in (folder / LOCK_FILE).read_text()
