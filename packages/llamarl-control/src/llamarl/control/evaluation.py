"""Held-out evaluation results and the statistics that say whether a run got better.

Shape legend: Q  held-out questions.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

Z_95 = 1.959964  # two-sided 95% quantile of the standard normal


@dataclass(frozen=True, kw_only=True)
class EvalResult:
    """One evaluation of the generators' policy on the held-out questions."""

    policy_version: int  # the weights that answered
    greedy_Q: list[float]  # 1.0 where the greedy answer was right
    sampled_Q: list[float] | None = None  # mean reward of the sampled answers; None when not sampled

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready fields (what a checkpoint keeps); `EvalResult(**d)` reads them back."""
        return asdict(self)

    @property
    def accuracy(self) -> float:
        return sum(self.greedy_Q) / len(self.greedy_Q)

    @property
    def has_samples(self) -> bool:
        return self.sampled_Q is not None

    @property
    def sampled_accuracy(self) -> float:
        if self.sampled_Q is None:
            raise ValueError("this evaluation sampled no answers (eval_samples was 0)")
        return sum(self.sampled_Q) / len(self.sampled_Q)


def paired_delta_ci(before_Q: list[float], after_Q: list[float], z: float = Z_95) -> list[float]:
    """The mean change after - before over the same questions, with its normal confidence interval.

    Paired by question (the same questions are asked before and after), so the interval reflects how
    consistently questions improved, and samples of one question are not counted as independent.

    Returns:
        [delta, low, high]; low > 0 means the improvement is significant at that level.
    """
    if len(before_Q) != len(after_Q) or len(before_Q) < 2:
        raise ValueError(
            f"need the same 2+ questions before and after, got {len(before_Q)} and {len(after_Q)}"
        )
    d = [a - b for a, b in zip(after_Q, before_Q, strict=True)]
    n = len(d)
    mean = sum(d) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1))
    half = z * sd / math.sqrt(n)
    return [mean, mean - half, mean + half]
