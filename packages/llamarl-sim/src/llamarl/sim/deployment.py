"""Executors placed on a cluster of identical devices, and the phase times that placement gives.

A `Deployment` says where the generator and the trainer live (their own devices, or the generator on
the trainer's devices: the synchronous baseline), how a generator replica is laid out and run, and
how weights travel. `price` turns it and a `Workload` into the seconds of each phase of one step
(with the trainer's state moved to host memory and back around generation when it does not stay
resident beside a colocated generator, and a MoE model's routing-replay ids carried with the rollouts);
`best_generator_layout` and `best_split` pick the layout and the generator/trainer split that give the
shortest step (what `plan` searches, and LlamaRL's side of `paper`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from llamarl.sim import moe
from llamarl.sim.generation import (
    GeneratorLayout,
    ReplicaCost,
    kv_footprint_tokens,
    replica_generate_s,
    shares,
    streaming_generate_s,
)
from llamarl.sim.hardware import DTYPE_BYTES, Efficiency, GpuSpec
from llamarl.sim.memory import kv_budget_per_gpu, trainer_bytes_per_gpu, trainer_fits
from llamarl.sim.models import ModelSpec
from llamarl.sim.training import train_s
from llamarl.sim.weight_sync import SyncLayout, weight_sync_s
from llamarl.sim.workload import Workload

TP_CHOICES = (1, 2, 4, 8, 16, 32)
PP_CHOICES = (1, 2, 4, 8, 16)


@dataclass(frozen=True)
class Deployment:
    """Where the executors run: `trainer_gpus` for the trainer and `generator_gpus` for the generator
    replicas, or, when `colocated`, the generator on the trainer's devices (then generator_gpus is
    trainer_gpus)."""

    model: ModelSpec
    trainer_gpus: int
    generator_gpus: int
    generator: GeneratorLayout
    colocated: bool = False
    trainer_state_resident: bool = True  # colocated: the trainer's state stays while it generates
    weight_sync: SyncLayout = "shard_to_shard"
    wire_dtype: str = "bf16"
    sync_bytes_per_param: float | None = None  # on the wire; None: the whole model in wire_dtype
    partial_rollout: bool = False  # unfinished sequences carry over: no step waits for its tail
    recompute_logprobs: bool = False  # the trainer recomputes old log-probs (one more forward pass)

    @property
    def total_gpus(self) -> int:
        return self.trainer_gpus if self.colocated else self.trainer_gpus + self.generator_gpus

    @property
    def replicas(self) -> int:
        return self.generator_gpus // self.generator.gpus

    def describe(self) -> str:
        where = (
            f"generator on the trainer's {self.trainer_gpus} devices"
            if self.colocated
            else f"{self.generator_gpus} generator + {self.trainer_gpus} trainer devices"
        )
        return (
            f"{where}; {self.replicas} replicas of {self.generator.describe()}; weights "
            f"{self.weight_sync.replace('_', ' ')}"
        )


@dataclass(frozen=True)
class PhaseTimes:
    """Seconds of each phase of one step, and what set them."""

    generate_s: float
    train_s: float
    weight_sync_s: float
    move_s: float = 0.0
    offload_s: float = 0.0  # colocated: the trainer's state to host memory and back, per step
    detail: dict[str, float] = field(default_factory=dict, compare=False)

    @property
    def sync_step_s(self) -> float:
        """A synchronous step: every phase in turn."""
        return self.generate_s + self.move_s + self.train_s + self.weight_sync_s + self.offload_s

    @property
    def async_step_s(self) -> float:
        """A lock-step asynchronous tick in steady state: move and sync, then both halves at once."""
        return self.move_s + self.weight_sync_s + max(self.generate_s, self.train_s)


def resident_bytes(d: Deployment, eff: Efficiency) -> float:
    """Bytes per generator device that other executors keep there (the trainer, when colocated)."""
    if d.colocated and d.trainer_state_resident:
        return trainer_bytes_per_gpu(d.model, d.trainer_gpus, eff)
    return 0.0


def generate_s(
    d: Deployment, workload: Workload, gpu: GpuSpec, eff: Efficiency, seed: int = 0
) -> tuple[float, dict[str, float]]:
    """Seconds for the replicas to finish one step's sequences, and the figures that set them."""
    key = (d, workload.model_dump_json(), gpu.model_dump_json(), eff.model_dump_json(), seed)
    if key not in _GENERATE_CACHE:
        if len(_GENERATE_CACHE) > 4096:
            _GENERATE_CACHE.clear()
        _GENERATE_CACHE[key] = _generate_s(d, workload, gpu, eff, seed)
    seconds, detail = _GENERATE_CACHE[key]
    return seconds, dict(detail)


