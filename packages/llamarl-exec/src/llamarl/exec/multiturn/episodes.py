"""Multi-turn episodes, token-in/token-out, laid as one completion for the trainer.

Shape legend: B episodes (num_prompts x samples_per_prompt, a prompt's contiguous), P prompt length
(left-padded), C completion length (right-padded).

An episode starts from its prompt's token ids. Each model turn is sampled after the whole episode so far
(`TurnSession.submit`), and its tokens are kept exactly as sampled, with their behaviour log-probs and
the policy version that drew each (weights taken in flight included). The environment's reply
(`llamarl.exec.multiturn.environments`) is rendered through the chat template into token ids (`ChatGlue`) and
appended; the model's text is never detokenised and retokenised. The episode is laid as one completion
of the RolloutBatch:

    prompt | model turn 1 | env reply 1 | model turn 2 | ... | model turn k
    mask     1 ... 1        0 ... 0       1 ... 1              1 ... 1

`completion_mask_BC` is 1 on the model's tokens only, so the loss, the behaviour log-probs and the
token versions cover them, while the trainer still feeds the environment's tokens as input (it lays
every column up to the last model token: `llamarl.exec.train.packing.completion_span`). An episode always
ends with a model turn.

Limits: `max_turns` model turns, `max_new_tokens` per turn, `max_episode_tokens` for the whole
completion (model and environment tokens); an episode that hits one ends without the environment's
`Finish`. An environment that raises, or finishes with a reward that is not a finite number (NaN,
inf, a string), drops its episode: its completion is empty (nothing trained) and it is counted.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from llamarl.exec.multiturn.environments import Environment, Finish, ModelTurn, Reply
from llamarl.exec.multiturn.tools import parse_tool_calls
from llamarl.exec.padding import left_pad, right_pad
from llamarl.exec.types import RolloutBatch, TurnOutput

log = logging.getLogger(__name__)

_MARK = "\u2063llamarl-turn\u2063"  # stands for the model's text when the template glue is measured


class ChatGlue:
    """The token ids of the environment's messages after a model turn, as the chat template lays them.

    Measured once on a probe conversation: the text the template puts after an assistant message's
    content (e.g. `<|im_end|>\\n`), and the rendering of the environment's messages with the next
    generation prompt (`<|im_start|>tool\\n...<|im_end|>\\n<|im_start|>assistant\\n`). The model's own
    EOS token is already in its turn, so only what the template adds after it is laid (all of it when
    the turn hit its token limit without an EOS).
    """

    def __init__(self, tokenizer, *, tools: list[dict] | None = None) -> None:
        self.tokenizer = tokenizer
        self.tools = tools
        self._base = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _MARK}]
        rendered = self._render(self._base, generation_prompt=False)
        self._after_content = rendered[rendered.rindex(_MARK) + len(_MARK) :]
        self._base_text = rendered
        eos = tokenizer.eos_token or ""
        self._eos_text = eos if self._after_content.startswith(eos) else ""

    def _render(self, messages: list[dict], *, generation_prompt: bool) -> str:
        extra = {"tools": self.tools} if self.tools else {}
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt, **extra
        )

    def reply_ids(self, messages: list[dict[str, Any]], *, ended_with_eos: bool) -> list[int]:
        """Token ids laid after a model turn: the template's end of that turn, `messages`, and the
        generation prompt of the next model turn."""
        rendered = self._render([*self._base, *messages], generation_prompt=True)
        if not rendered.startswith(self._base_text):
            raise ValueError(
                "the chat template renders earlier turns differently once more messages follow; "
                "multi-turn episodes need a template that only appends"
            )
        glue = self._after_content[len(self._eos_text) :] if ended_with_eos else self._after_content
        text = glue + rendered[len(self._base_text) :]
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])


@dataclass
class Episode:
    """One episode: its prompt, its environment and the completion laid so far."""

    group: int  # index of its prompt in the batch
    row: dict
    prompt_ids: list[int]
    prompt_messages: list[dict[str, Any]]
    env: Environment
    ids: list[int] = field(default_factory=list)  # the completion: model and environment tokens
    mask: list[int] = field(default_factory=list)  # 1 on model tokens
    logprobs: list[float] = field(default_factory=list)  # behaviour log-probs (0 on env tokens)
    versions: list[int] = field(default_factory=list)  # policy versions (0 on env tokens)
    turns: int = 0
    last_text: str = ""  # the model's last turn (what the task's rewards score)
    transcript: list[dict[str, Any]] = field(default_factory=list)  # the turns as messages
    finished: bool = False  # the environment finished it (else a limit ended it)
    reward: float | None = None  # the environment's reward, when it gave one
    error: str | None = None  # why it was dropped (the environment raised)

    @property
    def dropped(self) -> bool:
        return self.error is not None


@dataclass(frozen=True)
class EpisodeLimits:
    """Limits of one episode."""

    max_turns: int
    max_new_tokens: int  # per model turn
    max_episode_tokens: int  # model and environment tokens of the whole completion


def run_episodes(
    episodes: list[Episode],
    session,
    *,
    tokenizer,
    glue: ChatGlue,
    limits: EpisodeLimits,
    parse: Callable[[str], tuple[list, list[str]]] | None = None,
) -> None:
    """Runs every episode to its end through `session` (a `TurnSession`), filling them in place.

    All episodes are in flight at once: each one's next turn is submitted as soon as its environment
    replied, while the others still decode.
    """
    parse = parse or (lambda text: parse_tool_calls(text, tokenizer))
    for key, episode in enumerate(episodes):
        try:
            episode.env.start(episode.row)
        except Exception as e:  # a broken environment costs its episode, not the run
            _drop(episode, e, "start")
            continue
        session.submit(key, episode.prompt_ids, min(limits.max_new_tokens, limits.max_episode_tokens))
    while True:
        outputs = session.wait()
        if not outputs:
            return
        for output in outputs:
            episode = episodes[output.key]
            follow_up = _take_turn(
                episode, output, tokenizer=tokenizer, glue=glue, limits=limits, parse=parse
            )
            if follow_up is not None:
                session.submit(output.key, episode.prompt_ids + episode.ids, follow_up)


def _take_turn(
    episode: Episode,
    output: TurnOutput,
    *,
    tokenizer,
    glue: ChatGlue,
    limits: EpisodeLimits,
    parse: Callable[[str], tuple[list, list[str]]],
) -> int | None:
    """Lays one model turn and the environment's reply; returns the next turn's token limit, or None
    when the episode is over."""
    episode.ids += output.token_ids
    episode.mask += [1] * len(output.token_ids)
    episode.logprobs += output.logprobs
    episode.versions += output.versions
    episode.turns += 1
    text = tokenizer.decode(output.token_ids, skip_special_tokens=True)
    episode.last_text = text
    episode.transcript.append({"role": "assistant", "content": text})
    calls, problems = parse(text)
    try:
        result = episode.env.step(ModelTurn(text, calls, episode.turns - 1, problems))
        if not isinstance(result, Reply | Finish):
            raise TypeError(f"step() returned {type(result).__name__}, not a Reply or a Finish")
    except Exception as e:
        _drop(episode, e, "step")
        return None
    if isinstance(result, Finish):
        problem = _not_a_reward(result.reward)
        if problem is not None:  # a NaN reward would spread to every advantage of its group
            _drop(episode, f"returned Finish(reward={problem}), not a finite number", "step")
            return None
        episode.finished, episode.reward = True, None if result.reward is None else float(result.reward)
        return None
    room = limits.max_episode_tokens - len(episode.ids)
    if episode.turns >= limits.max_turns or room <= 0:
        return None
    try:
        reply = glue.reply_ids(result.messages, ended_with_eos=output.ended)
    except Exception as e:  # messages the template cannot render: the environment's fault
        _drop(episode, e, "reply")
        return None
    if len(reply) >= room:  # no room left for a model turn after the reply
        return None
    episode.ids += reply
    episode.mask += [0] * len(reply)
    episode.logprobs += [0.0] * len(reply)
    episode.versions += [0] * len(reply)
    episode.transcript += result.messages
    return min(limits.max_new_tokens, room - len(reply))


def _not_a_reward(reward: Any) -> str | None:
    """What is wrong with an environment's reward (as shown), or None for a finite number or None."""
    if reward is None:
        return None
    try:
        if not isinstance(reward, str | bytes) and math.isfinite(float(reward)):
            return None
    except (TypeError, ValueError):
        pass
    text = repr(reward)
    return text if len(text) <= 60 else text[:57] + "..."


