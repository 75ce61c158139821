"""The trainer's modules, built once by `PolicyTrainer.setup`: the float32 master policy (sharded with
FSDP2 over a trainer group when there is one), the module forward and backward run on (the master
itself, or its bf16 compute copy on one rank without FSDP2), and the frozen reference policy of a KL
penalty.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from llamarl.exec.config import TrainerConfig
from llamarl.exec.lora import add_lora
from llamarl.exec.models import load_model_and_tokenizer
from llamarl.exec.train import varlen_attention
from llamarl.exec.train.compiled_modules import compile_modules, wants_compile
from llamarl.exec.train.mixed_precision import ComputeCopy
from llamarl.exec.train.parallel import shard_model


@dataclass(frozen=True)
class PolicyModules:
    """What `load_policy_modules` builds."""

    model: torch.nn.Module  # the float32 master weights the optimizer updates
    compute_model: torch.nn.Module  # `model`, or its compute copy
    compute_copy: ComputeCopy | None  # the bf16 compute copy (mixed precision without FSDP2)
    ref_model: torch.nn.Module | None  # the frozen reference, when asked for


@dataclass(frozen=True)
class ModuleSettings:
    """Where and how the trainer's modules are built and run."""

    model_name: str  # hub id or local transformers folder of the initial policy
    config: TrainerConfig
    device: str
    compute_dtype: torch.dtype  # of forward and backward; float32 master weights either way
    group: dist.ProcessGroup | None  # the trainer ranks' group (FSDP2 over it), or None: one rank

    @property
    def sharded(self) -> bool:
        """Whether the modules are under FSDP2 (a trainer group was given)."""
        return self.group is not None

    @property
    def mixed_precision(self) -> bool:
        """Whether forward and backward run in a lower precision than the float32 master weights."""
        return self.compute_dtype != torch.float32


def load_policy_modules(settings: ModuleSettings, *, with_reference: bool) -> PolicyModules:
    """Loads the policy (LoRA adapters injected when the config asks), prepares it for training (no KV
    cache, activation checkpointing, varlen attention for packed rows, torch.compile where wanted) and
    wraps it; `with_reference` adds the frozen reference."""
    cfg = settings.config
    # float32 parameters: the master weights (and so the optimizer state); FSDP2 or a compute copy
    # casts them for compute.
    model, _ = load_model_and_tokenizer(
        settings.model_name, dtype=torch.float32, device=settings.device, with_tokenizer=False
    )
    if cfg.lora.rank:
        add_lora(model, cfg.lora)
    if cfg.activation_checkpointing and not settings.sharded:  # (under FSDP2: see shard_model)
        _enable_activation_checkpointing(model)
    model.config.use_cache = False  # no KV cache in training forward passes
    _use_varlen_attention(model, cfg)
    model.train()
    model = _wrap_model(model, settings)
    compute_model, compute_copy = model, None
    if settings.mixed_precision and not settings.sharded:
        compute_copy = ComputeCopy(model, settings.compute_dtype)
        compute_model = compute_copy.module
    if wants_compile(cfg.compile, compute_model, settings.device, sharded=settings.sharded):
        compile_modules(compute_model, required=cfg.compile == "on")
    ref_model = _load_reference(settings) if with_reference else None
    return PolicyModules(model, compute_model, compute_copy, ref_model)


def _load_reference(settings: ModuleSettings) -> torch.nn.Module:
    """The frozen reference policy of the KL penalty: the initial weights, never trained."""
    # Without FSDP2 it is loaded in the compute dtype straight away.
    ref, _ = load_model_and_tokenizer(
        settings.model_name,
        dtype=torch.float32 if settings.sharded else settings.compute_dtype,
        device=settings.device,
        with_tokenizer=False,
    )
    ref.requires_grad_(False)
    ref.config.use_cache = False
    _use_varlen_attention(ref, settings.config)
    ref.eval()
    # Sharded like the policy; it never trains and is never synced, so its root reshards after every
    # forward instead of holding its weights gathered for a backward pass.
    return _wrap_model(ref, settings, frozen=True)


def _use_varlen_attention(model: torch.nn.Module, config: TrainerConfig) -> None:
    """Packed rows: attention per packed sequence (`llamarl.exec.train.varlen_attention`), never a dense
    block-diagonal [T, T] mask, which on the CPU is quadratic in the packed length and sends SDPA to
    its slow masked path. Set before FSDP2 wraps the model (the setting lives in its config)."""
    if config.pack_tokens:
        varlen_attention.register()
        model.set_attn_implementation(varlen_attention.VARLEN_ATTENTION)


def _wrap_model(model: torch.nn.Module, settings: ModuleSettings, *, frozen: bool = False) -> torch.nn.Module:
    """FSDP2 over the trainer group when there is one (any size, so mixed precision works on one rank
    too); the plain module otherwise. `frozen`: a model that is never trained (the reference)."""
    if settings.group is None:
        return model
    return shard_model(
        model,
        settings.group,
        device=torch.device(settings.device),
        param_dtype=settings.compute_dtype if settings.mixed_precision else None,
        # A frozen model runs no backward: its root need not stay gathered, nothing to recompute.
        reshard_root_after_forward=frozen,
        activation_checkpointing=settings.config.activation_checkpointing and not frozen,
        expert_parallel=settings.config.expert_parallel,
    )


def _enable_activation_checkpointing(model: torch.nn.Module) -> None:
    """Non-reentrant activation checkpointing of every decoder layer, by transformers' own method: named
    `activation_checkpointing_enable` since transformers 5 (the old name warns there and goes in 6)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