# Searches price the same placement many times (every split tries every layout, then prices the best).
_GENERATE_CACHE: dict[tuple, tuple[float, dict[str, float]]] = {}


def _generate_s(
    d: Deployment, workload: Workload, gpu: GpuSpec, eff: Efficiency, seed: int
) -> tuple[float, dict[str, float]]:
    lengths = workload.output_lengths(seed=seed)
    layout = d.generator
    kv = kv_budget_per_gpu(d.model, gpu, eff, layout, resident_bytes(d, eff))
    cost = ReplicaCost(d.model, gpu, eff, layout, kv)
    footprint = kv_footprint_tokens(lengths, workload.prompt_tokens, continuous=layout.continuous_batching)
    batch = cost.max_batch(footprint, eff.max_seqs_per_replica)
    detail = {"kv_gb_per_gpu": kv / 1e9, "max_batch": float(batch), "replicas": float(d.replicas)}
    if d.replicas < 1 or batch < 1:
        return math.inf, detail
    per_replica = shares(lengths, d.replicas, workload.samples_per_prompt)
    if d.partial_rollout:
        seconds = max(streaming_generate_s(p, cost, workload.prompt_tokens, batch) for p in per_replica)
    else:
        seconds = max(
            replica_generate_s(p, cost, workload.prompt_tokens, batch, continuous=layout.continuous_batching)
            for p in per_replica
        )
    detail["step_ms_at_max_batch"] = 1e3 * cost.step_s(
        min(batch, len(per_replica[0])), workload.prompt_tokens + footprint / 2
    )
    return seconds, detail


def price(d: Deployment, workload: Workload, gpu: GpuSpec, eff: Efficiency, seed: int = 0) -> PhaseTimes:
    """The phase times of one step of `workload` on deployment `d`."""
    gen_s, detail = generate_s(d, workload, gpu, eff, seed)
    lengths = workload.output_lengths(seed=seed)
    train = train_s(
        d.model,
        workload.prompt_tokens,
        lengths,
        gpus=d.trainer_gpus,
        gpu=gpu,
        eff=eff,
        recompute_logprobs=d.recompute_logprobs,
    )
    if d.colocated:
        train *= eff.colocated_train_slowdown
    return PhaseTimes(
        generate_s=gen_s,
        train_s=train,
        weight_sync_s=sync_s(d, gpu, eff),
        move_s=replay_move_s(d, workload, lengths, gpu, eff),
        offload_s=offload_s(d, gpu, eff),
        detail=detail,
    )


def sync_s(d: Deployment, gpu: GpuSpec, eff: Efficiency) -> float:
    """Seconds of one weight sync of deployment `d` (its layout, its bytes on the wire)."""
    wire = DTYPE_BYTES[d.wire_dtype] if d.sync_bytes_per_param is None else d.sync_bytes_per_param
    return weight_sync_s(
        d.weight_sync,
        d.model,
        wire_bytes_per_param=wire,
        trainer_gpus=d.trainer_gpus,
        replicas=max(d.replicas, 1),
        replica_gpus=d.generator.gpus,
        gpu=gpu,
        eff=eff,
        crosses_nodes=d.colocated or d.total_gpus > gpu.gpus_per_node,
    )


