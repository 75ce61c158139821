"""A generator rank's share of every evaluation: the held-out questions it answers, how each answer
scores (the task's reward, and whether it is right where the task says), and every answer written to
OUTPUT_DIR/eval_samples.rank{r}.jsonl beside the training samples.

Shape legend: Q held-out questions, K samples per question.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TextIO

import torch

from llamarl.control.run.evaluation import EVAL_SCORES
from llamarl.control.run.sampler import TaskSampler
from llamarl.control.tasks.prompts import TaskPrompts
from llamarl.control.tasks.task import Task

EVAL_CHUNK = 32  # questions per generate call during evaluation

GREEDY_REWARD, GREEDY_CORRECT, SAMPLED_REWARD, SAMPLED_CORRECT = range(len(EVAL_SCORES))


class HeldOutAnswers:
    """Answers this generator's questions (every `num_generators`-th from `first`) and scores them."""

    def __init__(
        self,
        *,
        task: Task,
        sampler: TaskSampler,
        prompts: TaskPrompts,
        log: TextIO,
        first: int,
        num_generators: int,
        samples: int,
        heartbeat: Callable[[], None],
    ) -> None:
        """`sampler` samples from the held-out `prompts`; `samples` is eval.samples (K, 0: greedy only);
        `heartbeat` is called between decoding steps and as answers are scored (the waiting ranks see
        progress)."""
        self.task = task
        self.sampler = sampler
        self.prompts = prompts
        self.log = log
        self.first = first
        self.num_generators = num_generators
        self.samples = samples
        self.heartbeat = heartbeat

    def score(self, scores_4Q: torch.Tensor, *, when: str, policy_version: int) -> None:
        """Writes this share's scores into `scores_4Q` (rows as `EVAL_SCORES`, zeros elsewhere)."""
        mine = list(range(scores_4Q.shape[1]))[self.first :: self.num_generators]
        for start in range(0, len(mine), EVAL_CHUNK):
            chunk = mine[start : start + EVAL_CHUNK]
            rewards, correct = self._answer(chunk, 1, when=when, version=policy_version)
            scores_4Q[GREEDY_REWARD, chunk], scores_4Q[GREEDY_CORRECT, chunk] = rewards, correct
            if self.samples:
                rewards, correct = self._answer(chunk, self.samples, when=when, version=policy_version)
                scores_4Q[SAMPLED_REWARD, chunk], scores_4Q[SAMPLED_CORRECT, chunk] = rewards, correct

    def _answer(
        self, questions: list[int], k: int, *, when: str, version: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K answers to each question (greedy when K is 1): their mean reward and the fraction right
        (zeros where the task does not say), each [len(questions)]; every answer logged."""
        sampled = self.sampler.sample(
            questions,
            samples_per_prompt=k,
            greedy=k == 1,
            between_steps=self.heartbeat,
            heartbeat=self.heartbeat,
        )
        rewards = sampled.batch.rewards_B.tolist()
        correct = []
        for j, (answer, reward) in enumerate(zip(sampled.answers, rewards, strict=True)):
            q = questions[j // k]
            verdict = self.task.is_correct(self.prompts.messages(q), answer, self.prompts.row(q), reward)
            correct.append(float(bool(verdict)))
            self._write(when, version, q, greedy=k == 1, text=sampled.texts[j], reward=reward, right=verdict)
        self.log.flush()
        per_question = (len(questions), k)
        return (
            torch.tensor(rewards, dtype=torch.float64).view(per_question).mean(1),
            torch.tensor(correct, dtype=torch.float64).view(per_question).mean(1),
        )

    def _write(
        self, when: str, version: int, q: int, *, greedy: bool, text: str, reward: float, right: bool | None
    ) -> None:
        record = {
            "when": when,
            "policy_version": version,
            "question_index": q,  # in the held-out split
            "greedy": greedy,
            "question": self.prompts.question(q),
            "completion": text,
            "reward": reward,
            "correct": right,  # null: the task does not say when an answer is right
        }
        self.log.write(json.dumps(record) + "\n")
