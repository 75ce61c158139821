"""llamarl.exec: the executors (generator, trainer, rewarder) behind the Protocols of `llamarl.exec.types`.

Public names are imported lazily (PEP 562): a reward worker process imports `llamarl.exec.rewards`
and must not pay for torch and transformers on every (re)start.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    "RolloutBatch": "types",
    "Generator": "types",
    "Rewarder": "types",
    "ModelRewarder": "types",
    "Trainer": "types",
    "HFGenerator": "hf_generator",
    "VLLMGenerator": "vllm_generator",
    "EngineError": "vllm_client",
    "EngineLost": "vllm_client",
    "WeightsNotSyncedError": "vllm_generator",
    "PolicyTrainer": "trainer",
    "ProcessRewarder": "reward_pool",
    "RewardModelScorer": "reward_model",
    "LLMJudge": "reward_model",
    "RewardModelError": "reward_model",
    "build_model_rewarder": "reward_model",
    "RewardModelConfig": "config",
    "AlgorithmConfig": "config",
    "GeneratorConfig": "config",
    "RewardConfig": "config",
    "SamplingConfig": "config",
    "TrainerConfig": "config",
    "Reward": "rewards",
    "gsm8k_answer": "rewards",
    "math_answer": "rewards",
    "gsm8k_reward": "rewards",
    "math_reward": "rewards",
    "extract_gsm8k_answer": "rewards",
    "last_boxed": "rewards",
    "load_model_and_tokenizer": "models",
    "smollm2_path": "models",
    "tiny_model": "models",
    "tiny_reward_model": "models",
}

__all__ = [
    "AlgorithmConfig",
    "EngineError",
    "EngineLost",
    "Generator",
    "GeneratorConfig",
    "HFGenerator",
    "LLMJudge",
    "ModelRewarder",
    "PolicyTrainer",
    "ProcessRewarder",
    "Reward",
    "RewardConfig",
    "RewardModelConfig",
    "RewardModelError",
    "RewardModelScorer",
    "Rewarder",
    "RolloutBatch",
    "SamplingConfig",
    "Trainer",
    "TrainerConfig",
    "VLLMGenerator",
    "WeightsNotSyncedError",
    "build_model_rewarder",
    "extract_gsm8k_answer",
    "gsm8k_answer",
    "gsm8k_reward",
    "last_boxed",
    "load_model_and_tokenizer",
    "math_answer",
    "math_reward",
    "smollm2_path",
    "tiny_model",
    "tiny_reward_model",
]

if TYPE_CHECKING:
    from llamarl.exec.config import (
        AlgorithmConfig,
        GeneratorConfig,
        RewardConfig,
        RewardModelConfig,
        SamplingConfig,
        TrainerConfig,
    )
    from llamarl.exec.hf_generator import HFGenerator
    from llamarl.exec.models import load_model_and_tokenizer, smollm2_path, tiny_model, tiny_reward_model
    from llamarl.exec.reward_model import LLMJudge, RewardModelError, RewardModelScorer, build_model_rewarder
    from llamarl.exec.reward_pool import ProcessRewarder
    from llamarl.exec.rewards import (
        Reward,
        extract_gsm8k_answer,
        gsm8k_answer,
        gsm8k_reward,
        last_boxed,
        math_answer,
        math_reward,
    )
    from llamarl.exec.trainer import PolicyTrainer
    from llamarl.exec.types import Generator, ModelRewarder, Rewarder, RolloutBatch, Trainer
    from llamarl.exec.vllm_client import EngineError, EngineLost
    from llamarl.exec.vllm_generator import VLLMGenerator, WeightsNotSyncedError


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f"llamarl.exec.{_EXPORTS[name]}"), name)
        globals()[name] = value  # cache: later lookups skip __getattr__
        return value
    raise AttributeError(f"module 'llamarl.exec' has no attribute {name!r}")
