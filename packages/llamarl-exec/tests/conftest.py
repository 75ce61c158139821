"""Fixtures of the llamarl-exec tests: a tiny random Llama saved as a transformers folder."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from llamarl.exec.models import tiny_model
from llamarl.exec.testing import (
    TINY_EOS_TOKEN_ID,
    TINY_PAD_TOKEN_ID,
    TINY_VOCAB_SIZE,
    jsonl_file,
    read_jsonl,
    shared_data_dir,
)


@pytest.fixture(scope="session", autouse=True)
def _few_threads():
    # Two cores shared with other test suites: one intra-op thread keeps timings stable.
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A 2-layer Llama (vocab 64, random weights, seed 0) saved without a tokenizer."""
    model = tiny_model(
        TINY_VOCAB_SIZE, eos_token_id=TINY_EOS_TOKEN_ID, pad_token_id=TINY_PAD_TOKEN_ID, seed=0
    )
    path = tmp_path_factory.mktemp("tiny_llama")
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def shared_rows():
    """`shared_rows("gsm8k/test.jsonl", 5)`: the first rows of a file under the shared data folder."""
    return _read_jsonl


def _read_jsonl(relative: str, count: int) -> list[dict]:
    try:
        path = shared_data_dir(__file__) / relative
    except FileNotFoundError as exc:
        pytest.fail(str(exc))
    if not jsonl_file(path).is_file():
        pytest.fail(f"the shared data file {path} is missing")
    return read_jsonl(path, count)
