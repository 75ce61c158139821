"""What fits where: the memory of a device shared by trainer state, generator weights and KV cache.

A trainer shards its state over its devices (FSDP): weights, gradients, fp32 master weights and Adam
moments, plus the activations of its training pass (checkpointed: every layer's input, so they grow
with the model's width and depth, not with the number of devices). A generator replica holds its
weights split over `tp x pp` devices; what is left is KV cache, and that sets how many sequences
decode at once. When
the generator shares the trainer's devices (the synchronous baseline), the trainer's memory stays
resident while it generates (its state, and the activation memory the allocator keeps for the next
training pass), so the KV cache gets only what the trainer leaves.
"""

from __future__ import annotations

from llamarl.sim.generation import GeneratorLayout, weight_bytes_per_gpu
from llamarl.sim.hardware import Efficiency, GpuSpec
from llamarl.sim.models import ModelSpec


def trainer_bytes_per_gpu(model: ModelSpec, gpus: int, eff: Efficiency) -> float:
    """Peak bytes per device of a trainer sharded over `gpus` devices (FSDP, no tensor parallelism):
    its share of the state, the checkpointed layer inputs of one micro-batch and a workspace."""
    state = model.params * eff.trainer_bytes_per_param / gpus
    return state + activation_bytes(model, eff) + eff.trainer_workspace_gb * 1e9


def activation_bytes(model: ModelSpec, eff: Efficiency) -> float:
    """Checkpointed activations of one training micro-batch: every layer's bf16 input."""
    return eff.train_micro_batch_tokens * model.hidden * model.layers * 2


def trainer_fits(model: ModelSpec, gpus: int, gpu: GpuSpec, eff: Efficiency) -> bool:
    """Whether a trainer on `gpus` devices fits in what an engine may plan with."""
    usable = gpu.memory_bytes * eff.memory_usable_frac - eff.runtime_reserve_gb * 1e9
    return trainer_bytes_per_gpu(model, gpus, eff) <= usable


def kv_budget_per_gpu(
    model: ModelSpec, gpu: GpuSpec, eff: Efficiency, layout: GeneratorLayout, resident_bytes: float = 0.0
) -> float:
    """Bytes per device left for the KV cache (negative: the weights do not fit).

    `resident_bytes`: what else stays on each device (the trainer's state when colocated).
    """
    usable = gpu.memory_bytes * eff.memory_usable_frac - eff.runtime_reserve_gb * 1e9
    return usable - resident_bytes - weight_bytes_per_gpu(model, layout)
