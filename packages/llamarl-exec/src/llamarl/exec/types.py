"""Data that moves between executors, and the small Protocols executors implement.

Shape legend (suffixes on tensor names):
    B  sequences in the batch (num_prompts x samples_per_prompt, grouped: the samples of one prompt
       are contiguous)
    P  prompt length, left-padded to the longest prompt of the batch
    C  completion length, right-padded to the longest completion of the batch
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Protocol

import torch


@dataclass(kw_only=True)
class RolloutBatch:
    """Sampled completions with everything the trainer needs, as plain tensors.

    Every field is a tensor so a batch can cross a process boundary as tensors (see
    `llamarl.control.channels`), never as pickled Python objects.
    """

    prompt_ids_BP: torch.Tensor  # int64, left-padded with the pad token
    prompt_mask_BP: torch.Tensor  # int64, 1 on real prompt tokens
    completion_ids_BC: torch.Tensor  # int64, right-padded with the pad token
    completion_mask_BC: torch.Tensor  # int64, 1 on sampled tokens (EOS included), 0 on padding
    behavior_logprobs_BC: torch.Tensor  # float32, log mu(y_t) of the sampling distribution; 0 on padding
    rewards_B: torch.Tensor  # float32, one scalar reward per sequence
    policy_version_B: torch.Tensor  # int64, the policy_version that sampled the sequence's first token
    group_size: int  # samples per prompt; B is a multiple of it
    # int64, the policy_version that sampled each token (weights may change mid-sequence when a stream
    # generator takes new weights in flight); 0 on padding. None: every token of a sequence was sampled
    # by its policy_version_B (filled in by __post_init__).
    token_version_BC: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.token_version_BC is None:
            self.token_version_BC = self.policy_version_B[:, None] * self.completion_mask_BC.long()

    @property
    def num_sequences(self) -> int:
        return self.prompt_ids_BP.shape[0]

    @property
    def num_completion_tokens(self) -> int:
        return int(self.completion_mask_BC.sum())

    def token_lags_BC(self, current_version: int) -> torch.Tensor:
        """int64 [B, C]: how many policy versions behind `current_version` each token is (0 on padding)."""
        assert self.token_version_BC is not None
        return (current_version - self.token_version_BC) * self.completion_mask_BC.long()

    def select(self, rows: slice | list[int]) -> RolloutBatch:
        """The batch of the sequences in `rows` (views for a slice, copies for a list; padding kept)."""
        return RolloutBatch(
            **{name: t[rows] for name, t in self.tensors().items()}, group_size=self.group_size
        )

    def data_parallel_part(self, index: int, num_parts: int) -> RolloutBatch:
        """Part `index` of `num_parts` equal, consecutive parts of whole groups (one per trainer rank).

        Groups stay whole because advantages are computed within a group.
        """
        num_groups = self.num_sequences // self.group_size
        if num_groups % num_parts:
            raise ValueError(f"{num_groups} groups cannot be split evenly over {num_parts} trainer ranks")
        rows = self.num_sequences // num_parts
        return self.select(slice(index * rows, (index + 1) * rows))

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensor fields by name, in a fixed order (token_version_BC always present)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "group_size"}


class Generator(Protocol):
    """Samples completions. Owns the policy weights that `policy_version` names."""

    policy_version: int

    def setup(self) -> None: ...

    def generate(
        self,
        prompts: list[list[int]],
        *,
        samples_per_prompt: int,
        max_new_tokens: int,
        greedy: bool = False,
    ) -> RolloutBatch:
        """Samples `samples_per_prompt` completions per prompt (token ids); rewards are zeros."""
        ...

    def close(self) -> None: ...


class Rewarder(Protocol):
    """Scores completion texts against reference answers, in worker processes with a per-sample timeout."""

    def score(self, completions: list[str], references: list[str]) -> list[float]: ...

    def close(self) -> None: ...


class Trainer(Protocol):
    """Computes the loss on a RolloutBatch and takes one optimizer step per call."""

    policy_version: int

    def setup(self) -> None: ...

    def train_step(self, batch: RolloutBatch) -> dict[str, float]: ...

    def close(self) -> None: ...
