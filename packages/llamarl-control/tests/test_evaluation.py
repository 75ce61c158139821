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


def test_eval_result_accuracies():
    result = EvalResult(policy_version=3, greedy_Q=[1.0, 0.0, 1.0, 1.0], sampled_Q=[0.5, 0.0, 0.25, 0.25])
    assert result.accuracy == 0.75 and result.sampled_accuracy == 0.25 and result.has_samples
    assert EvalResult(**result.as_dict()) == result  # what a checkpoint keeps reads back the same
    assert result.as_dict() == {
        "policy_version": 3,
        "greedy_Q": result.greedy_Q,
        "sampled_Q": result.sampled_Q,
    }
    greedy_only = EvalResult(policy_version=0, greedy_Q=[1.0, 0.0])
    assert not greedy_only.has_samples
    with pytest.raises(ValueError, match="eval_samples"):
        _ = greedy_only.sampled_accuracy


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
