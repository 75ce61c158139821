"""The simulator's command line: `uv run tools/simulate.py paper [--sweep] | others | from-run RUN |
plan --model M --gpus N`.

Typed by pydantic-settings from the same models the simulator computes with, so every assumption is a
flag (`--efficiency.train-mfu 0.35`, `--workload.max-new-tokens 4096`, `--host.cores 8`).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, ValidationError
from pydantic_settings import CliApp, CliPositionalArg, CliSubCommand, SettingsConfigDict

from llamarl.sim import from_run, gpu_calibration, others, paper, plan, sweep
from llamarl.sim.hardware import Efficiency, GpuSpec
from llamarl.sim.measured_run import RunReadError, read_run
from llamarl.sim.models import model_named
from llamarl.sim.recovery import FailureModel
from llamarl.sim.weight_sync import DeltaSync
from llamarl.sim.workload import Workload


class PaperCommand(paper.PaperSetup):
    """The paper's 8B / 70B / 405B synchronous and LlamaRL step times under stated assumptions (consistent
    with the table under them, not a reproduction)."""

    sweep: bool = Field(
        False,
        description="also vary each assumption over a plausible range and print the speed-ups as ranges",
    )

    def cli_cmd(self) -> None:
        setup = paper.PaperSetup.model_validate(self.model_dump(exclude={"sweep"}))
        print("\n".join(paper.report(setup)))
        if self.sweep:
            print("\n" + "\n".join(sweep.report(setup)))


class OthersCommand(BaseModel):
    """Other systems' published asynchronous speed-ups predicted with the paper's assumptions frozen."""

    threshold: float = Field(
        0.25, gt=0, description="errors beyond this get the assumption that would have to change"
    )

    def cli_cmd(self) -> None:
        print("\n".join(others.report(self.threshold)))


class FromRunCommand(BaseModel):
    """Predict a measured run's step time in the other modes and with other rank counts; a folder with a
    GPU trace (tools/gpu_check.py --out DIR) calibrates the GPU efficiencies instead."""

    output_dir: CliPositionalArg[Path] = Field(
        description="a finished run's --output-dir, or gpu_check's --out folder (gpu_trace.json)"
    )
    compare: list[Path] = Field(
        default_factory=list, description="other runs of the same work to check the predictions against"
    )
    modes: list[Literal["sync", "async", "stream"]] = Field(
        default_factory=lambda: ["sync", "async", "stream"], description="modes to predict"
    )
    generators: list[int] = Field(
        default_factory=list, description="generator ranks to predict (default: the run's and twice that)"
    )
    trainers: list[int] = Field(
        default_factory=list, description="trainer ranks to predict (default: the run's)"
    )
    max_new_tokens: int | None = Field(
        None, description="the run's --max-new-tokens (caps estimated lengths)"
    )
    host: from_run.HostAssumptions = Field(default_factory=from_run.HostAssumptions)

    def cli_cmd(self) -> None:
        trace = self.output_dir / gpu_calibration.TRACE_NAME
        if trace.is_file():  # a GPU run (tools/gpu_check.py --out DIR): calibrate the device's figures
            calibration = gpu_calibration.calibrate(gpu_calibration.read_trace(trace))
            print("\n".join(gpu_calibration.report(calibration)))
            if not (self.output_dir / "summary.json").is_file():
                return
        run = read_run(self.output_dir, self.max_new_tokens)
        compare = [read_run(p, self.max_new_tokens) for p in self.compare]
        counts = self.generators or [run.num_generators, 2 * run.num_generators]
        trainers = self.trainers or [run.num_trainers]
        targets = [from_run.Target(m, g, t) for t in trainers for g in counts for m in self.modes]
        found = from_run.predictions(run, self.host, compare, targets)
        print("\n".join(from_run.report(run, self.host, found)))


class PlanCommand(BaseModel):
    """Recommend the generator/trainer split and the schedule for a cluster, with predicted step times."""

    model: str = Field(
        "8b", description="8b, 70b, 405b, qwen2.5-7b, qwen3-30b-a3b, ... or a transformers model folder"
    )
    gpus: int = Field(64, ge=2, description="devices in the cluster")
    generator_dtype: str = Field("fp8", description="generator weights: fp8 or bf16")
    top: int = Field(5, ge=1, description="splits shown for the recommended mode")
    trainer_replicas: int = Field(2, ge=1, description="data-parallel trainer replicas for failure recovery")
    workload: Workload = Field(default_factory=Workload)
    gpu: GpuSpec = Field(default_factory=GpuSpec)
    efficiency: Efficiency = Field(default_factory=Efficiency)
    delta: DeltaSync = Field(default_factory=DeltaSync)
    failures: FailureModel = Field(default_factory=FailureModel)

    def cli_cmd(self) -> None:
        lines = plan.report(
            model_named(self.model),
            self.gpus,
            self.workload,
            self.gpu,
            self.efficiency,
            generator_dtype=self.generator_dtype,
            top=self.top,
            extras=plan.Extras(self.delta, self.failures, self.trainer_replicas),
        )
        print("\n".join(lines))


class Simulate(BaseModel):
    """Simulate llamarl's sync, async and stream schedules: explain the paper's table, predict a
    measured run in other settings, plan a cluster."""

    # A plain model, not BaseSettings: flags only, nothing read from environment variables.
    model_config = SettingsConfigDict(
        cli_prog_name="simulate.py", cli_kebab_case=True, cli_implicit_flags=True
    )

    paper: CliSubCommand[PaperCommand] = Field(description="the paper's table under stated assumptions")
    others: CliSubCommand[OthersCommand] = Field(
        description="out of sample: other systems' published speed-ups, assumptions frozen"
    )
    from_run: CliSubCommand[FromRunCommand] = Field(
        description="a measured run in other modes and rank counts"
    )
    plan: CliSubCommand[PlanCommand] = Field(description="the split and schedule for a cluster")

    def cli_cmd(self) -> None:
        CliApp.run_subcommand(self)


def main(argv: list[str] | None = None) -> int:
    """Runs the command line; a bad flag value or a run folder that cannot be read ends in a short
    message and exit status 2."""
    try:
        CliApp.run(Simulate, cli_args=sys.argv[1:] if argv is None else argv)
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
        print(f"simulate.py: error: {problems}", file=sys.stderr)
        return 2
    except (RunReadError, ValueError) as e:
        print(f"simulate.py: error: {e}", file=sys.stderr)
        return 2
    return 0
