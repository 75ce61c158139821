"""Fixtures of the controller's tests: a tiny real chat model folder (random weights, SmolLM2's tokenizer)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_chat_model_dir(tmp_path_factory) -> Path:
    from llamarl.exec.testing import save_tiny_chat_model

    return save_tiny_chat_model(tmp_path_factory.mktemp("tiny_chat_model"))
