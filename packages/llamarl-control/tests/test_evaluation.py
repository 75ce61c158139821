"""The statistics that decide whether a run got better."""

from __future__ import annotations

import pytest

from llamarl.control.run.evaluation import EvalResult, paired_delta_ci


def test_a_consistent_improvement_has_an_interval_above_zero():
    before = [0.0, 0.25, 0.5, 0.25, 0.0, 0.5, 0.25, 0.0] * 5
    after = [b + 0.25 + (0.25 if i % 2 else 0.0) for i, b in enumerate(before)]
    delta, low, high = paired_delta_ci(before, after)
    assert delta == pytest.approx(0.375)
    assert 0 < low < delta < high


def test_noise_around_no_change_has_an_interval_across_zero():
    before = [1.0, 0.0] * 20
    after = [0.0, 1.0] * 10 + [1.0, 0.0] * 10
    delta, low, high = paired_delta_ci(before, after)
    assert delta == pytest.approx(0.0)
    assert low < 0 < high


def test_the_interval_is_the_normal_interval_of_the_paired_differences():
    before, after = [0.0, 0.0, 1.0, 0.0], [1.0, 0.0, 1.0, 1.0]  # differences 1, 0, 0, 1
    delta, low, high = paired_delta_ci(before, after)
    sd = (sum((d - 0.5) ** 2 for d in (1, 0, 0, 1)) / 3) ** 0.5
    assert delta == 0.5
    assert high - delta == pytest.approx(1.959964 * sd / 2)
    assert delta - low == pytest.approx(high - delta)


def test_mismatched_question_lists_are_refused():
    with pytest.raises(ValueError, match="same 2"):
        paired_delta_ci([1.0, 0.0], [1.0])
    with pytest.raises(ValueError, match="same 2"):
        paired_delta_ci([1.0], [0.0])  # one question has no spread to measure
    assert paired_delta_ci([0.0, 1.0], [1.0, 1.0])[0] == 0.5  # two are enough


def test_an_evaluation_reports_accuracy_where_the_task_judges_and_the_mean_reward_always():
    # A task whose rewards sum to 1.5 (an answer checker plus a bonus): the mean reward is not accuracy.
    scores_4Q = [[1.5, 0.5, 1.5, 0.0], [1.0, 0.0, 1.0, 0.0], [0.75, 0.0, 1.5, 0.5], [0.5, 0.0, 1.0, 0.0]]
    judged = EvalResult.from_scores(scores_4Q, 3, sampled=True, judged=True)
    assert judged.accuracy == 0.5 and judged.reward_mean == 0.875
    assert judged.sampled_accuracy == 0.375 and judged.sampled_reward_mean == 0.6875
    assert judged.metrics() == {
        "eval/accuracy": 0.5,
        "eval/reward_mean": 0.875,
        "eval/sampled_accuracy": 0.375,
        "eval/sampled_reward_mean": 0.6875,
        "eval/policy_version": 3,
    }
    assert EvalResult(**judged.as_dict()) == judged  # what a checkpoint keeps reads back the same
    assert judged.describe() == (
        "greedy accuracy 0.500, greedy mean reward 0.875, sampled accuracy 0.375, sampled mean reward 0.688 "
        "on 4 questions"
    )
    unjudged = EvalResult.from_scores(scores_4Q, 3, sampled=False, judged=False)
    assert unjudged.accuracy is None and unjudged.sampled_accuracy is None and not unjudged.has_samples
    assert unjudged.metrics() == {"eval/reward_mean": 0.875, "eval/policy_version": 3}
    assert unjudged.describe() == "greedy mean reward 0.875 on 4 questions"


def test_the_summary_names_each_held_out_figure_truly_and_reads_old_checkpoints():
    from llamarl.control.outputs.summary import eval_summary
    from llamarl.control.run.legacy_checkpoints import evaluation

    start = EvalResult.from_scores([[1.5, 0.0], [1.0, 0.0], [0, 0], [0, 0]], 0, sampled=False, judged=True)
    end = EvalResult.from_scores([[1.5, 1.5], [1.0, 1.0], [0, 0], [0, 0]], 4, sampled=False, judged=True)
    summary = eval_summary([start, end])
    assert (summary["eval_accuracy_start"], summary["eval_accuracy_end"]) == (0.5, 1.0)
    assert (summary["eval_reward_start"], summary["eval_reward_end"]) == (0.75, 1.5)
    assert summary["eval_sampled_accuracy_start"] is None and "eval_sampled_reward_delta_ci95" not in summary
    assert summary["eval_history"][1] == {"policy_version": 4, "accuracy": 1.0, "reward_mean": 1.5}
    # An evaluation saved before accuracy and reward were told apart held rewards only.
    old = {"policy_version": 2, "greedy_Q": [1.0, 0.5], "sampled_Q": None}
    restored = EvalResult(**evaluation(old))
    assert restored.reward_mean == 0.75 and restored.accuracy is None


class _Counters:
    """A thread-safe stand-in for torch.distributed.Store's counters."""

    def __init__(self) -> None:
        import threading

        self.values: dict[str, int] = {}
        self._lock = threading.Lock()

    def add(self, key: str, amount: int) -> int:
        with self._lock:
            self.values[key] = self.values.get(key, 0) + amount
            return self.values[key]


def test_waiting_ranks_wait_as_long_as_the_evaluation_makes_progress_and_no_longer():
    import threading
    import time

    from llamarl.control.run.evaluation import EvalProgress

    store = _Counters()

    def generator(steps: int, step_s: float) -> None:
        progress = EvalProgress(store, 1, beat_s=0.05)
        for _ in range(steps):
            time.sleep(step_s)
            progress.beat()
        progress.done()

    # An evaluation of 1.5 s (two generators) with a 0.5 s deadline: it beats, so nobody times out.
    threads = [threading.Thread(target=generator, args=(30, 0.05)) for _ in range(2)]
    start = time.monotonic()
    for t in threads:
        t.start()
    EvalProgress(store, 1).wait(2, timeout_s=0.5, poll_s=0.02)
    assert time.monotonic() - start > 1.2
    for t in threads:
        t.join()
    # A generator that stopped making progress: the wait ends 0.5 s after its last beat.
    stuck = EvalProgress(store, 2, beat_s=0.0)
    stuck.beat()
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="no progress for 0 s"):
        EvalProgress(store, 2).wait(1, timeout_s=0.5, poll_s=0.02)
    assert 0.4 < time.monotonic() - start < 3


def test_progress_counts_one_per_beat_at_most_every_beat_s_and_one_per_done():
    from llamarl.control.run.evaluation import EvalProgress

    store = _Counters()
    progress = EvalProgress(store, 7)  # the default: at most one beat a second
    progress.beat()
    progress.beat()  # within the second: not counted
    assert store.values == {"eval/7/progress": 1}
    fast = EvalProgress(store, 7, beat_s=0.0)
    fast.beat()
    fast.beat()
    progress.done()
    assert store.values == {"eval/7/progress": 3, "eval/7/done": 1}
    # Everyone done: the wait returns at once, also with no progress at all, and says what it waits on.
    EvalProgress(store, 7).wait(1, timeout_s=0.0, poll_s=10.0)
    with pytest.raises(TimeoutError) as error:
        EvalProgress(store, 8).wait(1, timeout_s=0.1, poll_s=0.02)
    assert str(error.value) == (
        "the evaluation made no progress for 0 s (launch.timeout_s): a generator is stuck or gone"
    )
