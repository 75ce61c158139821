"""What fits where: the memory of a device shared by trainer state, generator weights and KV cache.

A trainer shards its state over its devices (FSDP): weights, gradients, fp32 master weights and Adam
moments, plus the activations of its training pass. A generator replica holds its weights split over
`tp x pp` devices; what is left is KV cache, and that sets how many sequences decode at once. When
the generator shares the trainer's devices (the synchronous baseline), the trainer's state stays
resident while it generates, so the KV cache gets only what the trainer leaves.
"""

from __future__ import annotations

from llamarl.control.simulator.generation import GeneratorLayout, weight_bytes_per_gpu
from llamarl.control.simulator.hardware import Efficiency, GpuSpec
from llamarl.control.simulator.models import ModelSpec


def trainer_bytes_per_gpu(model: ModelSpec, gpus: int, eff: Efficiency) -> float:
    """Resident bytes per device of a trainer sharded over `gpus` devices."""
    return model.params * eff.trainer_bytes_per_param / gpus + eff.trainer_activation_gb * 1e9


def kv_budget_per_gpu(
    model: ModelSpec, gpu: GpuSpec, eff: Efficiency, layout: GeneratorLayout, resident_bytes: float = 0.0
) -> float:
    """Bytes per device left for the KV cache (negative: the weights do not fit).

    `resident_bytes`: what else stays on each device (the trainer's state when colocated).
    """
    usable = gpu.memory_bytes * eff.memory_usable_frac - eff.runtime_reserve_gb * 1e9
    return usable - resident_bytes - weight_bytes_per_gpu(model, layout)
