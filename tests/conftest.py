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
        from transformers import AutoTokenizer

        from llamarl.exec.models import smollm2_path, tiny_model

        tokenizer = AutoTokenizer.from_pretrained(smollm2_path())
        model = tiny_model(
            len(tokenizer),
            max_position_embeddings=1024,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            tie_word_embeddings=True,
            seed=0,
            **sizes,
        )
        path = tmp_path_factory.mktemp(name)
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        return path

    return save


@pytest.fixture(scope="session")
def tiny_model_dir(save_tiny_model) -> Path:
    """A 2-layer Llama (hidden 32, 4 heads, tied embeddings) with SmolLM2's tokenizer."""
    return save_tiny_model("tiny_model")


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
