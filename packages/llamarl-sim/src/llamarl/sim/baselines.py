"""The strongest synchronous baseline: what a cluster gives without splitting it, done well.

Generation and training take turns on every device (colocated, on-policy), but the generator is a
modern engine: continuous batching, CUDA graphs, fp8 weights, its best layout; the trainer's sharded
state (weights, gradients, optimizer) moves to host memory while it generates, so the KV cache gets
the device, and comes back for training (`deployment.offload_s` prices the round trip). This is the
baseline an asynchronous system has to beat to be worth its off-policyness; `paper` and `plan`
report the speed-up against it beside the paper's own (DeepSpeed-Chat-like) baseline.
"""

from __future__ import annotations

from llamarl.sim.deployment import PP_CHOICES, Deployment, PhaseTimes, best_generator_layout, price
from llamarl.sim.generation import GeneratorLayout
from llamarl.sim.hardware import Efficiency, GpuSpec
from llamarl.sim.memory import trainer_fits
from llamarl.sim.models import ModelSpec
from llamarl.sim.workload import Workload

GENERATOR_TPS = (1, 2, 4, 8)  # inside one node


def strongest_sync(
    model: ModelSpec,
    gpus: int,
    workload: Workload,
    gpu: GpuSpec,
    eff: Efficiency,
    *,
    generator_dtype: str = "fp8",
) -> tuple[Deployment, PhaseTimes] | None:
    """The colocated, offloaded, modern-engine synchronous system on `gpus` devices, in the generator
    layout that generates fastest (None when the trainer does not fit on the devices)."""
    if not trainer_fits(model, gpus, gpu, eff):
        return None
    template = Deployment(
        model,
        gpus,
        gpus,
        GeneratorLayout(weight_dtype=generator_dtype),
        colocated=True,
        trainer_state_resident=False,
        weight_sync="colocated_reshard",
    )
    # With the trainer's state off the devices, pipeline stages only help weights that do not fit.
    d, seconds = best_generator_layout(template, workload, gpu, eff, tps=GENERATOR_TPS, pps=(1,))
    if seconds == float("inf"):
        d, _ = best_generator_layout(template, workload, gpu, eff, tps=GENERATOR_TPS, pps=PP_CHOICES)
    return d, price(d, workload, gpu, eff)


def describe(d: Deployment) -> str:
    """One line: where the strongest baseline runs and how."""
    return (
        f"generation and training take turns on all {d.trainer_gpus} devices; {d.replicas} replicas of "
        f"{d.generator.describe()}; trainer state offloaded to host memory while generating"
    )
