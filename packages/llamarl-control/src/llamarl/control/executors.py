"""Builds this rank's executors from the run configuration (the one place that maps RunConfig onto the
executor configs of llamarl.exec)."""

from __future__ import annotations

import torch

from llamarl.control.config import RunConfig
from llamarl.control.tasks import TASKS
from llamarl.exec import (
    HFGenerator,
    HFGeneratorConfig,
    PolicyTrainer,
    ProcessRewarder,
    RewarderConfig,
    TrainerConfig,
)


def _dtype(device: torch.device) -> str:
    # bf16 where the hardware runs it fast; fp32 on the CPU, where bf16 matmuls are slow on most parts.
    return "bfloat16" if device.type == "cuda" else "float32"


def load_tokenizer(model: str):
    """The model's tokenizer with left padding (prompts are left-padded for batched generation)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.padding_side = "left"
    return tokenizer


def build_trainer(config: RunConfig, device: torch.device) -> PolicyTrainer:
    return PolicyTrainer(
        TrainerConfig(
            model=config.model,
            dtype=_dtype(device),
            device=str(device),
            lr=config.lr,
            weight_decay=config.weight_decay,
            micro_batch_size=config.micro_batch_size,
            max_grad_norm=config.max_grad_norm,
            temperature=config.temperature,
            loss=config.loss,
            loss_hparams=dict(config.loss_hparams),
            advantage=config.advantage,
            seed=config.seed,
        )
    )


def build_generator(config: RunConfig, device: torch.device, *, seed: int) -> HFGenerator:
    return HFGenerator(
        HFGeneratorConfig(
            model=config.model,
            dtype=_dtype(device),
            device=str(device),
            temperature=config.temperature,
            seed=seed,
        )
    )


def build_rewarder(config: RunConfig) -> ProcessRewarder:
    # One worker: answer checking is cheap next to generation, and the cores belong to the model.
    rewarder = ProcessRewarder(
        RewarderConfig(
            reward_fn=TASKS[config.task].reward_fn, num_workers=1, timeout_s=config.reward_timeout_s
        )
    )
    rewarder.setup()
    return rewarder
