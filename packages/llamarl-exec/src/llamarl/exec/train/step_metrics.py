"""A training step's metrics: sums over its micro-batches, reduced over the trainer ranks once.

Shape legend:
    B  sequences in this rank's batch, M  sequences in a micro-batch, C  completion length
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from llamarl.exec.train.nonfinite import Finiteness
from llamarl.exec.train.parallel import all_reduce_max, all_reduce_sum

# Loss metrics named `*_max` are maxima over the batch (llamarl.algo's convention); every other metric
# is averaged over micro-batches weighted by their valid tokens.
_MAX_SUFFIX = "_max"


class StepTotals:
    """This rank's running sums of one step, added to after each micro-batch's backward."""

    def __init__(self) -> None:
        self.loss = 0.0
        self.logprob_sum = 0.0
        self.gap_sum = 0.0  # |log pi - log mu| over the sampled tokens
        self.entropy_sum = 0.0
        self.weighted: dict[str, float] = {}  # loss metric -> sum of (micro-batch mean x its tokens)
        self.maxima: dict[str, float] = {}  # `*_max` loss metric -> maximum so far

    def add(
        self,
        loss: torch.Tensor,
        logprobs_MC: torch.Tensor,
        behavior_MC: torch.Tensor,
        entropy_MC: torch.Tensor,
        mask_MC: torch.Tensor,
        loss_metrics: dict[str, torch.Tensor],
    ) -> None:
        """Adds one micro-batch: its loss (a scalar), the policy's and the generator's (behaviour)
        log-probs and the entropies of the completion tokens (0 where `mask_MC` is 0 for the entropy)
        and the loss's own metrics (means over its tokens)."""
        micro_tokens = int(mask_MC.sum())
        self.loss += float(loss.detach())
        self.logprob_sum += float(logprobs_MC.detach().masked_fill(mask_MC == 0, 0.0).sum())
        gap_MC = (logprobs_MC.detach() - behavior_MC).abs()
        self.gap_sum += float(gap_MC.masked_fill(mask_MC == 0, 0.0).sum())
        self.entropy_sum += float(entropy_MC.sum())  # (0 on padding)
        for name, value in loss_metrics.items():
            value = float(value)
            if name.endswith(_MAX_SUFFIX):
                self.maxima[name] = max(self.maxima.get(name, -math.inf), value)
            else:  # local means: weight by the tokens they averaged over (0 for an empty one)
                self.weighted[name] = self.weighted.get(name, 0.0) + (
                    value * micro_tokens if micro_tokens else 0.0
                )

    def reduce(
        self,
        rewards_B: torch.Tensor,
        advantages_B: torch.Tensor,
        *,
        num_valid_tokens: int,
        num_sequences: int,
        group: dist.ProcessGroup | None,
    ) -> tuple[dict[str, float], Finiteness]:
        """The step's metrics over every trainer rank (a collective over `group`), and whether its
        advantages and loss are finite here and everywhere (riding on the same all-reduce).

        `num_valid_tokens` and `num_sequences` are the whole batch's (already global).

        Returns:
            ({loss, logprob_mean, entropy_mean, reward_mean, advantage_abs_mean, num_valid_tokens,
            logprob_gap_abs_mean, and the loss's metrics}, Finiteness).
        """
        advantages_here = bool(torch.isfinite(advantages_B).all())
        loss_here = math.isfinite(self.loss)
        # Every rank ran the same loss, so the metric names agree; sort them so the reductions line up.
        weighted_names, max_names = sorted(self.weighted), sorted(self.maxima)
        sums = all_reduce_sum(
            [
                self.loss,
                self.logprob_sum,
                self.entropy_sum,
                float(rewards_B.float().sum()),
                float(advantages_B.abs().sum()),
                float(not advantages_here),
                float(not loss_here),
                self.gap_sum,
                *(self.weighted[n] for n in weighted_names),
            ],
            group,
        )
        highs = all_reduce_max([self.maxima[n] for n in max_names], group)
        denominator_tokens = max(num_valid_tokens, 1)  # an all-empty batch: zeros, not nan
        num_rows = max(num_sequences, 1)
        metrics = {
            "loss": sums[0],
            "logprob_mean": sums[1] / denominator_tokens,
            "entropy_mean": sums[2] / denominator_tokens,
            "reward_mean": sums[3] / num_rows,
            "advantage_abs_mean": sums[4] / num_rows,
            "num_valid_tokens": float(num_valid_tokens),
            # how far the trainer's log-probs are from the generator's (the spread of the IS weights)
            "logprob_gap_abs_mean": sums[7] / denominator_tokens,
        }
        metrics.update(
            {n: total / denominator_tokens for n, total in zip(weighted_names, sums[8:], strict=True)}
        )
        metrics.update(dict(zip(max_names, highs, strict=True)))
        finiteness = Finiteness(
            advantages_here=advantages_here,
            advantages_everywhere=sums[5] == 0,
            loss_here=loss_here,
            loss_everywhere=sums[6] == 0,
        )
        return metrics, finiteness
