"""Held-out evaluation results, the statistics that say whether a run got better, and how the ranks
wait for an evaluation of any length.

Shape legend: Q  held-out questions.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

Z_95 = 1.959964  # two-sided 95% quantile of the standard normal


EVAL_SCORES = ("greedy_reward", "greedy_correct", "sampled_reward", "sampled_correct")
"""The rows of an evaluation's per-question scores (a [4, Q] tensor that every rank adds its share into,
`evaluate`): the greedy answer's reward and whether it is right, and over the K sampled answers the mean
reward and the fraction right."""


@dataclass(frozen=True, kw_only=True)
class EvalResult:
    """One evaluation of the generators' policy on the held-out questions.

    Accuracy is reported only where the task says when an answer is right (`Task.correct`); the mean
    reward always, under its own name (a task's rewards need not lie in [0, 1], nor mean "right").
    """

    policy_version: int  # the weights that answered
    greedy_reward_Q: list[float]  # the reward of the greedy answer
    greedy_correct_Q: list[float] | None = None  # 1.0 where it was right; None: the task does not say
    sampled_reward_Q: list[float] | None = None  # mean reward of the K sampled answers; None: not sampled
    sampled_correct_Q: list[float] | None = None  # the fraction of them that was right

    @classmethod
    def from_scores(
        cls, scores_4Q: list[list[float]], policy_version: int, *, sampled: bool, judged: bool
    ) -> EvalResult:
        """The result from the summed per-question scores (rows as `EVAL_SCORES`)."""
        greedy_reward, greedy_correct, sampled_reward, sampled_correct = scores_4Q
        return cls(
            policy_version=policy_version,
            greedy_reward_Q=greedy_reward,
            greedy_correct_Q=greedy_correct if judged else None,
            sampled_reward_Q=sampled_reward if sampled else None,
            sampled_correct_Q=sampled_correct if sampled and judged else None,
        )

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready fields (what a checkpoint keeps); `EvalResult(**d)` reads them back."""
        return asdict(self)

    @property
    def judged(self) -> bool:
        """Whether the task says when an answer is right (then there is an accuracy)."""
        return self.greedy_correct_Q is not None

    @property
    def has_samples(self) -> bool:
        return self.sampled_reward_Q is not None

    @property
    def accuracy(self) -> float | None:
        """The fraction of greedy answers that were right; None when the task does not say."""
        return None if self.greedy_correct_Q is None else _mean(self.greedy_correct_Q)

    @property
    def reward_mean(self) -> float:
        return _mean(self.greedy_reward_Q)

    @property
    def sampled_accuracy(self) -> float | None:
        return None if self.sampled_correct_Q is None else _mean(self.sampled_correct_Q)

    @property
    def sampled_reward_mean(self) -> float | None:
        return None if self.sampled_reward_Q is None else _mean(self.sampled_reward_Q)

    def metrics(self) -> dict[str, float]:
        """The metrics record of this evaluation, each figure under its true name."""
        figures = {
            "eval/accuracy": self.accuracy,
            "eval/reward_mean": self.reward_mean,
            "eval/sampled_accuracy": self.sampled_accuracy,
            "eval/sampled_reward_mean": self.sampled_reward_mean,
        }
        return {k: v for k, v in figures.items() if v is not None} | {
            "eval/policy_version": self.policy_version
        }

    def describe(self) -> str:
        """One line for the log: accuracy where there is one, the mean reward always."""
        parts = [] if self.accuracy is None else [f"greedy accuracy {self.accuracy:.3f}"]
        parts.append(f"greedy mean reward {self.reward_mean:.3f}")
        if self.sampled_accuracy is not None:
            parts.append(f"sampled accuracy {self.sampled_accuracy:.3f}")
        if self.sampled_reward_mean is not None:
            parts.append(f"sampled mean reward {self.sampled_reward_mean:.3f}")
        return f"{', '.join(parts)} on {len(self.greedy_reward_Q)} questions"


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def sum_over_ranks(
    scores_4Q: torch.Tensor, version: torch.Tensor, *, sampled: bool, judged: bool
) -> EvalResult:
    """The result of an evaluation from every rank's share (a collective, after `EvalProgress.wait`):
    scores summed per question (each question is answered on one rank, zeros elsewhere), the
    generators' policy version (all hold the same; the other ranks give 0)."""
    dist.all_reduce(scores_4Q)
    dist.all_reduce(version, op=dist.ReduceOp.MAX)
    return EvalResult.from_scores(scores_4Q.tolist(), int(version), sampled=sampled, judged=judged)


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


# --------------------------------------------------------------------------------------------------
# waiting for the generators


class CounterStore(Protocol):
    """The part of torch.distributed.Store the evaluation's progress needs."""

    def add(self, key: str, amount: int) -> int: ...


class EvalProgress:
    """How the ranks wait for evaluation `number` without a deadline on its length: the generators
    scoring their shares `beat()` as they go (between decoding steps, at most every `beat_s`) and say
    when they are `done()`; every rank `wait`s until all are, failing only after `timeout_s` without any
    progress. A collective would wait `launch.timeout_s` at most, whatever the evaluation's length."""

    def __init__(self, store: CounterStore, number: int, *, beat_s: float = 1.0) -> None:
        self.store = store
        self._done = f"eval/{number}/done"
        self._progress = f"eval/{number}/progress"
        self.beat_s = beat_s
        self._last_beat = float("-inf")

    def beat(self) -> None:
        now = time.monotonic()
        if now - self._last_beat >= self.beat_s:
            self._last_beat = now
            self.store.add(self._progress, 1)

    def done(self) -> None:
        self.store.add(self._done, 1)

    def wait(self, num_generators: int, *, timeout_s: float, poll_s: float = 0.2) -> None:
        """Until `num_generators` are done; raises TimeoutError after `timeout_s` without progress."""
        seen, since = -1, time.monotonic()
        while self.store.add(self._done, 0) < num_generators:
            progress = self.store.add(self._progress, 0)
            if progress != seen:
                seen, since = progress, time.monotonic()
            elif time.monotonic() - since > timeout_s:
                raise TimeoutError(
                    f"the evaluation made no progress for {timeout_s:.0f} s (launch.timeout_s): a "
                    "generator is stuck or gone"
                )
            time.sleep(poll_s)
