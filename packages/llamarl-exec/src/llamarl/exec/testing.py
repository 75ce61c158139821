"""Helpers for tests: reward functions for `ProcessRewarder` (they live in the package so that spawned
workers can import them by module path; test modules are not importable there) and the token ids of
the tiny test model."""

from __future__ import annotations

import os
import time

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
