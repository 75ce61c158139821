"""Reward functions on real GSM8K and MATH rows, and ProcessRewarder: weighted, batched and async
reward functions, timeouts and failures."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from llamarl.exec import (
    ProcessRewarder,
    Reward,
    RewardConfig,
    extract_gsm8k_answer,
    gsm8k_answer,
    gsm8k_reward,
    math_answer,
    math_reward,
)
from llamarl.exec.reward.functions import score_samples
from llamarl.exec.testing import (
    async_match_reward,
    busy_reward,
    failing_reward,
    length_reward,
    odd_reward,
    slow_reward,
)


def _score(rewarder: ProcessRewarder, completions: list[str], rows: list[dict] | None = None) -> list[float]:
    rows = rows if rows is not None else [{"answer": "x"}] * len(completions)
    return rewarder.score([[{"role": "user", "content": "q"}]] * len(completions), completions, rows)


def test_gsm8k_reward_on_real_rows(shared_rows):
    for row in shared_rows("gsm8k/test.jsonl", 5):
        reference = row["answer"]
        number = reference.rsplit("####", 1)[1].strip()
        assert gsm8k_reward(f"Let me think.\n#### {number}", reference) == 1.0
        assert gsm8k_reward(f"So the answer is {number}.", reference) == 1.0  # last number, no marker
        assert gsm8k_reward(f"#### {int(number.replace(',', '')) + 1}", reference) == 0.0
        assert gsm8k_reward("I do not know.", reference) == 0.0
        assert gsm8k_reward(reference, reference) == 1.0


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("#### 1,000", "1000"),
        ("The total is $18.00.", "18"),
        ("#### $5", "5"),
        ("2 apples and 3 pears, so 5 in all\n#### 5\nThe end: 7 more", "5"),  # marker wins
        ("-3", "-3"),
        ("0.50", "0.5"),
        ("no number", None),
    ],
)
def test_extract_gsm8k_answer(text, expected):
    assert extract_gsm8k_answer(text) == expected


def test_math_reward_on_real_rows(shared_rows):
    rows = shared_rows("math/test.jsonl", 6)
    for row in rows:
        assert math_reward(row["solution"], row["answer"]) == 1.0, row["answer"]
        assert math_reward("I give up.", row["answer"]) == 0.0  # no \boxed{}: no credit
    assert math_reward("\\boxed{5} no wait, \\boxed{10}", "10") == 1.0  # the last box counts
    assert math_reward("\\boxed{10} no wait, \\boxed{5}", "10") == 0.0
    assert math_reward("so $x = \\boxed{\\frac{9}{7}}$", "\\dfrac{9}{7}") == 1.0  # equivalent forms
    assert math_reward("\\boxed{1.5}", "\\frac{3}{2}") == 1.0
    assert math_reward("\\boxed{\\frac{9}{8}}", "\\dfrac{9}{7}") == 0.0
    assert math_reward("cut off inside \\boxed{\\frac{9}{", "\\dfrac{9}{7}") == 0.0


def test_process_rewarder_scores_in_order(shared_rows):
    rows = shared_rows("gsm8k/test.jsonl", 4)
    completions = [f"#### {r['answer'].rsplit('####', 1)[1].strip()}" for r in rows]
    completions[1] = "#### 123456789"
    with ProcessRewarder([gsm8k_answer], RewardConfig(num_workers=2, timeout_s=30)) as rewarder:
        assert _score(rewarder, completions, rows) == [1.0, 0.0, 1.0, 1.0]
        assert _score(rewarder, []) == []


def test_process_rewarder_runs_math_verify_in_its_workers(shared_rows):
    rows = shared_rows("math/test.jsonl", 3)
    completions = [row["solution"] for row in rows]
    completions[0] = "The answer is \\boxed{12345}."
    with ProcessRewarder([math_answer], RewardConfig(num_workers=1, timeout_s=60)) as rewarder:
        assert _score(rewarder, completions, rows) == [0.0, 1.0, 1.0]


def test_a_slow_sample_times_out_and_its_worker_is_replaced():
    with ProcessRewarder([slow_reward], RewardConfig(num_workers=2, timeout_s=1.0)) as rewarder:
        _score(rewarder, ["warm up"])  # workers started and ready
        start = time.monotonic()
        scores = _score(rewarder, ["sleep 60", "fast", "fast", "fast"])
        elapsed = time.monotonic() - start
        assert scores == [0.0, 1.0, 1.0, 1.0]
        assert elapsed < 10, "the hung sample must not block the batch"
        assert rewarder.num_timeouts == 1 and rewarder.num_failures == 1
        assert _score(rewarder, ["fast", "fast"]) == [1.0, 1.0]  # the replacement works


def test_a_failing_verifier_scores_zero_with_a_warning(caplog):
    with (
        caplog.at_level(logging.WARNING, logger="llamarl.exec.reward.pool"),
        ProcessRewarder([failing_reward], RewardConfig(num_workers=2, timeout_s=30)) as rewarder,
    ):
        scores = _score(rewarder, ["raise", "ok", "die", "ok", "text"])
        assert scores == [0.0, 1.0, 0.0, 1.0, 0.0]
        assert rewarder.num_errors == 3
        assert _score(rewarder, ["ok"]) == [1.0]
    assert "reward function 'failing_reward' raised RuntimeError: verifier bug; sample 0" in caplog.text
    assert "died (exit code 3) in reward function 'failing_reward'; sample 2" in caplog.text
    assert "reward function 'failing_reward' returned 'yes', not a number; sample 4" in caplog.text


def test_weighted_batched_and_async_rewards_add_up():
    rewards = [
        (async_match_reward, 2.0),
        Reward(length_reward, weight=-1.0, batched=True, name="brevity"),
        Reward(failing_reward, weight=0.5),
    ]
    rows = [{"answer": "abc"}, {"answer": "abc"}, {"answer": "x"}]
    with ProcessRewarder(rewards, RewardConfig(num_workers=2, timeout_s=30)) as rewarder:
        scores = _score(rewarder, ["abc", "raise", "x"], rows)
        # match x2, minus 1/(1 + len), plus half of failing_reward (raising on "raise": that part is 0)
        assert scores == pytest.approx([2.0 - 1 / 4 + 0.5, 0.0 - 1 / 6 + 0.0, 2.0 - 1 / 2 + 0.5])
        assert rewarder.num_errors == 1


def test_a_rewarder_needs_a_reward_function():
    with pytest.raises(ValueError, match="at least one reward function"):
        ProcessRewarder([], RewardConfig())


def test_a_reward_that_is_not_a_finite_number_costs_its_sample_as_a_raise_does(caplog):
    completions = ["nan", "ok", "inf", "none", "list", "ok"]
    with (
        caplog.at_level(logging.WARNING, logger="llamarl.exec.reward.pool"),
        ProcessRewarder(
            [odd_reward, (slow_reward, 0.5)], RewardConfig(num_workers=1, timeout_s=30)
        ) as rewarder,
    ):
        # odd_reward's part is 0 where it gave no finite number; slow_reward's half still counts
        assert _score(rewarder, completions) == [0.5, 1.5, 0.5, 0.5, 0.5, 1.5]
        assert rewarder.num_errors == 4 and rewarder.num_failures == 4
    lines = [r.getMessage() for r in caplog.records]
    assert (
        "reward function 'odd_reward' returned nan, not a finite number; "
        "sample 0 (prompt 'q', completion 'nan') scored 0"
    ) in lines
    assert (
        "reward function 'odd_reward' returned inf, not a finite number; "
        "sample 2 (prompt 'q', completion 'inf') scored 0"
    ) in lines
    assert any(
        line.startswith("reward function 'odd_reward' returned None, not a number; sample 3 (")
        for line in lines
    )
    assert any(
        line.startswith("reward function 'odd_reward' returned [1.0], not a number; sample 4 (")
        for line in lines
    )
    assert all("\n" not in line for line in lines)


def test_a_batched_reward_with_a_nan_costs_only_that_sample():
    def batched(prompts, completions, rows):
        return [float("nan") if c == "nan" else 0.5 for c in completions]

    scores, errors = score_samples([Reward(batched, batched=True)], [[]] * 3, ["a", "nan", "b"], [{}] * 3)
    assert scores == [0.5, 0.0, 0.5]
    assert errors == [None, "reward function 'batched' returned nan, not a finite number", None]
    [_], [error] = score_samples([Reward(lambda p, c, r: 1.0, batched=True, name="f")], [[]], ["a"], [{}])
    assert error == "reward function 'f' returned float, not a list of 1 scores"


def test_samples_that_hang_are_cut_together_naming_the_function(caplog):
    """One worker, four samples that sleep past the deadline: the pool starts workers beside the one
    that waits, so the batch costs about one deadline (it cost four, one after another)."""
    timeout_s = 2.0
    with (
        caplog.at_level(logging.WARNING, logger="llamarl.exec.reward.pool"),
        ProcessRewarder([slow_reward], RewardConfig(num_workers=1, timeout_s=timeout_s)) as rewarder,
    ):
        _score(rewarder, ["warm up"])
        start = time.monotonic()
        scores = _score(rewarder, ["sleep 60"] * 4 + ["fast"])
        elapsed = time.monotonic() - start
        assert scores == [0.0, 0.0, 0.0, 0.0, 1.0]
        assert rewarder.num_timeouts == 4
        assert elapsed < 2 * timeout_s, f"{elapsed:.1f} s: the hung samples were cut one after another"
        assert len(rewarder._workers) == 1  # the extra workers stopped with the batch
        assert _score(rewarder, ["fast"]) == [1.0]
    [line] = [r.getMessage() for r in caplog.records]
    assert line == (
        "reward function 'slow_reward' timed out after 2.0 s; sample 0 (prompt 'q', completion 'sleep 60') "
        "scored 0 (and 3 more samples of this batch)"
    )


def test_computing_workers_are_not_joined_by_more():
    """Scoring that keeps its worker on a CPU is not waiting: the pool stays at num_workers."""
    seen: list[int] = []
    with ProcessRewarder([busy_reward], RewardConfig(num_workers=1, timeout_s=10)) as rewarder:
        _score(rewarder, ["0"])
        done = threading.Event()

        def watch() -> None:
            while not done.wait(0.05):
                seen.append(len(rewarder._workers))

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            assert _score(rewarder, ["0.6"] * 3) == [1.0, 1.0, 1.0]
        finally:
            done.set()
            watcher.join()
    assert seen and max(seen) == 1


MAIN_SCRIPT = """
def shouted(prompt, completion, row):
    return float(row["word"].upper() in completion)


if __name__ == "__main__":  # the workers run this file as __mp_main__: only the definitions
    from llamarl.exec import ProcessRewarder, RewardConfig

    with ProcessRewarder([shouted], RewardConfig(num_workers=1, timeout_s=30)) as rewarder:
        print(rewarder.score([[], []], ["APPLE!", "apple"], [{"word": "apple"}] * 2))
"""


def test_a_reward_function_of_the_main_script_reaches_the_workers(tmp_path):
    import subprocess
    import sys

    (tmp_path / "my_task.py").write_text(MAIN_SCRIPT)
    result = subprocess.run(
        [sys.executable, "my_task.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "[1.0, 0.0]"
