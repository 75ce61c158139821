"""Helpers for tests: reward functions for `ProcessRewarder` (they live in the package so that spawned
workers can import them by module path; test modules are not importable there) and the token ids of
the tiny test model."""

from __future__ import annotations

import os
import time
from pathlib import Path

TINY_VOCAB_SIZE = 64
TINY_EOS_TOKEN_ID = 2
TINY_PAD_TOKEN_ID = 0


def slow_reward(completion: str, reference: str) -> float:
    """Sleeps `float(completion)` seconds when the completion starts with "sleep ", then scores 1.0."""
    if completion.startswith("sleep "):
        time.sleep(float(completion.split()[1]))
    return 1.0


def failing_reward(completion: str, reference: str) -> float:
    """Raises on "raise", kills its own process on "die", otherwise scores 1.0."""
    if completion == "raise":
        raise RuntimeError("verifier bug")
    if completion == "die":
        os._exit(3)
    return 1.0


def shared_data_dir(start: str | os.PathLike[str]) -> Path:
    """The local copies of GSM8K / MATH / MATH-500 the tests read: ``$LLAMARL_DATA_DIR`` if set, else the
    first ``shared/data`` folder beside ``start`` or one of its parents (the workspace keeps it beside
    the checkout). Raises FileNotFoundError, saying how to point at it, when there is none."""
    override = os.environ.get("LLAMARL_DATA_DIR")
    if override:
        return Path(override)
    for folder in Path(start).resolve().parents:
        candidate = folder / "shared" / "data"
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(
        f"no shared/data folder beside {start} or its parents; set LLAMARL_DATA_DIR to the folder holding "
        "gsm8k/ and math/ (train.jsonl, test.jsonl)"
    )


REQUIRE_VLLM_ENV = "LLAMARL_REQUIRE_VLLM"
"""Set to 1 (as .ci/run does) to make tests that need the vLLM environment fail, not skip, without it."""


def vllm_python_for_tests() -> str:
    """The vLLM environment's interpreter for a test that runs the real engine.

    Without one the test is skipped on a developer's machine, but fails when $LLAMARL_REQUIRE_VLLM is 1
    (CI builds the environment first, so there a missing one is a bug, never a green skip).
    """
    import pytest

    from llamarl.exec.vllm_env import VLLMEnvironmentError, find_vllm_python

    try:
        return find_vllm_python()
    except VLLMEnvironmentError as e:
        if os.environ.get(REQUIRE_VLLM_ENV) == "1":
            pytest.fail(f"{e} ({REQUIRE_VLLM_ENV}=1)", pytrace=False)
        pytest.skip(str(e))
