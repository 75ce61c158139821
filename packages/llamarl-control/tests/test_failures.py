"""The one line a rank killed by a signal leaves (the out-of-memory reading runs for real in
tests/test_user_errors.py, under a memory cgroup)."""

from llamarl.control.failures import describe_killed


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
