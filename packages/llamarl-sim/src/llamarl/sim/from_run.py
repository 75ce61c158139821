"""Predict a measured run's step time in other modes and with other rank counts.

The run's own phase times are the costs; what changes with the mode or the ranks is priced by a few
stated assumptions (`HostAssumptions`):

- Threads: the launcher gives every rank all cores in sync mode and cores / ranks otherwise. A phase
  measured with k threads takes seconds x S(k) / S(k') with k' threads, S(k) = 1 / ((1 - f) + f / k)
  (Amdahl; f per phase). Phases running at once share the machine's cores (processor sharing), each
  keeping S(k) cores busy.
- Generators: a batched `generate` call makes as many decoding steps as its longest completion, each
  costing a + b x rows: a reads the weights, b computes one row. Their ratio comes from a roofline of
  the model on the host (bytes / bandwidth against FLOPs / FLOP rate), their scale from the run. Each
  generator takes its contiguous share of a step's prompts, so with g generators a batch takes as
  long as its slowest share.
- Trainers: data-parallel ranks split a step's sequences; `trainer_scaling_eff` says how much of the
  ideal speed-up survives the gradient all-reduce.
- Weight sync: every generator receives the whole model from the trainer over one link, so the time
  grows with the number of generators; rollout transfers keep their measured time.
"""

from __future__ import annotations

import math
import os
import statistics
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, Field

from llamarl.sim.measured_run import MeasuredRun
from llamarl.sim.models import SMOLLM2_135M, ModelSpec, model_named
from llamarl.sim.schedules import (
    Placement,
    ScheduleResult,
    StreamSettings,
    simulate_lockstep,
    simulate_stream,
)


class HostAssumptions(BaseModel):
    """How phase times change with threads, ranks and batch shares on a CPU host (stated, adjustable)."""

    cores: int = Field(default_factory=lambda: os.cpu_count() or 1, ge=1, description="cores of the machine")
    generate_parallel_frac: float = Field(
        0.8,
        ge=0,
        le=1,
        description="Amdahl parallel fraction of generation (README bench_modes table: 17.6 s with 2 "
        "threads alone, 30.0 s with 1 thread beside a training rank: 1.70x)",
    )
    train_parallel_frac: float = Field(
        0.9, ge=0, le=1, description="Amdahl parallel fraction of training (same table: 12.5 s vs 22.9 s)"
    )
    memory_gbs: float = Field(10.0, gt=0, description="memory bandwidth one decoding thread gets (GB/s)")
    gflops: float = Field(20.0, gt=0, description="fp32 GFLOP/s one thread reaches in small-batch matmuls")
    weight_bytes_per_param: float = Field(4.0, gt=0, description="fp32 weights on the CPU")
    trainer_scaling_eff: float = Field(
        0.85, gt=0, le=1, description="share of the ideal speed-up from more data-parallel trainer ranks"
    )

    def speedup(self, threads: float, parallel_frac: float) -> float:
        """Amdahl speed-up of `threads` threads over one."""
        return 1.0 / ((1.0 - parallel_frac) + parallel_frac / max(threads, 1e-9))


@dataclass(frozen=True)
class Target:
    """A configuration to predict: schedule and rank counts."""

    mode: str  # sync, async, stream
    generators: int
    trainers: int = 1

    def describe(self) -> str:
        return f"{self.mode}, {self.trainers} trainer + {self.generators} generator ranks"


