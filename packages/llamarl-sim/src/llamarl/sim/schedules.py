"""The three schedules as discrete-event simulations over executors and their phase costs.

- `lockstep_plan(lag, steps)`: the phases of every tick of a lock-step run whose trainer learns from
  batches `lag` policy versions old. Lag 0 is `sync` and lag 1 is `async`, tick for tick the plans of
  `llamarl.control.run.schedule.lockstep_ticks` (the tests hold the two together); a larger lag lets the
  generators run further ahead.
- `simulate_lockstep`: every rank walks the plan in order (SPMD): generators generate and score,
  the trainer trains, and both meet in each rollout move and weight sync.
- `simulate_stream`: generators sample request after request into the trainer's bounded buffer (they
  block when it and their outbox are full) and take new weights between requests, or between
  decoding steps with in-flight updates; the trainer takes the oldest groups within the staleness
  bound (dropping older ones), trains, and syncs weights with every generator
  (`llamarl.control.run.generator_loop`, `llamarl.control.run.trainer_loop`,
  `llamarl.control.run.channels.buffer`).

Costs come from a `PhaseCosts` (a physics model of a GPU cluster or what a measured run took); where
executors share cores (`Placement.pool_cores`) concurrent phases slow each other down.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from llamarl.sim.events import Join, Process, Simulation, Span, WaitUntil, Work

TRAINER = "trainer"


def stream_admits(
    *,
    taken: int,
    ahead: int,
    groups: int,
    version: int,
    prompts_per_step: int,
    max_policy_lag: int,
    steps: int,
) -> bool:
    """Stream mode's admission rule, as the controller decides it (`llamarl.control.run.schedule.
    stream_admits`; the simulator installs without the controller, and the workspace tests hold the two
    to the same answers): `groups` more groups behind `ahead` admitted ones are admitted when the last
    of them trains within `max_policy_lag` of `version` and within the run's `steps`."""
    trained_at = taken + (ahead + groups - 1) // prompts_per_step
    return trained_at - version <= max_policy_lag and trained_at < steps


PlanPhase = tuple[str, int | None]  # (phase name, batch it handles)


class PhaseCosts(Protocol):
    """Seconds of each phase, alone on its executor's devices (before any sharing of cores)."""

    def generate_s(self, batch: int, generator: int) -> float: ...

    def score_s(self, batch: int, generator: int) -> float: ...

    def train_s(self, batch: int) -> float: ...

    def weight_sync_s(self) -> float: ...

    def move_s(self) -> float: ...


@dataclass(frozen=True)
class ConstantCosts:
    """The same phase times every step (closed-form checks and the cluster model)."""

    generate: float
    train: float
    weight_sync: float = 0.0
    move: float = 0.0
    score: float = 0.0

    def generate_s(self, batch: int, generator: int) -> float:
        return self.generate

    def score_s(self, batch: int, generator: int) -> float:
        return self.score

    def train_s(self, batch: int) -> float:
        return self.train

    def weight_sync_s(self) -> float:
        return self.weight_sync

    def move_s(self) -> float:
        return self.move


@dataclass(frozen=True)
class Placement:
    """Which pool of cores each executor runs on and how many threads it wants.

    A pool absent from `pool_cores` (or a None pool) is a set of devices of its own: no sharing.
    """

    generators: int = 1
    trainer_pool: str | None = None
    generator_pool: str | None = None
    pool_cores: dict[str, float] = field(default_factory=dict)
    trainer_threads: float = 1.0
    generator_threads: float = 1.0

    @property
    def generator_names(self) -> list[str]:
        return [f"generator {g}" for g in range(self.generators)]

    @property
    def actors(self) -> frozenset[str]:
        return frozenset([TRAINER, *self.generator_names])


@dataclass
class ScheduleResult:
    """What a simulated run did: its spans, step times and (stream) staleness."""

    mode: str
    spans: list[Span]
    train_ends: list[float]
    lags: list[list[int]] = field(default_factory=list)  # per step: each group's policy lag
    dropped_stale: int = 0
    # Stream: the buffer's operations in order: ("put", version) for a group put, ("take", trainer
    # version, versions taken, groups dropped) when a take completes.
    buffer_ops: list[tuple] = field(default_factory=list)

    @property
    def step_times(self) -> list[float]:
        """Time between consecutive ends of training (the run's `time/step_s`), from step 2 on."""
        return [b - a for a, b in zip(self.train_ends, self.train_ends[1:], strict=False)]

    @property
    def step_s(self) -> float:
        """Mean step time over steps after the first, as `summary.json`'s `step_time_s`."""
        times = self.step_times
        return sum(times) / len(times) if times else (self.train_ends[-1] if self.train_ends else 0.0)

    @property
    def steady_step_s(self) -> float:
        """The last step's time: the steady state once the pipeline has filled."""
        times = self.step_times
        return times[-1] if times else self.step_s


def lockstep_plan(lag: int, steps: int) -> list[list[PlanPhase]]:
    """The phases of each tick of a lock-step run with policy lag `lag` (0: sync, 1: async).

    Tick t generates batch t (when t < steps); with lag >= 1 it first moves batch t - lag and sends the
    weights (from tick lag + 1 on, when there are new ones), then trains on batch t - lag while the
    generators generate. A last sync leaves the generators with the final policy.
    """
    if lag < 0:
        raise ValueError("lag must be 0 or more")
    ticks: list[list[PlanPhase]] = []
    if lag == 0:
        for t in range(steps):
            ticks.append(
                [
                    ("generate", t),
                    ("move_rollouts", t),
                    ("train", t),
                    ("sync_weights", None),
                    ("checkpoint", None),
                ]
            )
        return ticks
    for t in range(steps + lag):
        phases: list[PlanPhase] = []
        if t >= lag:
            phases.append(("move_rollouts", t - lag))
        if t >= lag + 1:
            phases.append(("sync_weights", None))
        if t < steps:
            phases.append(("generate", t))
        if t >= lag:
            phases += [("train", t - lag), ("checkpoint", None)]
        if t == steps + lag - 1:
            phases.append(("sync_weights", None))
        ticks.append(phases)
    return ticks


def simulate_lockstep(
    lag: int, steps: int, costs: PhaseCosts, placement: Placement | None = None, checkpoint_s: float = 0.0
) -> ScheduleResult:
    """Simulates a lock-step run (lag 0: sync, 1: async, more: deeper pipelines)."""
    placement = placement or Placement()
    plan = lockstep_plan(lag, steps)
    everyone = placement.actors
    sim = Simulation(placement.pool_cores)

    def rank(name: str, generator: int | None) -> Process:
        for t, phases in enumerate(plan):
            for i, (phase, batch) in enumerate(phases):
                if phase == "generate" and generator is not None:
                    assert batch is not None
                    gen_s = costs.generate_s(batch, generator)
                    yield Work("generate", gen_s, batch, placement.generator_threads)
                    yield Work("score", costs.score_s(batch, generator), batch, placement.generator_threads)
                elif phase == "train" and generator is None:
                    assert batch is not None
                    yield Work("train", costs.train_s(batch), batch, placement.trainer_threads)
                elif phase == "move_rollouts":
                    yield Join(f"move:{t}", everyone, costs.move_s(), "move_rollouts", batch)
                elif phase == "sync_weights":
                    yield Join(f"sync:{t}:{i}", everyone, costs.weight_sync_s(), "sync_weights")
                elif phase == "checkpoint":
                    yield Work("checkpoint", checkpoint_s, t, 1.0)

    sim.add(TRAINER, rank(TRAINER, None), placement.trainer_pool)
    for g, name in enumerate(placement.generator_names):
        sim.add(name, rank(name, g), placement.generator_pool)
    spans = sim.run()
    train_ends = [s.end for s in spans if s.actor == TRAINER and s.name == "train"]
    mode = {0: "sync", 1: "async"}.get(lag, f"async lag {lag}")
    return ScheduleResult(mode, spans, sorted(train_ends), lags=[[lag]] * steps)


@dataclass(frozen=True)
class StreamSettings:
    """Stream mode's knobs (`RunConfig.stream_buffer_groups`, `max_policy_lag`, in-flight updates)."""

    groups_per_step: int  # prompts per optimizer step
    groups_per_request: int  # prompts one generator samples per request (its lock-step share)
    buffer_groups: int = 0  # the trainer's buffer capacity (0: two steps' worth)
    max_policy_lag: int = 1
    in_flight: bool = True  # generators take weights between decoding steps (HF); else between requests
    outbox_batches: int = 2  # a generator's finished batches on their way: one queued, one in delivery
    admission: bool = True  # a request starts only if its groups will be fresh enough (the controller's)

    @property
    def capacity(self) -> int:
        return self.buffer_groups or 2 * self.groups_per_step


def simulate_stream(
    steps: int, costs: PhaseCosts, settings: StreamSettings, placement: Placement | None = None
) -> ScheduleResult:
    """Simulates stream mode for `steps` optimizer steps."""
    placement = placement or Placement()
    everyone = placement.actors
    sim = Simulation(placement.pool_cores)
    # The policy version of each buffered group (its oldest token's), by its ticket: the order the
    # trainer takes groups in (admission's order, as `RolloutBuffer` with `ticket_of`; without
    # admission control, arrival's).
    buffer: dict[int, int] = {}
    outbox: dict[int, deque[list[tuple[int, int]]]] = {g: deque() for g in range(placement.generators)}
    # Admission control's counters, as `StreamControl` keeps them: groups admitted, groups consumed
    # (taken or dropped), batches taken.
    state = {
        "version": 0,
        "announced": 0,
        "stopped": False,
        "dropped": 0,
        "admitted": 0,
        "consumed": 0,
        "taken": 0,
        "arrivals": 0,  # tickets without admission control
        "next": 0,  # the ticket the trainer takes next
    }
    announced_version: dict[int, int] = {}
    lags: list[list[int]] = []
    buffer_ops: list[tuple] = []

    def sync_join(k: int) -> Join:
        return Join(f"sync:{k}", everyone, costs.weight_sync_s(), "weight_sync", k)

    def generator(g: int) -> Process:
        mine = {"taken": 0, "version": 0}

        def take_weights() -> Join | None:
            if state["announced"] > mine["taken"]:
                mine["taken"] = state["announced"]
                mine["version"] = announced_version[mine["taken"]]
                return sync_join(mine["taken"])
            return None

        def admitted() -> bool:
            return stream_admits(
                taken=state["taken"],
                ahead=state["admitted"] - state["consumed"],
                groups=settings.groups_per_request,
                version=mine["version"],
                prompts_per_step=settings.groups_per_step,
                max_policy_lag=settings.max_policy_lag,
                steps=steps,
            )

        request = 0
        while not state["stopped"]:
            join = take_weights()
            if join is not None:
                yield join
                continue
            if settings.admission and not admitted():
                # Held back until the trainer takes a batch or new weights come (which may admit it).
                yield WaitUntil(
                    lambda taken=state["taken"]: (
                        state["taken"] != taken or state["announced"] > mine["taken"] or state["stopped"]
                    )
                )
                continue
            first_ticket = state["admitted"]
            state["admitted"] += settings.groups_per_request
            first_version = mine["version"]
            poll: Callable[[], Join | None] | None = take_weights if settings.in_flight else None
            yield Work("generate", costs.generate_s(request, g), request, placement.generator_threads, poll)
            yield Work("score", costs.score_s(request, g), request, placement.generator_threads)
            request += 1
            while len(outbox[g]) >= settings.outbox_batches:  # back-pressure: take weights meanwhile
                yield WaitUntil(
                    lambda: (
                        len(outbox[g]) < settings.outbox_batches
                        or state["announced"] > mine["taken"]
                        or state["stopped"]
                    )
                )
                if state["stopped"]:
                    return
                join = take_weights()
                if join is not None:
                    yield join
            outbox[g].append([(first_ticket + i, first_version) for i in range(settings.groups_per_request)])

    def drain(g: int) -> Process:
        """The trainer-side thread that moves generator g's batches into the buffer, group by group."""
        while True:
            yield WaitUntil(lambda: bool(outbox[g]) or state["stopped"])
            if state["stopped"]:
                return
            yield Work("move_rollouts", costs.move_s(), None, 0.0)
            for admitted_ticket, group_version in outbox[g][0]:
                # A full buffer holds a group back only while the trainer can take from it, as in
                # `RolloutBuffer.put` (without admission control the group taken next is always there).
                yield WaitUntil(
                    lambda: len(buffer) < settings.capacity or state["next"] not in buffer or state["stopped"]
                )
                if state["stopped"]:
                    return
                ticket = admitted_ticket
                if not settings.admission:  # arrival order
                    ticket, state["arrivals"] = state["arrivals"], state["arrivals"] + 1
                buffer[ticket] = group_version
                buffer_ops.append(("put", ticket, group_version))
            outbox[g].popleft()

    def trainer() -> Process:
        for step in range(steps):
            taken: list[int] = []
            dropped = 0
            while len(taken) < settings.groups_per_step:
                yield WaitUntil(lambda: state["next"] in buffer, "rollouts", step)
                while state["next"] in buffer and len(taken) < settings.groups_per_step:
                    version = buffer.pop(state["next"])
                    state["next"] += 1
                    if state["version"] - version > settings.max_policy_lag:
                        dropped += 1
                    else:
                        taken.append(version)
            state["dropped"] += dropped
            state["taken"] += 1  # the batch first, then its groups: as `StreamControl.consumed`
            state["consumed"] += len(taken) + dropped
            buffer_ops.append(("take", state["version"], tuple(taken), dropped))
            lags.append([state["version"] - v for v in taken])
            yield Work("train", costs.train_s(step), step, placement.trainer_threads)
            state["version"] += 1
            state["announced"] += 1
            announced_version[state["announced"]] = state["version"]
            yield sync_join(state["announced"])
        state["stopped"] = True

    sim.add(TRAINER, trainer(), placement.trainer_pool)
    for g, name in enumerate(placement.generator_names):
        sim.add(name, generator(g), placement.generator_pool)
        sim.add(f"drain {g}", drain(g), None)
    spans = sim.run(main={TRAINER})
    train_ends = sorted(s.end for s in spans if s.actor == TRAINER and s.name == "train")
    return ScheduleResult(
        "stream", spans, train_ends, lags=lags, dropped_stale=state["dropped"], buffer_ops=buffer_ops
    )
