"""Reward functions on real GSM8K and MATH rows, and ProcessRewarder's timeouts and failures."""

from __future__ import annotations

import logging
import time

import pytest

from llamarl.exec import ProcessRewarder, RewardConfig, extract_gsm8k_answer, gsm8k_reward, math_reward
from llamarl.exec.testing import failing_reward, slow_reward


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
    with ProcessRewarder("gsm8k", RewardConfig(num_workers=2, timeout_s=30)) as rewarder:
        assert rewarder.score(completions, [r["answer"] for r in rows]) == [1.0, 0.0, 1.0, 1.0]
        assert rewarder.score([], []) == []


def test_process_rewarder_runs_math_verify_in_its_workers(shared_rows):
    rows = shared_rows("math/test.jsonl", 3)
    completions = [row["solution"] for row in rows]
    completions[0] = "The answer is \\boxed{12345}."
    with ProcessRewarder("math", RewardConfig(num_workers=1, timeout_s=60)) as rewarder:
        assert rewarder.score(completions, [row["answer"] for row in rows]) == [0.0, 1.0, 1.0]


def test_a_slow_sample_times_out_and_its_worker_is_replaced():
    with ProcessRewarder(slow_reward, RewardConfig(num_workers=2, timeout_s=1.0)) as rewarder:
        rewarder.score(["warm up"], ["x"])  # workers started and ready
        start = time.monotonic()
        scores = rewarder.score(["sleep 60", "fast", "fast", "fast"], ["x"] * 4)
        elapsed = time.monotonic() - start
        assert scores == [0.0, 1.0, 1.0, 1.0]
        assert elapsed < 10, "the hung sample must not block the batch"
        assert rewarder.num_timeouts == 1
        assert rewarder.score(["fast", "fast"], ["x", "x"]) == [1.0, 1.0]  # the replacement works


def test_a_failing_verifier_scores_zero_with_a_warning(caplog):
    with (
        caplog.at_level(logging.WARNING, logger="llamarl.exec.reward_pool"),
        ProcessRewarder(failing_reward, RewardConfig(num_workers=2, timeout_s=30)) as rewarder,
    ):
        scores = rewarder.score(["raise", "ok", "die", "ok"], ["x"] * 4)
        assert scores == [0.0, 1.0, 0.0, 1.0]
        assert rewarder.num_errors == 2
        assert rewarder.score(["ok"], ["x"]) == [1.0]
    assert "verifier bug" in caplog.text
    assert "died" in caplog.text


def test_unknown_reward_name_fails_fast():
    with pytest.raises(ValueError, match="valid names: gsm8k, math"):
        ProcessRewarder("nope", RewardConfig())
