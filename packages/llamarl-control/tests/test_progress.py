"""Progress marks (`llamarl.control.launch.progress`): what each rank's main thread last did, read back
by the launcher to name the rank the others waited for when a run ends on a timeout."""

from __future__ import annotations

import time

from llamarl.control.cli import parse_run_config
from llamarl.control.launch.failures import timed_out
from llamarl.control.launch.progress import (
    Progress,
    ProgressMark,
    describe_stall,
    progress_path,
    read_progress,
    stalled_rank,
)
from llamarl.control.outputs.timeline import Timeline


def config(timeout_s: float = 60.0, generators: int = 2):
    argv = ["--launch.timeout-s", str(timeout_s), "--num-generators", str(generators)]
    return parse_run_config(argv, task="arith", prog="arith_rl", description="")


def test_a_timeline_marks_each_phase_entered_and_left_and_a_clean_end_leaves_no_file(tmp_path):
    mark = ProgressMark(progress_path(tmp_path, 1))
    timeline = Timeline(observer=mark)
    with timeline.phase("generate", 3):
        with timeline.phase("score", 3):
            assert read_progress(tmp_path)[1].phase == "score"
        assert read_progress(tmp_path)[1].phase == "generate"  # back in the enclosing phase
        before = read_progress(tmp_path)[1].time
        time.sleep(0.01)
        mark.beat()
        assert read_progress(tmp_path)[1].time > before
    assert read_progress(tmp_path)[1] == Progress(1, read_progress(tmp_path)[1].time, 3, "after generate")
    assert read_progress(tmp_path)[1].doing() == "after generate, tick 3"
    mark.close()
    assert read_progress(tmp_path) == {} and not list(tmp_path.iterdir())


def test_the_stalled_rank_is_the_oldest_at_work_not_the_ones_waiting_for_it():
    cfg = config(timeout_s=60.0)  # ranks: 0 trainer, 1 and 2 generators
    now = 1000.0
    marks = {
        0: Progress(0, now - 61, 4, "rollouts"),  # the trainer waited longest, but it waited
        1: Progress(1, now - 45, 5, "generate"),  # stood still at work
        2: Progress(2, now - 2, 5, "weight_sync"),
    }
    stalled = stalled_rank(marks, cfg, now=now)
    assert stalled is not None and stalled.rank == 1
    assert describe_stall(stalled, cfg, now=now, gave_up=0) == (
        "rank 1 (generator) made no progress for 45 s (last: generate, tick 5); rank 0 gave up waiting "
        "for it after launch.timeout_s (60 s)"
    )
    # At work but only briefly: nobody stalled (the timeout has another cause).
    assert stalled_rank({**marks, 1: Progress(1, now - 10, 5, "generate")}, cfg, now=now) is None
    # In an evaluation the trainer waits while the generators answer.
    evaluating = {0: Progress(0, now - 50, -1, "eval"), 1: Progress(1, now - 40, -1, "eval")}
    assert stalled_rank(evaluating, cfg, now=now).rank == 1


def test_only_a_wait_that_ran_out_of_time_is_blamed_on_a_stalled_peer():
    assert timed_out({"error": "TimeoutError: the trainer took no rollouts for 60 s"})
    assert timed_out(
        {"error": "ChannelError: receiving rollouts from rank 1 failed: [gloo] Timed out waiting"}
    )
    assert not timed_out({"error": "ValueError: reward function returned garbage"})
