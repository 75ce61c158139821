"""Fixtures of the controller's tests: a tiny real chat model folder (random weights, SmolLM2's tokenizer);
and their helper modules (next to this file) importable under --import-mode=importlib."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def tiny_chat_model_dir(tmp_path_factory) -> Path:
    from llamarl.exec.testing import save_tiny_chat_model

    return save_tiny_chat_model(tmp_path_factory.mktemp("tiny_chat_model"))