def _drop(episode: Episode, error: Exception | str, where: str) -> None:
    """Drops `episode`: `error` is what its environment raised, or what it did wrong."""
    what = error if isinstance(error, str) else f"raised {type(error).__name__}: {error}"
    episode.error = f"environment {where}() {what}"
    # Nothing of a dropped episode is trained on: its completion is emptied.
    episode.ids, episode.mask, episode.logprobs, episode.versions = [], [], [], []
    log.warning("episode dropped: %s", episode.error)


def episodes_to_batch(
    episodes: list[Episode], *, group_size: int, pad_token_id: int, policy_version: int
) -> RolloutBatch:
    """The episodes as one RolloutBatch (rewards zeros); `policy_version` stamps empty completions."""

    prompt_ids_BP, prompt_mask_BP = left_pad([e.prompt_ids for e in episodes], pad_token_id)
    B = len(episodes)
    ids_BC = right_pad([e.ids for e in episodes], pad_token_id, torch.int64)
    mask_BC = right_pad([e.mask for e in episodes], 0, torch.int64)
    logprobs_BC = right_pad([e.logprobs for e in episodes], 0.0, torch.float32)
    versions_BC = right_pad([e.versions for e in episodes], 0, torch.int64)
    first_version = [e.versions[0] if e.versions else policy_version for e in episodes]
    return RolloutBatch(
        prompt_ids_BP=prompt_ids_BP,
        prompt_mask_BP=prompt_mask_BP,
        completion_ids_BC=ids_BC,
        completion_mask_BC=mask_BC,
        behavior_logprobs_BC=logprobs_BC,
        rewards_B=torch.zeros(B, dtype=torch.float32),
        policy_version_B=torch.tensor(first_version, dtype=torch.int64),
        token_version_BC=versions_BC * mask_BC,
        group_size=group_size,
    )