def threads_per_rank(mode: str, ranks: int, cores: int) -> int:
    """The launcher's default (`llamarl.control.launch.threads.default_threads`): all cores in sync mode,
    an even share otherwise."""
    return cores if mode == "sync" else max(1, cores // ranks)


class RunCosts:
    """A measured run's phase costs, re-priced for a `Target` (the `PhaseCosts` of the schedules)."""

    def __init__(self, run: MeasuredRun, target: Target, host: HostAssumptions, model: ModelSpec) -> None:
        self.run, self.target, self.host, self.model = run, target, host, model
        measured_threads = threads_per_rank(run.mode, run.num_trainers + run.num_generators, host.cores)
        self.threads = threads_per_rank(target.mode, target.trainers + target.generators, host.cores)
        gen_f, train_f = host.generate_parallel_frac, host.train_parallel_frac
        self._gen_scale = host.speedup(measured_threads, gen_f) / host.speedup(self.threads, gen_f)
        self._train_scale = host.speedup(measured_threads, train_f) / host.speedup(self.threads, train_f)
        # Data-parallel trainer ranks split each step's sequences.
        dp = _data_parallel_time(target.trainers, host) / _data_parallel_time(run.num_trainers, host)
        self._train_scale *= dp
        self.batches = sorted(b for b in run.generate_s if b in run.lengths) or sorted(run.generate_s)
        # Seconds per decoding step of one generator at its measured rows, from every measured batch.
        rows = run.prompts_per_step * run.samples_per_prompt // run.num_generators
        per_step = []
        for b in self.batches:
            for g, seconds in run.generate_s[b].items():
                share = self._share(b, g, run.num_generators)
                if share:
                    per_step.append(seconds / max(share))
        self.step_s_measured = statistics.median(per_step) if per_step else math.nan
        self.rows_measured = rows
        fixed = model.matmul_params * host.weight_bytes_per_param / (host.memory_gbs * 1e9)
        per_row = 2 * model.matmul_params / (host.gflops * 1e9)
        self.fixed_frac = fixed / (fixed + per_row * rows)
        self._score_per_row = (
            statistics.median(s / rows for b in run.score_s for s in run.score_s[b].values())
            if run.score_s
            else 0.0
        )
        self._sync = statistics.median(run.weight_sync_s) if run.weight_sync_s else 0.0
        self._move = statistics.median(run.move_s) if run.move_s else 0.0
        self.overhead_s = _step_overhead_s(run, self._sync, self._move)

    def _batch(self, index: int) -> int:
        return self.batches[index % len(self.batches)]

    def _share(self, batch: int, generator: int, generators: int) -> list[int]:
        """Token lengths of generator `generator`'s contiguous share of `batch` (whole prompts)."""
        lengths = self.run.lengths.get(batch, [])
        group = self.run.samples_per_prompt
        prompts = len(lengths) // group
        per = prompts // generators
        return lengths[generator * per * group : (generator + 1) * per * group]

    def decode_step_s(self, rows: int) -> float:
        """Seconds of one decoding step with `rows` sequences, at the measured threads."""
        relative = self.fixed_frac + (1 - self.fixed_frac) * rows / self.rows_measured
        return self.step_s_measured * relative

    def generate_s(self, batch: int, generator: int) -> float:
        b = self._batch(batch)
        if self.target.generators == self.run.num_generators and generator in self.run.generate_s[b]:
            return self.run.generate_s[b][generator] * self._gen_scale  # the same share: as measured
        share = self._share(b, generator, self.target.generators)
        if not share:  # no lengths were read: scale the measured time by the rows
            rows_ratio = self.run.num_generators / self.target.generators
            seconds = self.run.generate_total_s(b) * (self.fixed_frac + (1 - self.fixed_frac) * rows_ratio)
            return seconds * self._gen_scale
        return max(share) * self.decode_step_s(len(share)) * self._gen_scale

    def score_s(self, batch: int, generator: int) -> float:
        rows = self.run.prompts_per_step * self.run.samples_per_prompt / self.target.generators
        return self._score_per_row * rows

    def train_s(self, batch: int) -> float:
        measured = self.run.train_s[batch % len(self.run.train_s)]
        return measured * self._train_scale + self.overhead_s

    def weight_sync_s(self) -> float:
        return self._sync * self.target.generators / self.run.num_generators

    def move_s(self) -> float:
        return self._move

    def placement(self) -> Placement:
        """Every rank on the host's cores. A phase keeps as many cores busy as its Amdahl speed-up
        (a serial phase one, whatever its threads), and that is what it asks of the shared pool."""
        host, threads = self.host, self.threads
        return Placement(
            generators=self.target.generators,
            trainer_pool="host",
            generator_pool="host",
            pool_cores={"host": float(host.cores)},
            trainer_threads=self.target.trainers * host.speedup(threads, host.train_parallel_frac),
            generator_threads=host.speedup(threads, host.generate_parallel_frac),
        )


def _step_overhead_s(run: MeasuredRun, sync_s: float, move_s: float) -> float:
    """What a lock-step run's steps took beyond their phases (logging, bookkeeping), per step: the
    median over steps 2.. of the measured step minus what its phases explain (0 in stream mode)."""
    if not run.lockstep:
        return 0.0
    lag = 0 if run.mode == "sync" else 1
    residuals = []
    for step, step_s in enumerate(run.step_times):
        gen_batch = step + lag  # what the generators made during this step
        if step == 0 or step_s != step_s or step not in run.train_s or gen_batch not in run.generate_s:
            continue
        gen_s = max(run.generate_s[gen_batch].values()) + max(run.score_s.get(gen_batch, {0: 0.0}).values())
        if run.mode == "sync":
            explained = gen_s + move_s + run.train_s[step] + sync_s
        else:
            explained = move_s + sync_s + max(gen_s, run.train_s[step])
        residuals.append(step_s - explained)
    return max(0.0, statistics.median(residuals)) if residuals else 0.0


def _data_parallel_time(trainers: int, host: HostAssumptions) -> float:
    """Relative time of a training step on `trainers` data-parallel ranks (1 on one rank)."""
    return 1.0 if trainers == 1 else 1.0 / (trainers * host.trainer_scaling_eff)


def predict(
    run: MeasuredRun,
    target: Target,
    host: HostAssumptions,
    *,
    steps: int | None = None,
    max_policy_lag: int = 1,
    buffer_groups: int = 0,
    in_flight: bool = True,
) -> ScheduleResult:
    """The simulated run of `target` with the measured run's costs."""
    model = _model_of(run)
    costs = RunCosts(run, target, host, model)
    steps = steps or run.steps
    placement = costs.placement()
    if target.mode == "sync":
        return simulate_lockstep(0, steps, costs, placement)
    if target.mode == "async":
        return simulate_lockstep(1, steps, costs, placement)
    if target.mode == "stream":
        settings = StreamSettings(
            groups_per_step=run.prompts_per_step,
            groups_per_request=max(1, run.prompts_per_step // target.generators),
            buffer_groups=buffer_groups,
            max_policy_lag=max_policy_lag,
            in_flight=in_flight,
        )
        return simulate_stream(steps, costs, settings, placement)
    raise ValueError(f"unknown mode {target.mode!r}")


def _model_of(run: MeasuredRun) -> ModelSpec:
    """The run's model shape (its folder's config.json), SmolLM2-135M when the folder is gone."""
    try:
        return model_named(run.model)
    except ValueError:
        return SMOLLM2_135M


def sync_bytes(run: MeasuredRun, host: HostAssumptions) -> float:
    """Bytes one weight sync moves to one generator: every parameter at the host's weight precision."""
    return _model_of(run).params * host.weight_bytes_per_param


def describe_costs(run: MeasuredRun, host: HostAssumptions) -> list[str]:
    """The calibrated figures, one line each."""
    costs = RunCosts(run, Target(run.mode, run.num_generators, run.num_trainers), host, _model_of(run))
    sync = costs.weight_sync_s()
    threads = threads_per_rank(run.mode, run.num_trainers + run.num_generators, host.cores)
    lines = [
        f"threads per rank in the run: {threads} of {host.cores} cores",
        f"decoding step: {1e3 * costs.step_s_measured:.1f} ms at {costs.rows_measured} rows "
        f"({costs.fixed_frac:.0%} of it reading weights, by the host roofline)",
        "longest completion per batch: "
        + ", ".join(str(max(costs._share(b, 0, 1))) for b in costs.batches if costs._share(b, 0, 1))
        + " tokens",
        "generate per batch (s): "
        + ", ".join(f"{run.generate_total_s(b):.2f}" for b in sorted(run.generate_s)),
        "train per step (s): " + ", ".join(f"{s:.2f}" for s in run.train_s.values()),
        f"score per row: {1e3 * costs._score_per_row:.1f} ms; rollout transfer {costs.move_s():.3f} s",
        f"weight sync: {sync:.3f} s for {sync_bytes(run, host) / 1e6:.0f} MB "
        f"({sync_bytes(run, host) / max(sync, 1e-9) / 1e9:.2f} GB/s per generator)",
    ]
    return lines


def default_targets(run: MeasuredRun) -> list[Target]:
    """What `from-run` predicts unless told: every mode with the run's ranks, and one more generator."""
    targets = [Target(m, run.num_generators, run.num_trainers) for m in ("sync", "async", "stream")]
    targets += [Target(m, run.num_generators * 2, run.num_trainers) for m in ("sync", "async", "stream")]
    return targets


@dataclass(frozen=True)
class Prediction:
    """A target's predicted step time, and the measured one when a run of it was given."""

    target: Target
    predicted_s: float
    measured_s: float | None = None
    measured_path: Path | None = None

    @property
    def error(self) -> float | None:
        return None if self.measured_s is None else self.predicted_s / self.measured_s - 1


def predictions(
    run: MeasuredRun, host: HostAssumptions, compare: list[MeasuredRun], targets: list[Target] | None = None
) -> list[Prediction]:
    """Predicts `targets` (default: every mode with the run's ranks and with twice the generators, plus
    whatever `compare` holds) and pairs them with the compared runs."""
    wanted = list(targets or default_targets(run))
    # The run itself is paired too: its prediction checks the model against its own calibration.
    measured = {Target(c.mode, c.num_generators, c.num_trainers): c for c in [run, *compare]}
    wanted += [t for t in measured if t not in wanted]
    out = []
    for target in wanted:
        result = predict(run, target, host)
        other = measured.get(target)
        out.append(
            Prediction(
                target,
                result.step_s,
                None if other is None else other.step_time_s,
                None if other is None else other.path,
            )
        )
    return out


def report(run: MeasuredRun, host: HostAssumptions, found: list[Prediction]) -> list[str]:
    """The `from-run` command's output."""
    lines = [f"Run: {run.describe()}", "Calibrated from it:"]
    lines += [f"  {line}" for line in describe_costs(run, host)]
    lines.append("Assumptions:")
    for name, info in HostAssumptions.model_fields.items():
        lines.append(f"  host.{name} = {getattr(host, name)}: {info.description}")
    lines += [
        "",
        "| mode | trainer + generator ranks | predicted step s | measured step s | error | measured run |",
        "|---|---|---|---|---|---|",
    ]
    for p in found:
        measured = "-" if p.measured_s is None else f"{p.measured_s:.2f}"
        error = "-" if p.error is None else f"{p.error:+.1%}"
        source = "-" if p.measured_path is None else str(p.measured_path)
        if p.measured_path == run.path:
            source += " (calibration run)"
        lines.append(
            f"| {p.target.mode} | {p.target.trainers} + {p.target.generators} | {p.predicted_s:.2f} | "
            f"{measured} | {error} | {source} |"
        )
    errors = [abs(p.error) for p in found if p.error is not None and p.measured_path != run.path]
    if errors:
        lines.append(f"Largest relative error against other runs: {max(errors):.1%}")
    return lines
