"""The lock-step schedules as data: which phases each tick runs, in order, and on which batch.

A tick is one round in which every rank runs the same phases (SPMD); each role does its own part of
a phase (the trainer receives where the generator sends). Writing the plan down as data keeps the
gating in one place that tests can read without starting a process:

- `sync`: tick t generates batch t with policy version t, moves it, trains on it (-> version t + 1),
  then sends the new weights: the trainer always learns from its own samples (lag 0).
- `async` (the paper's): tick t moves batch t - 1 and sends weights of version t - 1, then generates
  batch t on the generators while the trainer trains on batch t - 1 (sampled by version t - 2): one
  policy version off, and the two halves run at the same time on their own ranks.

`stream` mode has no ticks: generators sample back to back (`GeneratorLoop.stream`) into the first
trainer rank's `RolloutBuffer`, from which the trainer takes its batches (`TrainerLoop.stream`); a
request starts only when `stream_admits` says its groups will still be fresh enough to train on, and
every rank pauses after the steps that `PausePlan` names (an evaluation, a checkpoint).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

PhaseName = Literal["generate", "move_rollouts", "sync_weights", "train", "checkpoint"]
PauseKind = Literal["eval", "checkpoint"]
SideName = Literal["trainers", "generators"]
_WORKS: dict[str, SideName] = {"generate": "generators", "train": "trainers"}


@dataclass(frozen=True)
class Phase:
    """One phase of a tick. `batch` names the batch it handles (the tick that generated it)."""

    name: PhaseName
    batch: int | None = None

    def __str__(self) -> str:
        return self.name if self.batch is None else f"{self.name}({self.batch})"


@dataclass(frozen=True)
class Tick:
    """The phases of one tick, in order; `policy_version` is the trainer's version after the tick."""

    index: int
    phases: tuple[Phase, ...]
    policy_version: int

    def working_sides(self) -> frozenset[SideName]:
        """The sides that compute in this tick (moving batches and weights aside): an async run's first
        tick only generates, its last only trains."""
        return frozenset(_WORKS[p.name] for p in self.phases if p.name in _WORKS)


def lockstep_ticks(mode: str, steps: int, start_tick: int = 0) -> Iterator[Tick]:
    """The ticks of a lock-step run of `steps` optimizer steps, from `start_tick` (a resumed run).

    Every tick that trains ends with a checkpoint phase (the controller writes one when due).
    """
    if mode == "sync":
        for t in range(start_tick, steps):
            phases = (
                Phase("generate", t),
                Phase("move_rollouts", t),
                Phase("train", t),
                Phase("sync_weights"),
                Phase("checkpoint"),
            )
            yield Tick(t, phases, policy_version=t + 1)
    elif mode == "async":
        for t in range(start_tick, steps + 1):
            phases: list[Phase] = []
            if t >= 1:
                phases.append(Phase("move_rollouts", t - 1))
            if t >= 2:
                phases.append(Phase("sync_weights"))
            if t < steps:
                phases.append(Phase("generate", t))
            if t >= 1:
                phases += [Phase("train", t - 1), Phase("checkpoint")]
            if t == steps:
                phases.append(Phase("sync_weights"))  # the generators serve the final policy
            yield Tick(t, tuple(phases), policy_version=t)
    else:
        raise ValueError(f"no lock-step schedule for mode {mode!r}")


def stream_admits(
    *,
    taken: int,
    ahead: int,
    groups: int,
    version: int,
    prompts_per_step: int,
    max_policy_lag: int,
    steps: int | None = None,
) -> bool:
    """Stream mode's admission rule (AReaL's bound on the versions in flight): may a generator holding
    policy `version` start sampling `groups` more groups?

    The trainer takes groups in the order they were admitted (`RolloutBuffer` by admission ticket),
    `prompts_per_step` a step, and the batch it takes
    next trains at version `taken` (the batches taken so far). Behind `ahead` groups admitted and not
    yet consumed, the last new group trains at `taken + (ahead + groups - 1) // prompts_per_step`; it
    is admitted if that stays within `max_policy_lag` of `version` (the weights of its first token),
    and, in a run of `steps` steps, if that step is one of them: a group past the last step would never
    be trained, and sampling it would only slow the last steps down. (A group dropped as stale counts
    as consumed: its replacement is admitted.) The controller (`StreamControl.admit`) and the simulator
    both decide by it.
    """
    trained_at = taken + (ahead + groups - 1) // prompts_per_step
    return trained_at - version <= max_policy_lag and (steps is None or trained_at < steps)


@dataclass(frozen=True)
class PausePlan:
    """When a run evaluates and checkpoints: after the step that made policy version v when v is a
    multiple of `eval_every` (`checkpoint_every`); 0 never. The same versions in every mode."""

    eval_every: int
    checkpoint_every: int
    steps: int

    def checkpoint_due(self, policy_version: int) -> bool:
        """Whether a checkpoint is taken once `policy_version` is made."""
        return bool(self.checkpoint_every) and policy_version % self.checkpoint_every == 0

    def eval_due_in_stream(self, policy_version: int) -> bool:
        """Whether stream mode evaluates once `policy_version` is made (not after the last step: the
        final evaluation follows anyway)."""
        every = self.eval_every
        return bool(every) and policy_version % every == 0 and policy_version < self.steps

    def stream_pauses(self, policy_version: int) -> list[PauseKind]:
        """Stream mode: the pauses after the step that made `policy_version`, in order (an evaluation
        first, so that a checkpoint taken there holds its result)."""
        due: list[PauseKind] = ["eval"] if self.eval_due_in_stream(policy_version) else []
        return due + (["checkpoint"] if self.checkpoint_due(policy_version) else [])
