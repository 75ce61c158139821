"""Fixtures shared by the cross-package tests: a tiny real model folder with SmolLM2's tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest


def _shared_data() -> Path:
    from llamarl.exec.testing import shared_data_dir

    try:
        return shared_data_dir(__file__)
    except FileNotFoundError as exc:
        pytest.fail(str(exc))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A 2-layer Llama with SmolLM2's real tokenizer and chat template, saved as a transformers folder."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from llamarl.exec.models import smollm2_path

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path())
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    path = tmp_path_factory.mktemp("tiny_model")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def gsm8k_dir() -> Path:
    path = _shared_data() / "gsm8k"
    if not (path / "train.jsonl").is_file():
        pytest.fail(f"the shared GSM8K copy is missing at {path}")
    return path


@pytest.fixture(scope="session")
def math_dir() -> Path:
    path = _shared_data() / "math"
    if not (path / "train.jsonl").is_file():
        pytest.fail(f"the shared MATH copy is missing at {path}")
    return path
