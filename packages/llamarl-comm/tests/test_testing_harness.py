"""The multi-process harness every package's distributed tests stand on: what it reports when ranks fail."""

from __future__ import annotations

import os
import time

import pytest

from llamarl.comm.testing import DistributedTestError, run_distributed, wait_until


def _values(rank: int, world_size: int, rdv, base: int) -> int:
    return base + rank * world_size


def test_values_come_back_by_rank() -> None:
    assert run_distributed(_values, 3, 10, timeout_s=60) == [10, 13, 16]


def _root_cause_and_echo(rank: int, world_size: int, rdv) -> None:
    failing = os.path.join(rdv.tmpdir, "rank1_failing")
    if rank == 1:
        open(failing, "w").close()
        raise ValueError("the root cause on rank 1")
    # Rank 0 fails second, as a peer of a dead rank does.
    wait_until(lambda: os.path.exists(failing), timeout_s=30, what="rank 1's failure")
    raise ConnectionError("rank 0 saw its peer go away")


def test_every_failing_rank_is_reported_not_only_the_first_seen() -> None:
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_root_cause_and_echo, 2, timeout_s=60)
    message = str(info.value)
    assert "rank 1 failed" in message and "the root cause on rank 1" in message, message
    assert "rank 0 failed" in message and "rank 0 saw its peer go away" in message, message


def _hang_on_rank_0(rank: int, world_size: int, rdv) -> int:
    if rank == 0:
        time.sleep(30)
    return rank


def test_a_hung_rank_is_a_timeout_naming_it() -> None:
    # The timeout counts from the call; warm the pooled workers first so that it is not spent importing
    # torch in brand-new processes (rank 1's function itself returns at once).
    run_distributed(_values, 2, 0, timeout_s=120)
    # With LLAMARL_TEST_FRESH_PROCESSES=1 there is no warm pool: rank 1 may still be importing torch.
    still_running = r"\[0(, 1)?\]" if os.environ.get("LLAMARL_TEST_FRESH_PROCESSES") == "1" else r"\[0\]"
    start = time.monotonic()
    with pytest.raises(
        DistributedTestError, match=rf"timed out after 5s; ranks still running: {still_running}"
    ):
        run_distributed(_hang_on_rank_0, 2, timeout_s=5)
    assert time.monotonic() - start < 20
