"""Recommend how to split a cluster between generation and training, and which schedule to run.

For every split of the devices (in whole nodes) the generator gets its best replica layout; each
candidate is priced per phase and its step simulated in each mode:

- `sync`: llamarl's synchronous mode: generator and trainer on their own devices, taking turns.
- `async`: lock step, one policy version behind; the two halves run at once.
- `stream`: generators never wait for the trainer (bounded buffer, staleness bound 1).

The strongest synchronous baseline (`llamarl.sim.baselines`: colocated, the trainer's state offloaded
while generating, a modern fp8 engine) is priced too: it is what a cluster gives without llamarl's
split, and the recommendation says what the split buys against it. The report then prices what is
being built around the recommended system: the weight sync as a delta (`DeltaSync`), failures
recovered by trainer replicas against a restart from the last checkpoint (`llamarl.sim.recovery`),
and, for a mixture-of-experts model, the expert all-to-all and the routing-replay bytes
(`llamarl.sim.moe`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from llamarl.sim import baselines, moe, recovery
from llamarl.sim.deployment import (
    PP_CHOICES,
    Deployment,
    PhaseTimes,
    best_generator_layout,
    price,
    sync_s,
)
from llamarl.sim.generation import GeneratorLayout
from llamarl.sim.hardware import Efficiency, GpuSpec
from llamarl.sim.memory import activation_bytes, trainer_fits
from llamarl.sim.models import ModelSpec
from llamarl.sim.recovery import FailureModel
from llamarl.sim.schedules import (
    ConstantCosts,
    StreamSettings,
    simulate_lockstep,
    simulate_stream,
)
from llamarl.sim.weight_sync import DeltaSync, weight_sync_s
from llamarl.sim.workload import Workload

MODES = ("sync", "async", "stream")
STRONGEST = "sync, colocated, offloaded (strongest baseline)"


@dataclass(frozen=True)
class Candidate:
    """One way to run the cluster, and its predicted step time."""

    mode: str
    deployment: Deployment
    times: PhaseTimes
    step_s: float

    @property
    def label(self) -> str:
        d = self.deployment
        if d.colocated:
            return f"{d.total_gpus} shared"
        return f"{d.generator_gpus} gen + {d.trainer_gpus} train"


def step_time(mode: str, times: PhaseTimes, steps: int = 8) -> float:
    """Steady-state step time of `mode` with these phase times (the last simulated step)."""
    if math.isinf(times.generate_s):
        return math.inf
    costs = ConstantCosts(
        generate=times.generate_s, train=times.train_s, weight_sync=times.weight_sync_s, move=times.move_s
    )
    if mode == "sync":
        return simulate_lockstep(0, steps, costs).steady_step_s
    if mode == "async":
        return simulate_lockstep(1, steps, costs).steady_step_s
    settings = StreamSettings(groups_per_step=1, groups_per_request=1, max_policy_lag=1)
    return simulate_stream(steps, costs, settings).steady_step_s


def candidates(
    model: ModelSpec,
    total_gpus: int,
    workload: Workload,
    gpu: GpuSpec,
    eff: Efficiency,
    *,
    generator_dtype: str = "fp8",
    step_gpus: int | None = None,
) -> list[Candidate]:
    """Every split in multiples of `step_gpus` (default: a node) and mode, plus the colocated
    reference; infeasible ones (the trainer or generator does not fit) are left out."""
    step_gpus = step_gpus or min(gpu.gpus_per_node, max(total_gpus // 2, 1))
    template = Deployment(model, 0, 0, GeneratorLayout(weight_dtype=generator_dtype))
    out: list[Candidate] = []
    for generator_gpus in range(step_gpus, total_gpus, step_gpus):
        trainer_gpus = total_gpus - generator_gpus
        if not trainer_fits(model, trainer_gpus, gpu, eff):
            continue
        d = replace(template, generator_gpus=generator_gpus, trainer_gpus=trainer_gpus)
        d, seconds = best_generator_layout(d, workload, gpu, eff, tps=(1, 2, 4, 8), pps=PP_CHOICES)
        if math.isinf(seconds):
            continue
        times = price(d, workload, gpu, eff)
        out += [Candidate(mode, d, times, step_time(mode, times)) for mode in MODES]
    strongest = baselines.strongest_sync(
        model, total_gpus, workload, gpu, eff, generator_dtype=generator_dtype
    )
    if strongest is not None and not math.isinf(strongest[1].generate_s):
        shared, times = strongest
        out.append(Candidate(STRONGEST, shared, times, times.sync_step_s))
    return out


def best_per_mode(found: list[Candidate]) -> list[Candidate]:
    """The fastest candidate of each mode, fastest first."""
    best: dict[str, Candidate] = {}
    for c in found:
        if c.mode not in best or c.step_s < best[c.mode].step_s:
            best[c.mode] = c
    return sorted(best.values(), key=lambda c: c.step_s)


@dataclass(frozen=True)
class Extras:
    """What the report prices around the recommended system (stated inputs, defaults documented)."""

    delta: DeltaSync = field(default_factory=DeltaSync)
    failures: FailureModel = field(default_factory=FailureModel)
    trainer_replicas: int = 2


def report(
    model: ModelSpec,
    total_gpus: int,
    workload: Workload,
    gpu: GpuSpec,
    eff: Efficiency,
    *,
    generator_dtype: str = "fp8",
    top: int = 5,
    extras: Extras | None = None,
) -> list[str]:
    """The `plan` command's output: the best candidate per mode, the best splits, a recommendation,
    then the weight sync (whole and as a delta), failures and, for MoE models, expert costs."""
    extras = extras or Extras()
    found = candidates(model, total_gpus, workload, gpu, eff, generator_dtype=generator_dtype)
    found = [c for c in found if not math.isinf(c.step_s)]
    active = f", {model.active_matmul_params / 1e9:.1f}B active per token" if model.is_moe else ""
    lines = [
        f"Plan: {model.name} ({model.params / 1e9:.1f}B parameters{active}) on {total_gpus} x {gpu.name}",
        f"  workload: {workload.describe()}",
        f"  trainer: {eff.trainer_bytes_per_param:.0f} bytes/parameter sharded over its devices, plus "
        f"{activation_bytes(model, eff) / 1e9:.1f} GB of checkpointed activations and "
        f"{eff.trainer_workspace_gb:.0f} GB of workspace per device; generator {generator_dtype} weights",
    ]
    if not found:
        return [*lines, "Nothing fits: the trainer's state or the generator's weights need more devices."]
    lines += [
        "",
        "| mode | devices | generator replica | replicas | KV GB/device | generate s | train s "
        "| weight sync s | step s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    ranked = best_per_mode(found)
    async_ranked = sorted((c for c in found if c.mode == ranked[0].mode), key=lambda c: c.step_s)
    shown = ranked + [c for c in async_ranked[1:top] if c not in ranked]
    for c in shown:
        d, t = c.deployment, c.times
        lines.append(
            f"| {c.mode} | {c.label} | {d.generator.describe()} | {d.replicas} | "
            f"{t.detail['kv_gb_per_gpu']:.0f} | {t.generate_s:.2f} | {t.train_s:.2f} | "
            f"{t.weight_sync_s:.2f} | {c.step_s:.2f} |"
        )
    best = ranked[0]
    lines += ["", *_recommendation_lines(best, ranked, found)]
    lines += _weight_sync_lines(model, best, gpu, eff, extras.delta)
    if not best.deployment.colocated:
        lines += _recovery_lines(model, best, gpu, eff, extras)
    if model.is_moe:
        lines += _moe_lines(model, best, workload, gpu, eff)
    lines.append(
        "  Stream matches async here because every step is priced with the same phase times; it gains "
        "when generation times vary from step to step (from-run prices measured steps)."
    )
    return lines


def _recommendation_lines(best: Candidate, ranked: list[Candidate], found: list[Candidate]) -> list[str]:
    d = best.deployment
    lines = [
        f"Recommendation: {best.mode} with {best.label} devices ({d.replicas} generator replicas of "
        f"{d.generator.describe()}): {best.step_s:.2f} s per step."
    ]
    same_split_sync = next((c for c in found if c.mode == "sync" and c.deployment == d), None)
    others = [f"{c.mode} at best {c.step_s:.2f} s" for c in ranked[1:]]
    if same_split_sync is not None and best.mode != "sync":
        others.append(f"sync on the same split {same_split_sync.step_s:.2f} s")
    if others:
        lines.append("  Against: " + "; ".join(others) + ".")
    strongest = next((c for c in found if c.mode == STRONGEST), None)
    if strongest is not None and best is not strongest:
        lines.append(
            f"  Against the strongest synchronous baseline ({strongest.deployment.generator.describe()} on "
            f"all {strongest.deployment.trainer_gpus} devices, trainer state offloaded while generating): "
            f"{strongest.step_s / best.step_s:.2f}x."
        )
    if best.mode != "sync":
        lines.append(
            "  Off-policy: the trainer learns from samples one policy version old (AIPO corrects for it)."
        )
    return lines


def _weight_sync_lines(
    model: ModelSpec, best: Candidate, gpu: GpuSpec, eff: Efficiency, delta: DeltaSync
) -> list[str]:
    d = best.deployment
    kw = {
        "trainer_gpus": d.trainer_gpus,
        "replicas": max(d.replicas, 1),
        "replica_gpus": d.generator.gpus,
        "gpu": gpu,
        "eff": eff,
    }
    gathered = weight_sync_s("gather_broadcast", model, wire_bytes_per_param=2, **kw)
    wire = delta.wire_bytes_per_param(2.0)
    as_delta = sync_s(replace(d, sync_bytes_per_param=wire), gpu, eff)
    return [
        f"  Weight sync: {model.params * 2 / 1e9:.1f} GB of bf16 weights per replica, "
        f"{d.weight_sync.replace('_', ' ')} in {best.times.weight_sync_s:.2f} s per step; gathered on one "
        f"device and broadcast it would take {gathered:.1f} s.",
        f"  As a delta ({delta.change_density:.0%} of weights changed per step, measured at RL lr; "
        f"{wire:.3f} bytes per parameter): {model.params * wire / 1e9:.1f} GB in {as_delta:.2f} s.",
    ]


def _recovery_lines(
    model: ModelSpec, best: Candidate, gpu: GpuSpec, eff: Efficiency, extras: Extras
) -> list[str]:
    d = best.deployment
    replicas = extras.trainer_replicas
    if d.trainer_gpus % replicas or not trainer_fits(model, d.trainer_gpus // replicas, gpu, eff):
        return [f"  Trainer replica recovery: {replicas} replicas of the trainer do not fit its devices."]
    cost = recovery.recovery_cost(
        model,
        trainer_gpus=d.trainer_gpus,
        generator_gpus=d.generator_gpus,
        trainer_replicas=replicas,
        generator_replicas=d.replicas,
        step_s=best.step_s,
        gpu=gpu,
        eff=eff,
        failures=extras.failures,
    )
    return recovery.describe(cost, extras.failures, replicas)


def _moe_lines(
    model: ModelSpec, best: Candidate, workload: Workload, gpu: GpuSpec, eff: Efficiency
) -> list[str]:
    d, t = best.deployment, best.times
    lengths = workload.output_lengths()
    tokens = sum(workload.prompt_tokens + n for n in lengths)
    exchange = moe.train_all_to_all_s(model, tokens, d.trainer_gpus, gpu, eff)
    replay = moe.routing_replay_bytes(model, tokens)
    return [
        f"  MoE: {model.experts_per_token} of {model.experts} experts per token; the trainer's expert "
        f"all-to-all (experts over the devices of a node, not overlapped) is {exchange:.2f} s of its "
        f"{t.train_s:.2f} s; routing replay carries {replay / 1e6:.0f} MB of expert ids per step "
        f"({model.layers} layers x {model.experts_per_token} ids per token) to the trainer in "
        f"{t.move_s * 1e3:.1f} ms."
    ]
