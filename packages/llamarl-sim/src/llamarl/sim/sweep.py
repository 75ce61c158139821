"""How much the `paper` table hangs on its unpublished assumptions: one at a time over a stated range.

Every assumption the paper does not publish gets a plausible range (the reason is on each `Knob`):
its two ends where the effect is smooth, two inner points too where memory makes it move in steps
(layouts that fit or not); the device counts move by up to two nodes either way. Each speed-up is
then reported as a range (lowest, as fitted, highest) with the assumption that moves it most,
against the paper's baseline and against the strongest synchronous baseline
(`llamarl.sim.baselines`). Three more rows replay the defaults as they were before commit bf5f12a
retuned them with the table in view, and the 405B runs on the 1024 devices secondary sources give.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from llamarl.sim import baselines, paper
from llamarl.sim.models import MODELS


@dataclass(frozen=True)
class Knob:
    """One assumption, its plausible values and why that range."""

    path: str  # field of PaperSetup, dotted: "efficiency.train_mfu", "gpus_8b"
    values: tuple[float, ...]
    why: str


KNOBS: tuple[Knob, ...] = (
    Knob("efficiency.train_mfu", (0.3, 0.5), "FSDP bf16 training MFU reported for 8B-405B"),
    Knob("efficiency.decode_bandwidth_eff", (0.6, 0.85), "decode kernels reach 60-85% of HBM"),
    Knob("efficiency.decode_compute_eff", (0.3, 0.7), "large-batch decode matmuls"),
    Knob("efficiency.prefill_compute_eff", (0.3, 0.7), "prefill matmuls"),
    Knob("efficiency.layer_overhead_us", (2, 10), "per layer and step left with CUDA graphs"),
    Knob("efficiency.eager_layer_overhead_us", (100, 300), "eager launches; was 100 before bf5f12a"),
    Knob("efficiency.memory_usable_frac", (0.85, 0.88, 0.92, 0.95), "allocator slack"),
    Knob("efficiency.runtime_reserve_gb", (2, 3, 6, 8), "CUDA context, NCCL buffers, decode activations"),
    Knob(
        "efficiency.trainer_workspace_gb",
        (4, 6, 10, 12),
        "recomputed layer, logits; 12 GB: 405B no longer fits",
    ),
    Knob("efficiency.train_micro_batch_tokens", (4096, 6144, 12288, 16384), "checkpointed layer inputs"),
    Knob("efficiency.max_seqs_per_replica", (256, 1024), "engine limit on running sequences"),
    Knob("efficiency.link_eff", (0.6, 0.9), "bulk transfers over NVLink and the network"),
    Knob("gpu.network_gbs", (25, 100), "200-800 Gb/s per device between nodes"),
    Knob("workload.prompts_per_step", (256, 384, 768, 1024), "prompts per step"),
    Knob("workload.samples_per_prompt", (4, 6, 12, 16), "group size"),
    Knob("workload.prompt_tokens", (128, 192, 384, 512), "math prompts with a chat template"),
    Knob("workload.median_output_tokens", (200, 250, 450, 600), "was 600 before bf5f12a"),
    Knob("workload.output_sigma", (0.6, 1.0), "long tail; was 0.6 before bf5f12a"),
    Knob("workload.max_new_tokens", (512, 768, 1536, 2048), "was 2048 before bf5f12a"),
    Knob("baseline_min_batch", (1, 16), "the baseline's smallest layout holds this many sequences"),
)

# The defaults before commit bf5f12a ("simulator: paper ..."), which retuned them with the table in
# view; a 1-token micro-batch and 8 GB of workspace is the old flat 8 GB of trainer activations.
BEFORE_RETUNE_WORKLOAD = {
    "workload.median_output_tokens": 600.0,
    "workload.output_sigma": 0.6,
    "workload.max_new_tokens": 2048,
}
BEFORE_RETUNE_ALL = {
    **BEFORE_RETUNE_WORKLOAD,
    "efficiency.eager_layer_overhead_us": 100.0,
    "efficiency.train_micro_batch_tokens": 1,
    "efficiency.trainer_workspace_gb": 8.0,
}
NODE_STEPS = (-2, -1, 1, 2)


def with_values(setup: paper.PaperSetup, values: dict[str, float]) -> paper.PaperSetup:
    """`setup` with dotted fields replaced (validated like flags)."""
    data = setup.model_dump()
    for path, value in values.items():
        *parents, name = path.split(".")
        node = data
        for parent in parents:
            node = node[parent]
        node[name] = value
    return paper.PaperSetup.model_validate(data)


@dataclass(frozen=True)
class Outcome:
    """One variant of the setup: speed-ups per size (None: it does not fit) and the largest error."""

    label: str
    speedups: dict[str, float | None]  # against the paper's baseline
    strong: dict[str, float | None]  # against the strongest synchronous baseline
    largest_error: float | None


def evaluate(label: str, setup: paper.PaperSetup) -> Outcome:
    """The table under `setup`, reduced to what the sweep reports."""
    speedups: dict[str, float | None] = {}
    strong: dict[str, float | None] = {}
    errors: list[float] = []
    for size in paper.SIZES:
        model, gpus = MODELS[size], setup.gpus(size)
        try:
            _, base = paper.baseline(model, gpus, setup)
            _, fast = paper.llamarl(model, gpus, setup)
        except ValueError:
            speedups[size] = strong[size] = None
            continue
        if math.isinf(base.sync_step_s) or math.isinf(fast.async_step_s):
            speedups[size] = strong[size] = None
            continue
        speedups[size] = base.sync_step_s / fast.async_step_s
        best = baselines.strongest_sync(model, gpus, setup.workload, setup.gpu, setup.efficiency)
        strong[size] = None if best is None else best[1].sync_step_s / fast.async_step_s
        published = paper.PUBLISHED[size]
        errors += [abs(base.sync_step_s / published[0] - 1), abs(fast.async_step_s / published[1] - 1)]
    complete = all(v is not None for v in speedups.values())
    return Outcome(label, speedups, strong, max(errors) if complete else None)


def variants(setup: paper.PaperSetup, knobs: tuple[Knob, ...] = KNOBS) -> list[tuple[str, Outcome]]:
    """(assumption, outcome) for every value of every knob and every device-count step."""
    out = []
    for knob in knobs:
        for value in knob.values:
            out.append(
                (knob.path, evaluate(f"{knob.path}={value:g}", with_values(setup, {knob.path: value})))
            )
    for size in paper.SIZES:
        path = f"gpus_{size}"
        for nodes in NODE_STEPS:
            gpus = setup.gpus(size) + nodes * setup.gpu.gpus_per_node
            out.append((path, evaluate(f"{path}={gpus}", with_values(setup, {path: gpus}))))
    return out


def _range(fitted: float, found: list[tuple[str, float]]) -> str:
    values = [v for _, v in found] + [fitted]
    moved = max(found, key=lambda kv: abs(math.log(kv[1] / fitted)), default=("-", fitted))
    return f"{min(values):.2f}x | {fitted:.2f}x | {max(values):.2f}x | {moved[0]}"


def report(setup: paper.PaperSetup, knobs: tuple[Knob, ...] = KNOBS) -> list[str]:
    """The `paper --sweep` output: ranges per size, then every assumption's effect."""
    fitted = evaluate("as fitted", setup)
    found = variants(setup, knobs)
    lines = [
        "Sensitivity: each assumption alone over its stated range, the device counts +-2 nodes "
        "(everything else as fitted). A variant that does not fit is left out of the ranges.",
        "",
        "| model | speed-up min | as fitted | max | moved most by | vs strongest sync min | as fitted "
        "| max | moved most by |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for size in paper.SIZES:
        base = [(p, o.speedups[size]) for p, o in found if o.speedups[size] is not None]
        strong = [(p, o.strong[size]) for p, o in found if o.strong[size] is not None]
        lines.append(
            f"| {size.upper()} | {_range(fitted.speedups[size] or math.nan, base)} | "
            f"{_range(fitted.strong[size] or math.nan, strong)} |"
        )
    lines += ["", "| assumption = value | 8B | 70B | 405B | vs strongest: 8B | 70B | 405B | largest error |"]
    lines.append("|---|---|---|---|---|---|---|---|")
    for _, o in found:
        lines.append(_row(o))
    extra = [
        evaluate(
            "workload before bf5f12a (median 600, sigma 0.6, cut 2048)",
            with_values(setup, BEFORE_RETUNE_WORKLOAD),
        ),
        evaluate(
            "all defaults before bf5f12a (+ eager 100 us, flat 8 GB activations)",
            with_values(setup, BEFORE_RETUNE_ALL),
        ),
        evaluate(
            "405B on 1024 devices (the count secondary sources give)", with_values(setup, {"gpus_405b": 1024})
        ),
    ]
    lines += [_row(o) for o in extra]
    worst = max((o for _, o in found), key=lambda o: -1 if o.largest_error is None else o.largest_error)
    lines.append(
        f"Largest relative error over the sweep: {worst.largest_error:.0%} ({worst.label}); as fitted "
        f"{fitted.largest_error:.1%}."
    )
    return lines


def _row(o: Outcome) -> str:
    def cell(v: float | None) -> str:
        return "does not fit" if v is None else f"{v:.2f}x"

    error = "-" if o.largest_error is None else f"{o.largest_error:.0%}"
    base = " | ".join(cell(o.speedups[s]) for s in paper.SIZES)
    strong = " | ".join(cell(o.strong[s]) for s in paper.SIZES)
    return f"| {o.label} | {base} | {strong} | {error} |"
