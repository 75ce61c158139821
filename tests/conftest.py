"""Fixtures shared by the cross-package tests: a tiny real model folder with SmolLM2's tokenizer; and
their helper module on sys.path."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from llamarl.exec.testing import jsonl_file, shared_data_dir

# Tests run with --import-mode=importlib: make `rank_handshake` and `stream_checks` (next to this file)
# importable, here and in the processes the two-process tests spawn (they inherit sys.path).
sys.path.insert(0, str(Path(__file__).parent))


def _shared_data() -> Path:

    try:
        return shared_data_dir(__file__)
    except FileNotFoundError as exc:
        pytest.fail(str(exc))


@pytest.fixture(scope="session")
def save_tiny_model(tmp_path_factory):
    """`save_tiny_model(name, **sizes)`: a small random Llama (seed 0) with SmolLM2's real tokenizer and
    chat template, saved as a transformers folder; `sizes` override `llamarl.exec.models.tiny_model`'s."""

    def save(name: str, **sizes) -> Path:
        from llamarl.exec.testing import save_tiny_chat_model

        return save_tiny_chat_model(tmp_path_factory.mktemp(name), **sizes)

    return save


@pytest.fixture(scope="session")
def tiny_model_dir(save_tiny_model) -> Path:
    """A 2-layer Llama (hidden 32, 4 heads, tied embeddings) with SmolLM2's tokenizer."""
    return save_tiny_model("tiny_model")


@pytest.fixture(scope="session")
def tiny_moe_model_dir(save_tiny_model) -> Path:
    """A 2-layer Qwen3-MoE (4 experts, 2 per token, hidden 32) with SmolLM2's tokenizer."""
    return save_tiny_model("tiny_moe_model", moe="qwen3_moe")


@pytest.fixture(scope="session")
def gsm8k_dir() -> Path:
    path = _shared_data() / "gsm8k"
    if not jsonl_file(path / "train.jsonl").is_file():
        pytest.fail(f"the shared GSM8K copy is missing at {path}")
    return path


@pytest.fixture(scope="session")
def math_dir() -> Path:
    path = _shared_data() / "math"
    if not jsonl_file(path / "train.jsonl").is_file():
        pytest.fail(f"the shared MATH copy is missing at {path}")
    return path