def offload_s(d: Deployment, gpu: GpuSpec, eff: Efficiency) -> float:
    """Seconds per step to move a colocated trainer's sharded state to host memory before generation
    and back after it (zero when it stays resident or the generator has devices of its own)."""
    if not d.colocated or d.trainer_state_resident:
        return 0.0
    state = d.model.params * eff.trainer_bytes_per_param / d.trainer_gpus
    return 2 * state / (gpu.host_link_gbs * 1e9)


def replay_move_s(
    d: Deployment, workload: Workload, lengths: list[int], gpu: GpuSpec, eff: Efficiency
) -> float:
    """Seconds to carry a MoE model's routing-replay ids from the generators to the trainer (every
    generator device sends its share over the network; zero for dense models and colocated ones)."""
    if not d.model.is_moe or d.colocated:
        return 0.0
    tokens = sum(workload.prompt_tokens + n for n in lengths)
    senders = max(1, min(d.generator_gpus, d.trainer_gpus))
    per_device = moe.routing_replay_bytes(d.model, tokens) / senders
    return per_device / (gpu.link_bandwidth(crosses_nodes=True) * eff.link_eff)


def best_generator_layout(
    d: Deployment,
    workload: Workload,
    gpu: GpuSpec,
    eff: Efficiency,
    *,
    tps: tuple[int, ...] = TP_CHOICES,
    pps: tuple[int, ...] = PP_CHOICES,
) -> tuple[Deployment, float]:
    """`d` with the replica layout (TP x PP, same engine and precision) that generates fastest."""
    best: tuple[Deployment, float] = (d, math.inf)
    for tp in tps:
        for pp in pps:
            if d.generator_gpus % (tp * pp):
                continue
            candidate = replace(d, generator=replace(d.generator, tp=tp, pp=pp))
            seconds, _ = generate_s(candidate, workload, gpu, eff)
            if seconds < best[1]:
                best = (candidate, seconds)
    return best


def best_split(
    template: Deployment,
    total_gpus: int,
    workload: Workload,
    gpu: GpuSpec,
    eff: Efficiency,
    *,
    step: int | None = None,
    tps: tuple[int, ...] = TP_CHOICES,
    pps: tuple[int, ...] = PP_CHOICES,
) -> tuple[Deployment, PhaseTimes]:
    """The generator/trainer split of `total_gpus` (in multiples of `step`, default a node) with the
    shortest lock-step asynchronous tick, each side on its own devices.

    Generation gets faster and training slower as devices move to the generator, so the best tick is
    near where the two cross: found by bisection, then the neighbours around it are compared.
    """
    step = step or min(gpu.gpus_per_node, total_gpus // 2) or 1
    # The trainer must fit on what it is left; the generator gets the rest.
    options = [
        g for g in range(step, total_gpus, step) if trainer_fits(template.model, total_gpus - g, gpu, eff)
    ]
    if not options:
        raise ValueError(
            f"{total_gpus} devices cannot hold both a {template.model.name} trainer and a generator"
        )
    priced: dict[int, tuple[Deployment, PhaseTimes]] = {}

    def at(i: int) -> tuple[Deployment, PhaseTimes]:
        if i not in priced:
            g = options[i]
            d = replace(template, generator_gpus=g, trainer_gpus=total_gpus - g)
            d, _ = best_generator_layout(d, workload, gpu, eff, tps=tps, pps=pps)
            priced[i] = (d, price(d, workload, gpu, eff))
        return priced[i]

    lo, hi = 0, len(options) - 1  # the first split whose generation is no slower than training
    while lo < hi:
        mid = (lo + hi) // 2
        times = at(mid)[1]
        if times.generate_s <= times.train_s:
            hi = mid
        else:
            lo = mid + 1
    around = range(max(0, lo - 2), min(len(options), lo + 3))
    return min((at(i) for i in around), key=lambda pair: pair[1].async_step_s)
