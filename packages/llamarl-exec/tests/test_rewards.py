"""Reward functions on real GSM8K and MATH rows, and ProcessRewarder: weighted, batched and async
reward functions, timeouts and failures."""

from __future__ import annotations

import logging
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
from llamarl.exec.testing import async_match_reward, failing_reward, length_reward, slow_reward


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
    assert "verifier bug" in caplog.text
    assert "died" in caplog.text
    assert "returned 'yes', not a number" in caplog.text


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
