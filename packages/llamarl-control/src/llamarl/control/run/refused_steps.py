"""Steps the trainer refused: a non-finite advantage, loss or gradient never reaches the weights.

`PolicyTrainer` skips such a step's optimizer update (the same decision on every trainer rank; its
`policy_version` still advances, with the previous version's weights) and says so in the step's
metrics (`skipped_nonfinite`, `nonfinite_cause`). `RefusedSteps` turns that into what a user needs:
one line per refused step, naming the step and the first offending tensor, and after `limit` refusals
in a row the end of the run, in one line naming the checkpoint to resume from (a run whose every
update is refused only burns compute: something upstream, a reward or the data, is broken).
"""

from __future__ import annotations

from collections.abc import Callable


class TrainingStopped(RuntimeError):
    """The run stopped because its updates kept being refused; the message says why and where to resume.
    One line for the user (`llamarl.control.launch.failures.is_user_error`)."""


class RefusedSteps:
    """Counts the steps refused in a row; `check` takes each step's trainer metrics."""

    def __init__(self, limit: int, where_to_resume: Callable[[], str]) -> None:
        """`limit`: refusals in a row that stop the run; `where_to_resume()`: the sentence that names the
        last checkpoint (or says there is none)."""
        self.limit = limit
        self.where_to_resume = where_to_resume
        self.in_a_row = 0
        self.total = 0

    def check(self, metrics: dict[str, float | str], policy_version: int) -> str | None:
        """Takes the trainer's metrics of the step that made `policy_version` (removing the cause, which
        is text); returns the line to show when the step was refused, None otherwise. Raises
        TrainingStopped at the `limit`-th refusal in a row."""
        cause = metrics.pop("nonfinite_cause", None)
        if not metrics.get("skipped_nonfinite"):
            self.in_a_row = 0
            return None
        self.in_a_row += 1
        self.total += 1
        line = (
            f"step {policy_version}: update skipped, non-finite {cause}; the weights are those of "
            f"step {policy_version - 1} ({self.in_a_row} in a row, the run stops at {self.limit})"
        )
        if self.in_a_row >= self.limit:
            raise TrainingStopped(
                f"{self.in_a_row} updates in a row skipped for non-finite values (the last: {cause}, step "
                f"{policy_version}): check the rewards and the data; {self.where_to_resume()}"
            )
        return line
