"""What one RL step asks for: prompts, samples per prompt, prompt length and the output-length tail.

Output lengths follow a log-normal law cut at `max_new_tokens` (completions that reach it are cut
there). The simulator draws them as stratified quantiles in a seeded order, so the slowest sequence of
a step, the one a synchronous step waits for, is always represented, and runs repeat exactly.
"""

from __future__ import annotations

import functools
import math
import random
from statistics import NormalDist

from pydantic import BaseModel, Field


class Workload(BaseModel):
    """The work of one RL step (the same for every schedule, so schedules compare on equal work)."""

    prompts_per_step: int = Field(512, ge=1, description="prompts per optimizer step")
    samples_per_prompt: int = Field(8, ge=1, description="completions per prompt (the group)")
    prompt_tokens: int = Field(256, ge=1, description="tokens of every prompt")
    median_output_tokens: float = Field(300.0, gt=0, description="median completion length (log-normal law)")
    output_sigma: float = Field(
        0.8, ge=0, description="log-normal sigma of completion lengths: the weight of the long tail"
    )
    max_new_tokens: int = Field(1024, ge=1, description="completion length limit; longer ones are cut")

    @property
    def sequences(self) -> int:
        """Completions per step."""
        return self.prompts_per_step * self.samples_per_prompt

    def output_lengths(self, count: int | None = None, seed: int = 0) -> list[int]:
        """`count` completion lengths (default: one step's), stratified quantiles in a seeded order."""
        n = self.sequences if count is None else count
        return list(_lengths(self.median_output_tokens, self.output_sigma, self.max_new_tokens, n, seed))

    def mean_output_tokens(self) -> float:
        """The mean completion length of one step's draw (after the cut)."""
        lengths = self.output_lengths()
        return sum(lengths) / len(lengths)

    def describe(self) -> str:
        lengths = self.output_lengths()
        return (
            f"{self.prompts_per_step} prompts x {self.samples_per_prompt} samples = {self.sequences} "
            f"sequences; prompt {self.prompt_tokens} tokens; completions log-normal, median "
            f"{self.median_output_tokens:.0f}, sigma {self.output_sigma}, cut at {self.max_new_tokens} "
            f"(mean {sum(lengths) / len(lengths):.0f}, longest {max(lengths)}, "
            f"{sum(x == self.max_new_tokens for x in lengths) / len(lengths):.1%} cut)"
        )


@functools.lru_cache(maxsize=256)
def _lengths(median: float, sigma: float, cap: int, n: int, seed: int) -> tuple[int, ...]:
    """Stratified log-normal quantiles cut at `cap`, shuffled with `seed` (cached: pricing a step
    asks for the same draw many times)."""
    law = NormalDist(math.log(median), sigma) if sigma > 0 else None
    lengths = []
    for i in range(n):
        length = math.exp(law.inv_cdf((i + 0.5) / n)) if law is not None else median
        lengths.append(max(1, min(cap, round(length))))
    random.Random(seed).shuffle(lengths)
    return tuple(lengths)
