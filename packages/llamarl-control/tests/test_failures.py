"""The one line a rank killed by a signal leaves (the out-of-memory reading runs for real in
tests/test_user_errors.py, under a memory cgroup), and a rank's interrupt that Python would swallow."""

import subprocess
import sys
import textwrap

from llamarl.control.launch.failures import describe_killed


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
