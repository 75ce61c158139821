"""Sampling and scoring a task's prompts on a generator rank: single-turn completions or multi-turn
episodes, both ending as a scored RolloutBatch.

- Single-turn: one `Generator.generate` call (samples_per_prompt completions per prompt), the
  completions decoded, the task's reward functions run by the `Rewarder` over (prompt messages,
  completion, row).
- Multi-turn (a task with tools or an environment): samples_per_prompt episodes per prompt, all in flight
  through the generator's `TurnSession` (`llamarl.exec.multiturn.episodes`), laid token-in/token-out as one
  completion with the environment's tokens masked out of the loss. An episode the environment finished
  with a reward keeps it; the others are scored by the task's reward functions on their last turn. An
  episode whose environment raised is dropped: nothing of it is trained on, and its reward is the mean
  of its group's other episodes (it moves no baseline); it is counted.

Used by the generator loop (training) and by evaluations (greedy).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch

from llamarl.control.run.in_flight import InFlightRequest
from llamarl.control.tasks.prompts import PromptSource
from llamarl.exec.config import SamplingConfig
from llamarl.exec.types import Generator, Rewarder, RolloutBatch


@dataclass(frozen=True)
class EpisodeSetup:
    """What multi-turn sampling needs beyond a single-turn task: the environments, the tokenizer and
    the chat template's glue for the environment's messages."""

    new_environment: Any  # () -> Environment: one per episode
    tokenizer: Any
    glue: Any  # llamarl.exec.multiturn.episodes.ChatGlue


@dataclass
class Sampled:
    """A scored batch and what the samples log and the metrics need."""

    batch: RolloutBatch
    texts: list[str]  # per sample: the completion, or the episode's turns as text
    answers: list[str]  # per sample: what is judged right or wrong (the completion, an episode's last turn)
    score_s: float = 0.0  # of the sampling time, the part spent scoring
    episodes_dropped: int = 0
    turns_mean: float = 1.0


class TaskSampler:
    """Samples and scores G completions (or episodes) of each prompt; see the module doc."""

    def __init__(
        self,
        *,
        generator: Generator,
        rewarder: Rewarder | None,
        source: PromptSource,
        sampling: SamplingConfig,
        episodes: EpisodeSetup | None = None,
        phase: Callable[[str], AbstractContextManager] | None = None,
    ) -> None:
        """`phase(name)`: a context the "generate" and "score" parts run in (the rank's timeline)."""
        self.phase = phase or (lambda name: contextlib.nullcontext())
        self.generator = generator
        self.rewarder = rewarder
        self.source = source
        self.sampling = sampling
        self.episodes = episodes

    def sample(
        self,
        indices: list[int],
        *,
        samples_per_prompt: int,
        greedy: bool = False,
        between_steps: Callable[[], None] | None = None,
        resume: InFlightRequest | None = None,
        heartbeat: Callable[[], None] | None = None,
    ) -> Sampled:
        """Samples and scores `samples_per_prompt` completions or episodes of each prompt in `indices`.

        `resume`: a paused request of these prompts, continued instead of starting anew (single-turn).
        `heartbeat`: called as the reward functions score the samples (an evaluation's progress).
        Raises `GenerationPaused` when `between_steps` paused the generate (single-turn only: an
        episode's turns are not paused)."""
        if self.episodes is not None:
            return self._episodes(indices, samples_per_prompt, greedy, between_steps)
        G = samples_per_prompt
        extra: dict[str, Any] = {"between_steps": between_steps} if between_steps is not None else {}
        if greedy:
            extra["greedy"] = True
        with self.phase("generate"):
            if resume is not None:
                batch = resume.resume(
                    self.generator, max_new_tokens=self.sampling.max_new_tokens, between_steps=between_steps
                )
            else:
                batch = self.generator.generate(
                    [self.source.encode(i) for i in indices],
                    samples_per_prompt=G,
                    max_new_tokens=self.sampling.max_new_tokens,
                    **extra,
                )
        texts = self.source.decode(batch)
        prompts = [self.source.messages(i) for i in indices for _ in range(G)]
        rows = [self.source.row(i) for i in indices for _ in range(G)]
        assert self.rewarder is not None, "a single-turn task is scored by its reward functions"
        start = time.perf_counter()
        with self.phase("score"):
            rewards = self.rewarder.score(prompts, texts, rows, progress=heartbeat)
            batch.rewards_B = torch.tensor(rewards, dtype=torch.float32)
        return Sampled(batch=batch, texts=texts, answers=texts, score_s=time.perf_counter() - start)

    def _episodes(self, indices: list[int], G: int, greedy: bool, between_steps) -> Sampled:
        from llamarl.exec.multiturn.episodes import episodes_to_batch

        setup = self.episodes
        assert setup is not None
        episodes = self._play(indices, G, greedy, between_steps)
        version = self.generator.policy_version
        batch = episodes_to_batch(
            episodes,
            group_size=G,
            pad_token_id=_pad_id(setup.tokenizer),
            policy_version=-1 if version is None else int(version),
        )
        start = time.perf_counter()
        batch.rewards_B = torch.tensor(self._episode_rewards(episodes, G), dtype=torch.float32)
        texts = [
            e.error if e.dropped else "\n".join(f"[{m['role']}] {m['content']}" for m in e.transcript)
            for e in episodes
        ]
        return Sampled(
            batch=batch,
            texts=texts,
            answers=["" if e.dropped else e.last_text for e in episodes],
            score_s=time.perf_counter() - start,
            episodes_dropped=sum(e.dropped for e in episodes),
            turns_mean=sum(e.turns for e in episodes) / max(len(episodes), 1),
        )

    def _play(self, indices: list[int], G: int, greedy: bool, between_steps) -> list:
        """G episodes of each prompt, all in flight through the generator's turn session, played out."""
        from llamarl.exec.multiturn.episodes import Episode, EpisodeLimits, run_episodes

        setup = self.episodes
        assert setup is not None
        episodes = [
            Episode(
                group=g,
                row=self.source.row(i),
                prompt_ids=self.source.encode(i),
                prompt_messages=self.source.messages(i),
                env=setup.new_environment(),
            )
            for g, i in enumerate(indices)
            for _ in range(G)
        ]
        session = self.generator.open_turns(greedy=greedy, between_steps=between_steps)
        with self.phase("generate"), contextlib.closing(session):
            run_episodes(
                episodes,
                session,
                tokenizer=setup.tokenizer,
                glue=setup.glue,
                limits=EpisodeLimits(
                    max_turns=self.sampling.max_turns,
                    max_new_tokens=self.sampling.max_new_tokens,
                    max_episode_tokens=self.sampling.max_episode_tokens,
                ),
            )
        return episodes

    def _episode_rewards(self, episodes: list, G: int) -> list[float]:
        """Each episode's reward: the environment's, else the task's reward functions' on its last turn;
        a dropped episode takes its group's mean (it moves no baseline)."""
        rewards = [0.0 if e.reward is None else float(e.reward) for e in episodes]
        unscored = [k for k, e in enumerate(episodes) if not e.dropped and e.reward is None]
        if unscored and self.rewarder is not None:
            with self.phase("score"):
                scores = self.rewarder.score(
                    [episodes[k].prompt_messages + episodes[k].transcript[:-1] for k in unscored],
                    [episodes[k].last_text for k in unscored],
                    [episodes[k].row for k in unscored],
                )
            for k, score in zip(unscored, scores, strict=True):
                rewards[k] = score
        for first in range(0, len(episodes), G):
            group = range(first, first + G)
            kept = [rewards[k] for k in group if not episodes[k].dropped]
            for k in group:
                if episodes[k].dropped:
                    rewards[k] = sum(kept) / len(kept) if kept else 0.0
        return rewards


def _pad_id(tokenizer) -> int:
    pad = tokenizer.pad_token_id
    return int(pad if pad is not None else tokenizer.eos_token_id)
