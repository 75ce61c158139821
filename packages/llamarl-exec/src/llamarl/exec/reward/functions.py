"""Reward functions: the task-facing form (weighted callables over (prompt, completion, row), plain,
batched or async) and the answer checkers of the built-in tasks.

A task's reward is a weighted sum of reward functions (`Reward`). Each function is a plain Python
callable, module-level so that the spawned workers of `ProcessRewarder` can import it by reference:

    def correct(prompt: list[dict], completion: str, row: dict) -> float      # one sample
    def brief(prompts, completions, rows) -> list[float]                       # batched=True
    async def judged(prompt, completion, row) -> float                        # awaited concurrently

`prompt` is the chat messages the model was shown, `completion` its answer as text (in a multi-turn
episode: its last turn), `row` the dataset row. `score_samples` runs them in a worker: a function that
raises, or returns anything but a finite number (NaN, inf, a string, None), scores 0 for the samples
it failed on (the others still count) and the error is reported, naming the function.

The answer checkers (`gsm8k_reward`, `math_reward`) take `(completion, reference)`; `gsm8k_answer` and
`math_answer` are their task-facing forms, reading the reference from `row["answer"]`, and
`gsm8k_correct` / `math_correct` the same checks as a task's verdict (right or wrong). This module
imports nothing heavy at import time (math-verify pulls in sympy on first use), so a worker starts
quickly.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from typing import Any

Messages = list[dict[str, Any]]
RewardFn = Callable[..., Any]
"""`(prompt, completion, row) -> float`, or with `batched`: `(prompts, completions, rows) -> list[float]`;
either may be `async def`."""

# A number as written in GSM8K answers and model outputs: optional sign, digits with thousands commas,
# an optional decimal part ("1,234.50", "-3", ".5").
_NUMBER = re.compile(r"-?(?:\d[\d,]*(?:\.\d+)?|\.\d+)")


def extract_gsm8k_answer(text: str) -> str | None:
    """The final number of a GSM8K-style solution, normalised, or None.

    The text after the last `####` wins when present (the format the prompt asks for); otherwise the
    last number anywhere in the text. Normalisation drops `$`, thousands commas, a trailing period and
    trailing zeros of a decimal part ("1,000.00" -> "1000").
    """
    marker = text.rfind("####")
    if marker >= 0:
        numbers = _NUMBER.findall(text[marker + 4 :].replace("$", ""))
        if numbers:
            return _normalise_number(numbers[0])
    numbers = _NUMBER.findall(text.replace("$", ""))
    return _normalise_number(numbers[-1]) if numbers else None


def _normalise_number(raw: str) -> str | None:
    cleaned = raw.replace(",", "").rstrip(".")
    try:
        value = Decimal(cleaned)
    except InvalidOperation:
        return None
    # normalize() turns 18.00 into 18 and 1E+3 back to 1000 via the fixed-point format below.
    return format(value.normalize(), "f")


def gsm8k_reward(completion: str, reference: str) -> float:
    """1.0 when the completion's final number equals the reference's, else 0.0.

    Args:
        completion: the model's text.
        reference: GSM8K's `answer` field (a worked solution ending in `#### <number>`) or a bare number.
    """
    expected = extract_gsm8k_answer(reference)
    if expected is None:
        raise ValueError(f"no number in the GSM8K reference {reference[-80:]!r}")
    return 1.0 if extract_gsm8k_answer(completion) == expected else 0.0


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (or `\\fbox{...}`) in `text`, braces balanced, or None."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    brace = text.find("{", start)
    if brace < 0:
        return None
    depth = 0
    for i in range(brace, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[brace + 1 : i].strip() or None
    return None  # unbalanced: the completion was cut off inside the box


def math_reward(completion: str, reference: str) -> float:
    """1.0 when the last `\\boxed{}` of the completion is mathematically equal to the reference, else 0.0.

    Only the last box counts (the prompt asks for the final answer there); a completion without one
    scores 0 even if the right value appears in its text, so the format is learned too.

    Args:
        completion: the model's text.
        reference: the reference answer as LaTeX without delimiters (MATH's `answer` column), e.g.
            `\\dfrac{9}{7}`; a reference that already contains `\\boxed{}` is used as is.
    """
    from math_verify import parse, verify  # sympy is imported on first use, in the worker

    answer = last_boxed(completion)
    if answer is None:
        return 0.0
    gold_text = reference if "\\boxed" in reference else f"\\boxed{{{reference}}}"
    gold = parse(f"${gold_text}$")
    predicted = parse(f"$\\boxed{{{answer}}}$")
    if not gold:
        raise ValueError(f"math-verify cannot parse the reference {reference!r}")
    if not predicted:
        return 0.0
    return 1.0 if verify(gold, predicted) else 0.0


def gsm8k_answer(prompt: Messages, completion: str, row: dict) -> float:
    """The GSM8K checker as a task reward: the final number against `row["answer"]`."""
    return gsm8k_reward(completion, row["answer"])


def math_answer(prompt: Messages, completion: str, row: dict) -> float:
    """The MATH checker as a task reward: the last `\\boxed{}` against `row["answer"]` (math-verify)."""
    return math_reward(completion, row["answer"])


def gsm8k_correct(prompt: Messages, completion: str, row: dict) -> bool:
    """Whether the completion's final number is GSM8K's reference answer (`row["answer"]`)."""
    return gsm8k_answer(prompt, completion, row) == 1.0


def math_correct(prompt: Messages, completion: str, row: dict) -> bool:
    """Whether the completion's last `\\boxed{}` equals the MATH reference answer (`row["answer"]`)."""
    return math_answer(prompt, completion, row) == 1.0


@dataclass(frozen=True)
class Reward:
    """One reward function of a task and its weight in the task's reward (a weighted sum).

    `batched`: `fn` takes lists (prompts, completions, rows) and returns one score per sample.
    `name`: what logs and errors call it (default: the function's name).
    """

    fn: RewardFn
    weight: float = 1.0
    batched: bool = False
    name: str = field(default="")

    def __post_init__(self) -> None:
        if not callable(self.fn):
            raise TypeError(f"a reward function must be callable, got {type(self.fn).__name__}")
        if not self.name:
            object.__setattr__(self, "name", getattr(self.fn, "__name__", type(self.fn).__name__))

    @property
    def is_async(self) -> bool:
        # A callable object's coroutine __call__ counts too.
        call = type(self.fn).__call__ if not inspect.isroutine(self.fn) else None
        return inspect.iscoroutinefunction(self.fn) or inspect.iscoroutinefunction(call)


def as_rewards(items: Sequence[RewardFn | tuple[RewardFn, float] | Reward]) -> tuple[Reward, ...]:
    """Normalises a task's `rewards`: a function (weight 1), a `(function, weight)` pair or a `Reward`."""
    rewards = []
    for item in items:
        if isinstance(item, Reward):
            rewards.append(item)
        elif isinstance(item, tuple) and len(item) == 2:
            rewards.append(Reward(item[0], weight=float(item[1])))
        else:
            rewards.append(Reward(item))
    return tuple(rewards)


def score_samples(
    rewards: Sequence[Reward],
    prompts: list[Messages],
    completions: list[str],
    rows: list[dict],
    on_call: Callable[[int, int], None] | None = None,
) -> tuple[list[float], list[str | None]]:
    """The weighted reward of each sample, and per sample the first error (None when every function ran).

    A function that raises, or returns something that is not a finite number (NaN, inf, a string,
    None, a list), scores 0 on the samples it failed on; the other functions still count. Each error is
    one line naming the function ("reward function 'f' returned nan, not a finite number"). Async
    functions of all samples run concurrently.

    `on_call(k, j)`: told before reward function k runs on sample j (j = -1: on all samples at once,
    batched or async), so that whoever kills a hung call can name the function it hung in.
    """
    num = len(completions)
    totals = [0.0] * num
    errors: list[str | None] = [None] * num
    tell = on_call or (lambda k, j: None)
    for k, reward in enumerate(rewards):
        results = _call(k, reward, prompts, completions, rows, tell)
        for i, value in enumerate(results):
            try:
                score = _finite_score(value)
            except _NotAScore as e:
                errors[i] = errors[i] or f"reward function {reward.name!r} {e}"
                continue
            totals[i] += reward.weight * score
    return totals, errors


class _NotAScore(Exception):
    """What a reward function gave instead of a finite number (the message says what, in one line)."""


def _finite_score(value: Any) -> float:
    """`value` as a float; _NotAScore when it is an exception, not a number, or NaN or infinite."""
    if isinstance(value, _NotAScore):
        raise value
    if isinstance(value, BaseException):
        raise _NotAScore(f"raised {type(value).__name__}: {one_line(str(value))}")
    if value is None or isinstance(value, str | bytes):  # "1.0" parses, but a string is a bug all the same
        raise _NotAScore(f"returned {one_line(repr(value), 60)}, not a number")
    try:
        score = float(value)
    except (TypeError, ValueError):
        raise _NotAScore(f"returned {one_line(repr(value), 60)}, not a number") from None
    if not math.isfinite(score):  # one NaN reward makes every advantage of its group NaN
        raise _NotAScore(f"returned {score}, not a finite number")
    return score


def one_line(text: str, limit: int = 200) -> str:
    """`text` on one line (whitespace runs as one space), cut to `limit` characters."""
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def _call(
    k: int,
    reward: Reward,
    prompts: list[Messages],
    completions: list[str],
    rows: list[dict],
    tell: Callable[[int, int], None],
) -> list[Any]:
    """Reward function k on every sample: a value or the exception it raised, per sample."""
    num = len(completions)
    if reward.batched:
        tell(k, -1)
        try:
            result = _resolve(reward.fn(prompts, completions, rows))
        except Exception as e:  # a bug in a reward function costs its score, not the run
            return [e] * num
        try:
            values = list(result)
        except TypeError:
            return [_NotAScore(f"returned {type(result).__name__}, not a list of {num} scores")] * num
        if len(values) != num:
            return [_NotAScore(f"returned {len(values)} scores for {num} samples")] * num
        return values
    if reward.is_async:
        tell(k, -1)
        return asyncio.run(_gather(reward.fn, prompts, completions, rows))
    results: list[Any] = []
    for j, (p, c, r) in enumerate(zip(prompts, completions, rows, strict=True)):
        tell(k, j)
        try:
            results.append(reward.fn(p, c, r))
        except Exception as e:
            results.append(e)
    return results


def _resolve(value: Any) -> Any:
    return asyncio.run(value) if inspect.isawaitable(value) else value


async def _gather(fn: RewardFn, prompts: list, completions: list[str], rows: list[dict]) -> list[Any]:
    return await asyncio.gather(
        *(fn(p, c, r) for p, c, r in zip(prompts, completions, rows, strict=True)), return_exceptions=True
    )
