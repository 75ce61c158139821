"""A multi-turn task with a tool: two-digit sums and products, a calculator at hand.

The model may call the calculator (in its chat template's tool format) as often as it likes within the
turn limit; its answer without a tool call ends the episode, and the final number is checked. The rows
are made in code; the held-out split keeps whole operand pairs out of training.
"""

from __future__ import annotations

import random

from llamarl.control.tasks.task import Task
from llamarl.exec.multiturn.tools import Calculator
from llamarl.exec.reward.functions import gsm8k_answer, gsm8k_correct

PHRASINGS = ("What is {a} {op} {b}?", "Compute {a} {op} {b}.", "How much is {a} {op} {b}?")
SPLIT_SEED = 4321  # fixed: the split must not move with the run's seed


def calc_rows(split: str) -> list[dict]:
    """About 300 train and 100 test questions (train and test never share an operand pair)."""
    rng = random.Random(SPLIT_SEED)
    pairs = sorted({(rng.randint(11, 99), rng.randint(11, 99), rng.choice("+*")) for _ in range(400)})
    rng.shuffle(pairs)
    chosen = pairs[:100] if split == "test" else pairs[100:]
    rows = []
    for i, (a, b, op) in enumerate(chosen):
        value = a + b if op == "+" else a * b
        question = PHRASINGS[i % len(PHRASINGS)].format(a=a, b=b, op=op)
        rows.append({"question": question, "answer": f"#### {value}"})
    return rows[:100] if split == "test" else rows[:400]


CALC = Task(
    name="calc",
    rows=calc_rows,
    prompt="{question}\nYou may use the calculator. Then give the final number on its own line as "
    "'#### <number>'.",
    rewards=[gsm8k_answer],
    correct=gsm8k_correct,  # the final number of the last turn
    tools=[Calculator()],
)
