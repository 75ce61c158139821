"""Helpers for tests: reward functions for `ProcessRewarder` (they live in the package so that spawned
workers can import them by module path; test modules are not importable there) and the token ids of
the tiny test model."""

from __future__ import annotations

import gzip
import json
import os
import time
from pathlib import Path

TINY_VOCAB_SIZE = 64
TINY_EOS_TOKEN_ID = 2
TINY_PAD_TOKEN_ID = 0


def slow_reward(prompt: list, completion: str, row: dict) -> float:
    """Sleeps `float(completion)` seconds when the completion starts with "sleep ", then scores 1.0."""
    if completion.startswith("sleep "):
        time.sleep(float(completion.split()[1]))
    return 1.0


def failing_reward(prompt: list, completion: str, row: dict) -> float:
    """Raises on "raise", kills its own process on "die", returns text on "text", otherwise scores 1.0."""
    if completion == "raise":
        raise RuntimeError("verifier bug")
    if completion == "die":
        os._exit(3)
    if completion == "text":
        return "yes"  # type: ignore[return-value]
    return 1.0


def odd_reward(prompt: list, completion: str, row: dict) -> object:
    """Returns what the completion names instead of a score: NaN on "nan", infinity on "inf", None on
    "none", a list on "list"; otherwise 1.0."""
    odd = {"nan": float("nan"), "inf": float("inf"), "none": None, "list": [1.0]}
    return odd.get(completion, 1.0)


def busy_reward(prompt: list, completion: str, row: dict) -> float:
    """Computes for `float(completion)` seconds of CPU time, then scores 1.0."""
    end = time.thread_time() + float(completion)
    while time.thread_time() < end:
        pass
    return 1.0


def length_reward(prompts: list, completions: list[str], rows: list[dict]) -> list[float]:
    """Batched: 1 / (1 + characters) of each completion."""
    return [1.0 / (1 + len(c)) for c in completions]


async def async_match_reward(prompt: list, completion: str, row: dict) -> float:
    """Async: 1.0 when the completion equals `row["answer"]` (after yielding to the event loop)."""
    import asyncio

    await asyncio.sleep(0.01)
    return float(completion == row["answer"])


def shared_data_dir(start: str | os.PathLike[str]) -> Path:
    """The local copies of GSM8K and MATH the tests read: ``$LLAMARL_DATA_DIR`` if set, else the first
    ``shared/data`` folder beside ``start`` or one of its parents (the workspace keeps it beside the
    checkout), else the checkout's own ``apps/data`` (the gzip copies the apps ship, the same rows), so a
    checkout anywhere runs its tests. Raises FileNotFoundError, saying how to point at one, when there is
    none of them."""
    override = os.environ.get("LLAMARL_DATA_DIR")
    if override:
        return Path(override)
    parents = Path(start).resolve().parents
    candidates = [p / "shared" / "data" for p in parents] + [p / "apps" / "data" for p in parents]
    for candidate in candidates:
        if (candidate / "gsm8k").is_dir():
            return candidate
    raise FileNotFoundError(
        f"no shared/data or apps/data folder beside {start} or its parents; set LLAMARL_DATA_DIR to the "
        "folder holding gsm8k/ and math/ (train.jsonl, test.jsonl)"
    )


def jsonl_file(path: str | os.PathLike[str]) -> Path:
    """`path` (a .jsonl file), or its gzip-compressed `path.gz` when only that exists (as in apps/data)."""
    plain = Path(path)
    packed = plain.with_name(plain.name + ".gz")
    return packed if packed.is_file() and not plain.is_file() else plain


def read_jsonl(path: str | os.PathLike[str], count: int | None = None) -> list[dict]:
    """The first `count` rows (all when None) of a .jsonl file, or of its .gz copy (see `jsonl_file`)."""
    path = jsonl_file(path)
    rows: list[dict] = []
    with (gzip.open if path.suffix == ".gz" else open)(path, "rt", encoding="utf-8") as f:
        for line in f:
            if count is not None and len(rows) == count:
                break
            rows.append(json.loads(line))
    return rows


def vllm_python_for_tests() -> str:
    """The vLLM environment's interpreter for a test that runs the real engine (marked `vllm`).

    The workspace's conftest.py builds the environment before such a test runs; a missing one here
    fails the test with the command that builds it, never skips it (a green run without the real-engine
    tests would prove nothing about them).
    """
    import pytest

    from llamarl.exec.generate.vllm.env import VLLMEnvironmentError, find_vllm_python

    try:
        return find_vllm_python()
    except VLLMEnvironmentError as e:
        pytest.fail(f"{e}; from a llamarl checkout: bash tools/setup_vllm_env.sh", pytrace=False)


def save_tiny_chat_model(path: str | os.PathLike[str], *, moe: str | None = None, **sizes) -> Path:
    """A small random Llama (seed 0) with SmolLM2's real tokenizer and chat template, saved as a
    transformers folder at `path`; `sizes` override `llamarl.exec.models.tiny_model`'s. `moe`: a
    mixture of experts of that transformers model type instead (`tiny_moe_model`)."""
    from functools import partial

    from transformers import AutoTokenizer

    from llamarl.exec.models import smollm2_path, tiny_model, tiny_moe_model

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path())
    build = tiny_model if moe is None else partial(tiny_moe_model, moe)
    model = build(
        len(tokenizer),
        max_position_embeddings=1024,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
        seed=0,
        **sizes,
    )
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return Path(path)


def build_trainer(model: str, *, temperature: float = 1.0, total_steps: int = 1, **settings):
    """A `PolicyTrainer` for tests, its `TrainerConfig` and `AlgorithmConfig` fields given flat beside
    the trainer's runtime arguments (device, compute_dtype, seed, group), e.g.
    `build_trainer(path, lr=1e-2, pack_tokens=0, kl_coef=0.5, seed=0)`. Not set up."""
    from llamarl.exec.config import AlgorithmConfig, TrainerConfig
    from llamarl.exec.train.trainer import PolicyTrainer

    sections = {TrainerConfig: {}, AlgorithmConfig: {}}
    runtime = {}
    for name, value in settings.items():
        owner = next((s for s in sections if name in s.model_fields), None)
        if owner is None:
            runtime[name] = value
        else:
            sections[owner][name] = value
    return PolicyTrainer(
        model,
        TrainerConfig(**sections[TrainerConfig]),
        AlgorithmConfig(**sections[AlgorithmConfig]),
        temperature=temperature,
        total_steps=total_steps,
        **runtime,
    )


class FeedbackEnvironment:
    """A multi-turn test environment: answers every model turn with a user message ("Try again.") and
    finishes after `row["turns"]` turns (default 3) with reward `row["reward"]` (default 1.0); raises on
    step when `row["broken"]`."""

    def start(self, row: dict) -> None:
        self.row = row
        self.turns = 0

    def step(self, turn):
        from llamarl.exec.multiturn.environments import Finish, Reply

        if self.row.get("broken"):
            raise RuntimeError("environment bug")
        self.turns += 1
        if self.turns >= self.row.get("turns", 3):
            return Finish(reward=self.row.get("reward", 1.0))
        return Reply([{"role": "user", "content": f"Try again ({self.turns})."}])


def lookup_capital(country: str) -> str:
    """Looks up the capital of a country.

    Args:
        country: the country's name in English
    """
    if country == "loop":
        while True:
            pass
    if country == "flood":
        return "x" * 10_000_000
    if country == "Atlantis":
        raise KeyError(f"no capital known for {country}")
    if country == "verbose":
        raise ValueError("why " * 5000)
    return {"France": "Paris", "Japan": "Tokyo"}.get(country, "unknown")
