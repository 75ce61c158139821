"""The one line a rank killed by a signal leaves (the out-of-memory reading runs for real in
tests/test_user_errors.py, under a memory cgroup), a rank's interrupts that Python would swallow or
complain about, and the error records a rank leaves."""

import re
import subprocess
import sys
import textwrap

import psutil
import pytest

from llamarl.control.launch.failures import (
    describe_killed,
    discard_unused_error_records,
    error_record,
    read_error_records,
    reserve_error_record,
    write_error_record,
)
from llamarl.control.launch.memory import ProcessTreeMemory

# A rank that touches 200 MB and starts a child of its own, then waits.
HOLDS_200_MB_WITH_A_CHILD = (
    "import subprocess, sys, time; b = bytearray(200 << 20); b[::4096] = b'x' * len(b[::4096]); "
    "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
    "print('ready', flush=True); time.sleep(60)"
)


def test_a_killed_rank_is_named_with_its_executor_when_known():
    assert (
        describe_killed(3, 4242, "SIGSEGV", None, role="reward") == "rank 3 (reward) died (SIGSEGV; pid 4242)"
    )
    assert describe_killed(0, 7, "SIGABRT", None) == "rank 0 died (SIGABRT; pid 7)"


def test_a_sigkilled_rank_names_its_executor_in_every_reading_of_the_kernel():
    # Whether or not this machine's kernel log is readable, the line starts with the rank and its role.
    assert describe_killed(2, 99999999, "SIGKILL", None, role="generator").startswith(
        "rank 2 (generator) died (SIGKILL"
    )


def test_an_interrupt_that_comes_during_a_finalizer_still_stops_the_rank():
    # torch elastic's SIGTERM can come while the garbage collector runs a weakref callback or a
    # `__del__`; Python swallows what is raised there, and the rank must stop all the same, quietly.
    script = textwrap.dedent(
        """
        import os, signal, sys, time
        from llamarl.control.launch.failures import Interrupted, raise_on_interrupt

        raise_on_interrupt()

        class SignalledWhileFinalized:
            def __del__(self):
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.2)  # the handler runs here, inside the finalizer

        try:
            SignalledWhileFinalized()
            time.sleep(20)
            print("ran on")
        except Interrupted as e:
            print("stopped by", e)
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=15)
    assert result.stdout.strip() == "stopped by SIGTERM", result.stdout + result.stderr
    assert result.stderr == ""


def test_sigint_and_sigterm_arriving_together_stop_the_rank_once_and_quietly():
    # Ctrl-C sends SIGINT to every process of the terminal's group while torch elastic sends SIGTERM to
    # each rank: both can be pending when the rank next runs Python. The second must be ignored without
    # Python's "OSError: Signal 15 ignored due to race condition" and its traceback.
    script = textwrap.dedent(
        """
        import os, signal, time
        from llamarl.control.launch.failures import Interrupted, raise_on_interrupt

        raise_on_interrupt()
        both = {signal.SIGINT, signal.SIGTERM}
        try:
            signal.pthread_sigmask(signal.SIG_BLOCK, both)
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGINT)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, both)  # both delivered at once
            time.sleep(20)
            print("ran on")
        except Interrupted as e:
            time.sleep(0.2)  # the rank's cleanup, during which the second signal is handled
            print("stopped by", e)
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=15)
    assert result.stdout.strip() == "stopped by SIGINT", result.stdout + result.stderr
    assert result.stderr == ""


def test_a_rank_that_did_not_fail_leaves_no_error_record(tmp_path):
    unused, used = tmp_path / "rank0.json", tmp_path / "rank1.json"
    for path in (unused, used):
        reserve_error_record(path)
    write_error_record(used, error_record(1, ValueError("bad"), "Traceback ..."))
    discard_unused_error_records(tmp_path)
    assert not unused.exists()
    assert read_error_records(tmp_path)[1]["error"] == "ValueError: bad"


@pytest.mark.timeout(60)
def test_a_killed_rank_is_named_with_what_it_and_the_machine_held_at_the_last_look():
    # The launcher's sampler saw a rank holding 200 MB with a child of its own, then the rank was killed:
    # the line says what the rank's whole tree held at the last look that found it alive.
    rank = subprocess.Popen(
        [sys.executable, "-c", HOLDS_200_MB_WITH_A_CHILD], stdout=subprocess.PIPE, text=True
    )
    try:
        assert rank.stdout.readline().strip() == "ready"
        memory = ProcessTreeMemory("launcher")
        memory.sample()
    finally:
        for child in psutil.Process(rank.pid).children():
            child.kill()
        rank.kill()
        rank.wait()
    memory.sample()  # the look after the kill finds the rank gone: what it held before stays known
    line = describe_killed(1, rank.pid, "SIGSEGV", memory, role="generator")
    held = re.fullmatch(
        rf"rank 1 \(generator\) died \(SIGSEGV; pid {rank.pid}; it held (\d+) MB with its engines and "
        r"workers, the machine had \d+ of \d+ MB free at the last look\)",
        line,
    )
    assert held is not None, line
    assert int(held.group(1)) > 200  # the rank's 200 MB and its child's interpreter


def test_the_launcher_keeps_torch_elastics_keepalive_race_out_of_its_output(capsys, monkeypatch):
    """After Ctrl-C, torch elastic's keep-alive finalizer can join its own thread; Python would print
    that ignored RuntimeError's traceback under the run's one line. Only that one is not printed."""
    import os

    from llamarl.control.launch.launcher import _quiet_torch_elastic

    monkeypatch.setattr(sys, "unraisablehook", sys.__unraisablehook__)
    _quiet_torch_elastic()
    where = os.path.join("torch", "distributed", "elastic", "rendezvous", "utils.py")

    class Finalized:
        """Raises `message` from a function of `filename` when collected, as a finalizer does."""

        def __init__(self, filename: str, message: str) -> None:
            namespace: dict = {}
            exec(compile(f"def stop():\n    raise RuntimeError({message!r})\n", filename, "exec"), namespace)
            self.stop = namespace["stop"]

        def __del__(self) -> None:
            self.stop()

    Finalized(where, "cannot join current thread")  # collected at once: an "ignored" exception
    assert capsys.readouterr().err == ""
    Finalized("elsewhere.py", "cannot join current thread")
    Finalized(where, "another error")
    printed = capsys.readouterr().err
    assert printed.count("Traceback") == 2 and "another error" in printed
