"""A synthetic arithmetic task: sums of two one-digit numbers, asked in a few phrasings.

Small instruct models answer these correctly some of the time when sampling (SmolLM2-135M-Instruct:
about 20% at temperature 1.0, close to 80% greedily), so a few minutes of RL on a CPU visibly sharpen
the policy. That makes it the task for showing, on a laptop-sized machine, that a run learns.

The held-out split keeps whole operand pairs out of training (every phrasing of `a + b` is either in
train or in test), so a better test score means better sums, not memorised questions. Rows use the
GSM8K schema (`question`, `answer` ending in `#### <number>`), so the GSM8K reward and loader apply.
"""

from __future__ import annotations

import random

from llamarl.control.tasks.gsm8k import gsm8k_row
from llamarl.control.tasks.task import Task
from llamarl.exec.reward.functions import gsm8k_answer, gsm8k_correct

PHRASINGS = (
    "What is {a} + {b}?",
    "Compute {a} + {b}.",
    "Add {a} and {b}.",
    "What is the sum of {a} and {b}?",
    "How much is {a} plus {b}?",
)
NUM_TEST_PAIRS = 20  # of the 100 operand pairs; with 5 phrasings: 400 train and 100 test questions
SPLIT_SEED = 1234  # fixed: the split must not move with the run's --seed


def arithmetic_rows(split: str) -> list[dict[str, str]]:
    """The rows of one split ("train" or "test") in the GSM8K schema, in a fixed order."""
    if split not in ("train", "test"):
        raise ValueError(f"unknown split {split!r}; expected 'train' or 'test'")
    pairs = [(a, b) for a in range(10) for b in range(10)]
    test_pairs = set(random.Random(SPLIT_SEED).sample(pairs, NUM_TEST_PAIRS))
    chosen = [p for p in pairs if (p in test_pairs) == (split == "test")]
    return [
        {"question": phrasing.format(a=a, b=b), "answer": f"{a} + {b} = {a + b}\n#### {a + b}"}
        for a, b in chosen
        for phrasing in PHRASINGS
    ]


ARITH = Task(
    name="arith",
    rows=arithmetic_rows,
    prompt="{question}\n\nGive the final number on its own line as '#### <number>'.",
    fields=("question",),
    prepare=gsm8k_row,
    rewards=[gsm8k_answer],  # the final number, as for GSM8K
    correct=gsm8k_correct,
)
