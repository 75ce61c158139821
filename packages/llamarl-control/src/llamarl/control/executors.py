"""Builds this rank's executors from the run configuration (the one place that maps RunConfig onto the
executor configs of llamarl.exec)."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist

from llamarl.comm import WeightReceiver, WeightSyncGroup
from llamarl.control.config import RunConfig
from llamarl.control.tasks import TASKS
from llamarl.exec import (
    Generator,
    HFGenerator,
    HFGeneratorConfig,
    PolicyTrainer,
    ProcessRewarder,
    RewarderConfig,
    TrainerConfig,
    VLLMGenerator,
    VLLMGeneratorConfig,
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


def trainer_uses_fsdp(config: RunConfig, device: torch.device) -> bool:
    """FSDP2 with several trainer ranks, and on CUDA always (its mixed precision keeps fp32 master
    weights while computing in bf16); one CPU rank trains the plain module, in fp32."""
    return config.num_trainers > 1 or device.type == "cuda"


def build_trainer(config: RunConfig, device: torch.device, group: dist.ProcessGroup | None) -> PolicyTrainer:
    """The trainer of this rank; `group` (the trainer ranks' group) when `trainer_uses_fsdp`, else None."""
    return PolicyTrainer(
        TrainerConfig(
            model=config.model,
            dtype="float32",  # master weights and optimizer state
            param_dtype="bfloat16" if device.type == "cuda" else None,  # compute dtype (FSDP2)
            device=str(device),
            lr=config.lr,
            lr_schedule=config.lr_schedule,
            warmup_steps=config.warmup_steps,
            total_steps=config.steps,
            weight_decay=config.weight_decay,
            micro_batch_size=config.micro_batch_size,
            pack_tokens=config.pack_tokens,
            max_grad_norm=config.max_grad_norm,
            temperature=config.temperature,
            loss=config.loss,
            loss_hparams=dict(config.loss_hparams),
            advantage=config.advantage,
            kl_coef=config.kl_coef,
            kl_estimator=config.kl_estimator,
            gradient_checkpointing=config.activation_checkpointing,
            seed=config.seed,
        ),
        group=group,
    )


def weight_wire_dtype(device: torch.device) -> torch.dtype | None:
    """The dtype weights travel in: the generators' (bf16 on CUDA, from fp32 master weights), else as held."""
    return torch.bfloat16 if _dtype(device) == "bfloat16" else None


def build_generator(config: RunConfig, device: torch.device, *, seed: int, rank: int) -> Generator:
    if config.generator == "vllm":
        return VLLMGenerator(
            VLLMGeneratorConfig(
                model=config.model,
                dtype=_dtype(device),
                temperature=config.temperature,
                seed=seed,
                max_model_len=config.vllm_max_model_len,
                max_engine_restarts=config.max_engine_restarts,
                # The engine does this rank's work, so it gets this rank's share of the cores (all of
                # them in sync mode, where ranks take turns); the rank itself only waits on it.
                num_threads=torch.get_num_threads(),
                vllm_python=config.vllm_python,
                start_timeout_s=config.timeout_s,
                timeout_s=config.timeout_s,
                log_path=str(Path(config.output_dir) / "logs" / f"vllm_engine.rank{rank}.log"),
            )
        )
    return HFGenerator(
        HFGeneratorConfig(
            model=config.model,
            dtype=_dtype(device),
            device=str(device),
            temperature=config.temperature,
            seed=seed,
        )
    )


class PolicyReceiver(Protocol):
    """A generator rank's end of the weight sync: `receive()` blocks until one sync has landed in the
    generator's weights and returns its policy_version."""

    def receive(self) -> int: ...

    def close(self) -> None: ...


class _EngineReceiver:
    """The vLLM generator's end: its engine joined the group itself and receives straight from the
    trainer (this rank never holds the weights).

    It holds the generator, not the engine, so it survives `VLLMGenerator.restart_engine()`: the new
    engine rejoins the group under the same rank, and the next `receive()` (run while the trainer
    sends) gets the latest weights into it.
    """

    def __init__(self, generator: VLLMGenerator, timeout_s: float) -> None:
        self.generator = generator
        self.timeout_s = timeout_s

    def receive(self) -> int:
        return self.generator.receive_weights(self.timeout_s)

    def close(self) -> None:
        pass  # the engine leaves the group when the generator closes it


class _ModuleReceiver:
    """The HF generator's end: this rank joins the group and writes into its model in place."""

    def __init__(self, group: WeightSyncGroup, receiver: WeightReceiver, announce_timeout_s: float) -> None:
        self.group = group
        self.receiver = receiver
        self.announce_timeout_s = announce_timeout_s

    def receive(self) -> int:
        return self.receiver.receive(self.announce_timeout_s)

    def close(self) -> None:
        self.receiver.close()
        self.group.close()


def open_weight_receiver(
    generator: Generator,
    *,
    host: str,
    port: int,
    rank: int,
    world_size: int,
    timeout_s: float,
    src_rank: int,
    announce_timeout_s: float | None = None,
) -> PolicyReceiver:
    """Joins the trainer's weight-sync group as `rank` on behalf of `generator` (the trainer builds its
    WeightSender at the same time).

    `timeout_s` bounds each step of a sync (forming the group, every bucket): a peer that died makes it
    fail within that long. `announce_timeout_s` (default `timeout_s`) bounds the wait for the trainer to
    start a sync, which in lock step lasts as long as a training step.
    """
    announce_timeout_s = timeout_s if announce_timeout_s is None else announce_timeout_s
    if isinstance(generator, VLLMGenerator):
        generator.connect_weight_sync(
            host=host, port=port, rank=rank, world_size=world_size, timeout_s=timeout_s, src_rank=src_rank
        )
        return _EngineReceiver(generator, announce_timeout_s)
    group = WeightSyncGroup(host=host, port=port, rank=rank, world_size=world_size, timeout_s=timeout_s)
    try:
        return _ModuleReceiver(
            group, WeightReceiver(group, generator.model, src_rank=src_rank), announce_timeout_s
        )
    except BaseException:
        group.close()
        raise


def build_rewarder(config: RunConfig) -> ProcessRewarder:
    # One worker: answer checking is cheap next to generation, and the cores belong to the model.
    rewarder = ProcessRewarder(
        RewarderConfig(
            reward_fn=TASKS[config.task].reward_fn, num_workers=1, timeout_s=config.reward_timeout_s
        )
    )
    rewarder.setup()
    return rewarder
