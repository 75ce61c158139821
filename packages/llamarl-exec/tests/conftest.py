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
def tiny_rollout(tiny_model_dir):
    """`tiny_rollout(prompts, seed=, temperature=1.0)`: the tiny model's rollout of `prompts`, 2 samples
    each, at most 10 new tokens; token 50 ends a sample too, so completions end at uneven lengths."""
    from llamarl.exec import HFGenerator, SamplingConfig

    def rollout(prompts: list[list[int]], *, seed: int, temperature: float = 1.0):
        gen = HFGenerator(
            str(tiny_model_dir),
            SamplingConfig(temperature=temperature),
            seed=seed,
            eos_token_ids=[TINY_EOS_TOKEN_ID, 50],
        )
        gen.setup()
        batch = gen.generate(prompts, samples_per_prompt=2, max_new_tokens=10)
        gen.close()
        return batch

    return rollout


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
