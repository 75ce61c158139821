"""Held-out evaluation results, the statistics that say whether a run got better, and how the ranks
wait for an evaluation of any length.

Shape legend: Q  held-out questions.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Any, Protocol

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
