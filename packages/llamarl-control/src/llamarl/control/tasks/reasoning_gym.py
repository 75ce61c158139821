"""reasoning-gym's procedural tasks as llamarl tasks: `task.name = "reasoning_gym:basic_arithmetic"`.

reasoning-gym (https://github.com/open-thought/reasoning-gym) generates questions with verified answers
in code (about a hundred generators: arithmetic, algebra, logic, games, graphs, ...): no data files, no
network, any number of rows from a seed, and a `score_answer` per generator. That makes it the offline
default among the environment libraries (verifiers environments need an OpenAI-compatible server and a
rollout loop of their own; OpenEnv environments run as HTTP servers in containers).

The model is asked to put its final answer in `<answer>...</answer>` (reasoning-gym's own convention);
the reward is the generator's `score_answer` on the last such tag (0 without one). The test split is
generated from another seed than the train split.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from llamarl.control.tasks.task import Task, TaskError

ANSWER_FORMAT = "Give only the final answer inside <answer></answer> tags, e.g. <answer>42</answer>."
TEST_SEED_OFFSET = 1_000_003  # the test split's seed: far from any train seed a user would pick


@dataclass(frozen=True)
class ReasoningGymRows:
    """The rows of a reasoning-gym generator, per split (a picklable row source)."""

    dataset: str
    train_size: int = 2000
    test_size: int = 200
    seed: int = 0
    config: dict[str, Any] = field(default_factory=dict)

    def __call__(self, split: str) -> list[dict]:
        import reasoning_gym

        size = self.train_size if split == "train" else self.test_size
        seed = self.seed if split == "train" else self.seed + TEST_SEED_OFFSET
        dataset = reasoning_gym.create_dataset(self.dataset, size=size, seed=seed, **self.config)
        return [dict(entry) for entry in dataset]


def reasoning_gym_prompt(row: dict) -> str:
    """The question and the answer format reasoning-gym's scorers expect."""
    return f"{row['question']}\n\n{ANSWER_FORMAT}"


def reasoning_gym_score(prompt: list[dict], completion: str, row: dict) -> float:
    """reasoning-gym's own `score_answer` of the row's generator on the last `<answer>` tag (0 without)."""
    import reasoning_gym
    from reasoning_gym.utils import extract_answer

    answer = extract_answer(completion)
    if answer is None:
        return 0.0
    score = reasoning_gym.get_score_answer_fn(row["metadata"]["source_dataset"])
    return float(score(answer=answer, entry=row))


def reasoning_gym_correct(prompt: list[dict], completion: str, row: dict) -> bool:
    """Right when reasoning-gym's verifier gives the answer full marks (some give partial credit)."""
    return reasoning_gym_score(prompt, completion, row) == 1.0


def reasoning_gym_task(
    dataset: str,
    *,
    train_size: int = 2000,
    test_size: int = 200,
    seed: int = 0,
    tools: Sequence[Any] = (),
    **config: Any,
) -> Task:
    """A task of reasoning-gym generator `dataset` (its `config` passed on, e.g. `max_digits=3`);
    `tools` make it a multi-turn task with tool calls."""
    import reasoning_gym

    if dataset not in reasoning_gym.factory.DATASETS:
        known = sorted(reasoning_gym.factory.DATASETS)
        raise TaskError(
            f"reasoning-gym has no dataset {dataset!r}; it has {len(known)}, e.g. {', '.join(known[:8])}, ..."
        )
    return Task(
        name=f"rg_{dataset}",
        rows=ReasoningGymRows(dataset, train_size, test_size, seed, dict(config)),
        prompt=reasoning_gym_prompt,
        rewards=[reasoning_gym_score],
        correct=reasoning_gym_correct,
        fields=("question", "answer"),
        tools=tools,
    )
