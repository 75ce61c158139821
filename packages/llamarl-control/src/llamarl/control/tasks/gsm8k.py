"""GSM8K: grade-school math word problems; the reward is the final number (`#### <number>`)."""

from __future__ import annotations

from llamarl.control.tasks.task import DataError, Hub, Task
from llamarl.exec.reward.functions import gsm8k_answer, gsm8k_correct


def gsm8k_row(row: dict) -> dict | None:
    answer = row.get("answer")
    if not isinstance(answer, str):
        raise DataError("no reference answer (expected one of the fields answer)")
    return row if "####" in answer else None  # a worked answer without its final number: unusable


GSM8K = Task(
    name="gsm8k",
    rows=Hub("openai/gsm8k", config="main"),
    prompt="{question}\n\nSolve the problem step by step, then give the final number on its own line as "
    "'#### <number>'.",
    fields=("question",),
    prepare=gsm8k_row,
    rewards=[gsm8k_answer],
    correct=gsm8k_correct,
)
