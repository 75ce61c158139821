"""LoRA adapters (peft) for the trainer and the hf generator.

Adapters are injected into the transformers model itself (`peft.inject_adapter_in_model`), not through a
`PeftModel` wrapper, so the model keeps its forward, its output head and its parameter names: a targeted
`...q_proj.weight` becomes `...q_proj.base_layer.weight` (frozen) beside `...q_proj.lora_A.default.weight`
and `...q_proj.lora_B.default.weight` (trained). lora_B starts at zero, so a fresh model computes what the
base model does.

Weight sync sends only the adapter tensors (`adapter_tensors`): the generator holds the same base weights
(it loaded the same checkpoint) and the same adapters (`add_lora` with the same settings), so the
adapters are all that changes; for SmolLM2-135M at rank 16 on every linear layer that is 4.9 M numbers
instead of 135 M. `merged_state_dict` folds the adapters into the base weights, under the model's own
names, for the final model and for checkpoints read without peft.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from llamarl.exec.config import LoraConfig

ADAPTER_NAME = "default"
_LORA_A, _LORA_B, _BASE = f".lora_A.{ADAPTER_NAME}.weight", f".lora_B.{ADAPTER_NAME}.weight", ".base_layer."


def add_lora(
    model: torch.nn.Module, lora: LoraConfig, *, dtype: torch.dtype | None = None
) -> torch.nn.Module:
    """Injects LoRA adapters into `model` in place and freezes everything else; returns `model`.

    `dtype`: the adapters' dtype (default: the base layers' own: peft would otherwise keep bf16 models'
    adapters in float32, making the generator compute them apart from the rest).
    """
    if lora.rank <= 0:
        raise ValueError("add_lora needs lora.rank > 0")
    from peft import LoraConfig as PeftLoraConfig
    from peft import inject_adapter_in_model

    targets = lora.targets[0] if lora.targets == ["all-linear"] else list(lora.targets)
    config = PeftLoraConfig(
        r=lora.rank,
        lora_alpha=lora.scale_alpha,
        lora_dropout=0.0,
        target_modules=targets,
        bias="none",
    )
    # all-linear leaves the output head alone only when peft knows which module it is.
    inject_adapter_in_model(config, model, adapter_name=ADAPTER_NAME, low_cpu_mem_usage=False)
    for name, param in model.named_parameters():
        is_adapter = name.endswith(_LORA_A) or name.endswith(_LORA_B)
        param.requires_grad_(is_adapter)
        if is_adapter and dtype is not None:
            param.data = param.data.to(dtype)
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError(f"trainer.lora.targets {lora.targets} matched no layer of {type(model).__name__}")
    return model


def adapter_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapters' parameters by name (what a weight sync sends and receives with LoRA)."""
    return {
        name: param
        for name, param in model.named_parameters()
        if name.endswith(_LORA_A) or name.endswith(_LORA_B)
    }


def merged_state_dict(state_dict: Mapping[str, torch.Tensor], lora: LoraConfig) -> dict[str, torch.Tensor]:
    """A LoRA model's state dict with the adapters folded in: W = W0 + (alpha / rank) B A under the
    base model's names (`...q_proj.weight`), in W0's dtype; the adapters' own entries dropped."""
    scale = lora.scale_alpha / lora.rank
    merged: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        if name.endswith(_LORA_A) or name.endswith(_LORA_B):
            continue
        if _BASE not in name:
            merged[name] = tensor
            continue
        module, _, leaf = name.partition(_BASE)
        plain = f"{module}.{leaf}"
        if leaf == "weight" and f"{module}{_LORA_A}" in state_dict:
            a_RI = state_dict[f"{module}{_LORA_A}"].float()
            b_OR = state_dict[f"{module}{_LORA_B}"].float()
            tensor = (tensor.float() + scale * (b_OR @ a_RI)).to(tensor.dtype)
        merged[plain] = tensor
    return merged