class BatchTurnSession:
    """A `TurnSession` over a generator's batched `generate`: each `wait` samples every pending turn
    in one call (turns of one episode after another run in lock step, episode by episode in parallel).
    """

    def __init__(
        self, generator, *, eos_token_ids: list[int], greedy: bool, between_steps: Callable[[], None] | None
    ) -> None:
        self.generator = generator
        self.eos = set(eos_token_ids)
        self.greedy = greedy
        self.between_steps = between_steps
        self.pending: list[tuple[int, list[int], int]] = []

    def submit(self, key: int, prompt_ids: list[int], max_new_tokens: int) -> None:
        self.pending.append((key, list(prompt_ids), max_new_tokens))

    def wait(self) -> list[TurnOutput]:
        if not self.pending:
            return []
        pending, self.pending = self.pending, []
        extra = {"between_steps": self.between_steps} if self.between_steps is not None else {}
        batch = self.generator.generate(
            [ids for _, ids, _ in pending],
            samples_per_prompt=1,
            max_new_tokens=max(limit for *_, limit in pending),
            greedy=self.greedy,
            **extra,
        )
        outputs = []
        for b, (key, _, limit) in enumerate(pending):
            n = min(int(batch.completion_mask_BC[b].sum()), limit)  # each turn keeps its own limit
            ids = batch.completion_ids_BC[b, :n].tolist()
            outputs.append(
                TurnOutput(
                    key=key,
                    token_ids=ids,
                    logprobs=batch.behavior_logprobs_BC[b, :n].tolist(),
                    versions=batch.token_version_BC[b, :n].tolist(),
                    ended=bool(ids) and ids[-1] in self.eos,
                )
            )
        return outputs

    def close(self) -> None:
        self.pending = []
