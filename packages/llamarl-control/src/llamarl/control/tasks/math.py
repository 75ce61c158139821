"""MATH: competition problems; the reward checks the last `\\boxed{}` with math-verify."""

from __future__ import annotations

from llamarl.control.tasks.task import DataError, Hub, Task
from llamarl.exec.reward.functions import last_boxed, math_answer, math_correct


def _math_row(row: dict) -> dict | None:
    """MATH rows: the `answer` column, else the last \\boxed{} of the solution."""
    present = [name for name in ("answer", "solution") if isinstance(row.get(name), str)]
    if not present:
        raise DataError("no reference answer (expected one of the fields answer, solution)")
    for name in present:
        value = row[name].strip()
        reference = (last_boxed(value) if name == "solution" else value) if value else None
        if reference:
            return {**row, "answer": reference}
    return None


MATH = Task(
    name="math",
    rows=Hub("DigitalLearningGmbH/MATH-lighteval"),
    prompt="{problem}\n\nSolve the problem step by step, then put the final answer in \\boxed{{}}.",
    fields=("problem",),
    prepare=_math_row,
    rewards=[math_answer],
    correct=math_correct,
)
