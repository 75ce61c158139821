"""Model rewards on a batch: what a reward rank (and a generator with the reward model colocated) does
to a batch the rule rewarder already scored.

The batch carries token ids and each sample's position in the data order, so the reward model reads the
task's own question (not the policy's chat template around it), the completion decoded from its ids,
and the reference; its score joins the rule reward with the weights of `reward_model`
(`combine_rewards`). Advantages are computed from the combined reward by the trainer, as for rule
rewards alone.

Shape legend: B sequences.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from llamarl.control.tasks.prompts import PromptSource
from llamarl.exec.config import RewardModelConfig
from llamarl.exec.reward.model import ModelRewarder, combine_rewards
from llamarl.exec.types import RolloutBatch


def add_model_rewards(
    batch: RolloutBatch,
    *,
    scorer: ModelRewarder,
    config: RewardModelConfig,
    source: PromptSource,
    index_of: Callable[[int], int],
    texts: list[str] | None = None,
) -> tuple[torch.Tensor, float]:
    """Scores `batch` with the reward model and replaces its rewards by the combined ones (in place).

    Args:
        batch: rewards_B holds the rule rewards; prompt_position_B names each sample's prompt.
        index_of: data-order position -> the example's index in `source`.
        texts: the completions, if already decoded (else decoded from the batch's ids).

    Returns:
        (the model's scores, float32 [B]; the seconds the reward model took)
    """
    assert batch.prompt_position_B is not None, "a batch to score names its prompts"
    indices = [index_of(int(p)) for p in batch.prompt_position_B]
    completions = source.decode(batch) if texts is None else texts
    start = time.perf_counter()
    model_B = torch.tensor(
        scorer.score(
            [question(source, i) for i in indices], completions, [reference(source.row(i)) for i in indices]
        ),
        dtype=torch.float32,
    )
    seconds = time.perf_counter() - start
    batch.rewards_B = combine_rewards(batch.rewards_B, model_B, config)
    return model_B, seconds


def question(source: PromptSource, index: int) -> str:
    """What the reward model reads as the question: the row's own `question` where it has one (not the
    policy's instructions around it), else the prompt's text."""
    value = source.row(index).get("question")
    return source.question(index) if value is None else str(value)


def reference(row: dict) -> str:
    """The reference answer a reference-guided reward model reads: the row's `answer` (where the built-in
    tasks keep it; a task of one's own names its reference so to use `with_reference`), else empty."""
    value = row.get("answer")
    return "" if value is None else str(value)
