"""llamarl.exec: the executors (generator, trainer, rewarder) behind the Protocols of `llamarl.exec.types`.

    types.py config.py   the data that moves between executors and the Protocols; the executors' settings
    generate/            sampling: the hf generator (in the rank) and the vLLM engine (vllm/)
    multiturn/           episodes over several turns: environments, tools, the sandbox that runs them
    train/               the policy trainer: log-probs, packing, FSDP2, mixed precision, schedules
    reward/              reward functions, the worker processes that run them, reward models
    models.py lora.py padding.py   shared by more than one of them

Public names are imported lazily (PEP 562): a reward worker process imports `llamarl.exec.reward.functions`
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
    "HFGenerator": "generate.hf",
    "VLLMGenerator": "generate.vllm.generator",
    "EngineError": "generate.vllm.client",
    "EngineLost": "generate.vllm.client",
    "WeightsNotSyncedError": "types",
    "PolicyTrainer": "train.trainer",
    "ProcessRewarder": "reward.pool",
    "RewardModelScorer": "reward.model",
    "LLMJudge": "reward.model",
    "RewardModelError": "reward.model",
    "build_model_rewarder": "reward.model",
    "RewardModelConfig": "config",
    "AlgorithmConfig": "config",
    "GeneratorConfig": "config",
    "RewardConfig": "config",
    "SamplingConfig": "config",
    "TrainerConfig": "config",
    "Reward": "reward.functions",
    "gsm8k_answer": "reward.functions",
    "math_answer": "reward.functions",
    "gsm8k_reward": "reward.functions",
    "math_reward": "reward.functions",
    "extract_gsm8k_answer": "reward.functions",
    "last_boxed": "reward.functions",
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
    from llamarl.exec.generate.hf import HFGenerator
    from llamarl.exec.generate.vllm.client import EngineError, EngineLost
    from llamarl.exec.generate.vllm.generator import VLLMGenerator
    from llamarl.exec.models import load_model_and_tokenizer, smollm2_path, tiny_model, tiny_reward_model
    from llamarl.exec.reward.functions import (
        Reward,
        extract_gsm8k_answer,
        gsm8k_answer,
        gsm8k_reward,
        last_boxed,
        math_answer,
        math_reward,
    )
    from llamarl.exec.reward.model import LLMJudge, RewardModelError, RewardModelScorer, build_model_rewarder
    from llamarl.exec.reward.pool import ProcessRewarder
    from llamarl.exec.train.trainer import PolicyTrainer
    from llamarl.exec.types import (
        Generator,
        ModelRewarder,
        Rewarder,
        RolloutBatch,
        Trainer,
        WeightsNotSyncedError,
    )


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f"llamarl.exec.{_EXPORTS[name]}"), name)
        globals()[name] = value  # cache: later lookups skip __getattr__
        return value
    raise AttributeError(f"module 'llamarl.exec' has no attribute {name!r}")
