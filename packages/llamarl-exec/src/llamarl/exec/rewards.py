"""Answer-checking reward functions: GSM8K (final number) and MATH (math-verify on the last \\boxed{}).

Each is a module-level function `(completion, reference) -> float` in {0.0, 1.0}, picklable by reference
so the spawned workers of `ProcessRewarder` can run it. This module imports nothing heavy at import
time (math-verify pulls in sympy on first use), so a worker starts quickly.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from decimal import Decimal, InvalidOperation

RewardFn = Callable[[str, str], float]

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


REWARD_FNS: dict[str, RewardFn] = {"gsm8k": gsm8k_reward, "math": math_reward}
"""Reward functions by task name (the names of `llamarl.control.tasks.TASKS`)."""


def get_reward_fn(name: str) -> RewardFn:
    """The reward function registered as `name`; ValueError listing the valid names otherwise."""
    try:
        return REWARD_FNS[name]
    except KeyError:
        raise ValueError(f"unknown reward function {name!r}; valid names: {', '.join(REWARD_FNS)}") from None
