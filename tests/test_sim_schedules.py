"""The simulator (llamarl-sim, which installs without the controller) held to the controller it models:
its lock-step plans against llamarl.control.run.schedule's, its stream admission rule against the
controller's, its buffer against the controller's RolloutBuffer; and the schedules in closed-form cases."""

from __future__ import annotations

import itertools

import pytest
import torch

from llamarl.control.run.channels.buffer import RolloutBuffer
from llamarl.control.run.schedule import lockstep_ticks, stream_admits
from llamarl.exec.types import RolloutBatch
from llamarl.sim import schedules as simulated
from llamarl.sim.events import Deadlock, Join, Simulation, WaitUntil, Work
from llamarl.sim.schedules import (
    TRAINER,
    ConstantCosts,
    Placement,
    StreamSettings,
    lockstep_plan,
    simulate_lockstep,
    simulate_stream,
)

# The simulator names the trainer's sync "sync_weights" like the plan; spans of zero length included.
PHASES_BY_ROLE = {
    "trainer": {"move_rollouts", "sync_weights", "train", "checkpoint"},
    "generator": {"move_rollouts", "sync_weights", "generate", "checkpoint"},
}


@pytest.mark.parametrize("mode,lag", [("sync", 0), ("async", 1)])
@pytest.mark.parametrize("steps", [1, 2, 3, 5])
def test_plan_matches_the_controllers_schedule(mode: str, lag: int, steps: int) -> None:
    ours = [[(name, batch) for name, batch in tick] for tick in lockstep_plan(lag, steps)]
    theirs = [[(p.name, p.batch) for p in tick.phases] for tick in lockstep_ticks(mode, steps)]
    assert ours == theirs


def _expected_order(mode: str, steps: int, role: str) -> list[tuple[str, int | None]]:
    """What one rank does, in order, according to the controller's plan (batch tags on data phases)."""
    out = []
    for tick in lockstep_ticks(mode, steps):
        for phase in tick.phases:
            if phase.name in PHASES_BY_ROLE[role]:
                out.append((phase.name, phase.batch if phase.name != "checkpoint" else None))
    return out


@pytest.mark.parametrize("mode,lag", [("sync", 0), ("async", 1)])
@pytest.mark.parametrize(
    "costs",
    [
        ConstantCosts(generate=10, train=6, weight_sync=1, move=0.5),
        ConstantCosts(generate=3, train=9, weight_sync=0, move=0),
        ConstantCosts(generate=5, train=5, weight_sync=2, move=1),
    ],
)
def test_simulated_event_order_follows_the_plan(mode: str, lag: int, costs: ConstantCosts) -> None:
    steps = 4
    result = simulate_lockstep(lag, steps, costs, Placement(generators=2))
    for actor, role in [(TRAINER, "trainer"), ("generator 0", "generator"), ("generator 1", "generator")]:
        spans = [s for s in result.spans if s.actor == actor and s.name != "score"]
        spans.sort(key=lambda s: (s.start, s.end))
        got = [(s.name, s.tag if s.name != "checkpoint" else None) for s in spans]
        assert got == _expected_order(mode, steps, role), actor


def test_async_overlaps_generation_with_training_and_sync_does_not() -> None:
    costs = ConstantCosts(generate=10, train=6, weight_sync=1, move=0.5)

    def windows(result, name):
        return {s.tag: (s.start, s.end) for s in result.spans if s.name == name and s.actor != TRAINER}

    sync = simulate_lockstep(0, 3, costs)
    trains = {s.tag: (s.start, s.end) for s in sync.spans if s.name == "train"}
    for batch, (start, _) in windows(sync, "generate").items():
        if batch > 0:
            assert start >= trains[batch - 1][1]  # waits for the previous step's training and sync
    asynchronous = simulate_lockstep(1, 3, costs)
    trains = {s.tag: (s.start, s.end) for s in asynchronous.spans if s.name == "train"}
    for batch, (start, end) in windows(asynchronous, "generate").items():
        if batch > 0:
            train_start, train_end = trains[batch - 1]
            assert start == pytest.approx(train_start) and train_end < end  # side by side


@pytest.mark.parametrize(
    "gen,train,sync,move,score", [(10, 6, 1, 0.5, 0.5), (4, 4, 0, 0, 0), (2, 7, 3, 1, 0)]
)
def test_lockstep_closed_forms(gen: float, train: float, sync: float, move: float, score: float) -> None:
    costs = ConstantCosts(generate=gen, train=train, weight_sync=sync, move=move, score=score)
    assert simulate_lockstep(0, 5, costs).step_times == pytest.approx([gen + score + move + train + sync] * 4)
    expected_async = move + sync + max(gen + score, train)
    assert simulate_lockstep(1, 5, costs).step_times == pytest.approx([expected_async] * 4)
    # A deeper pipeline has the same steady tick (it only lets generators run further ahead).
    assert simulate_lockstep(2, 6, costs).step_times[2] == pytest.approx(expected_async)


def test_equal_phases_and_no_sync_overlap_halves_the_step() -> None:
    costs = ConstantCosts(generate=5, train=5)
    assert simulate_lockstep(0, 4, costs).step_s == pytest.approx(10)
    assert simulate_lockstep(1, 4, costs).step_s == pytest.approx(5)


def test_shared_cores_slow_concurrent_phases() -> None:
    # Two generators and a trainer, one thread each, on two cores: each runs at 2/3 speed.
    placement = Placement(generators=2, trainer_pool="host", generator_pool="host", pool_cores={"host": 2})
    result = simulate_lockstep(1, 4, ConstantCosts(generate=10, train=10), placement)
    assert result.step_times[1] == pytest.approx(15)
    # Taking turns (sync), nothing runs at once beyond the two generators: 10 + 10.
    assert simulate_lockstep(0, 3, ConstantCosts(generate=10, train=10), placement).step_s == pytest.approx(
        20
    )


@pytest.mark.parametrize("in_flight", [True, False])
def test_stream_generator_bound(in_flight: bool) -> None:
    # The generator is the bottleneck: each request takes gen + score, plus the sync it joins.
    costs = ConstantCosts(generate=10, train=4, weight_sync=1, score=0.5)
    settings = StreamSettings(groups_per_step=4, groups_per_request=4, max_policy_lag=1, in_flight=in_flight)
    result = simulate_stream(6, costs, settings)
    assert result.step_times[-1] == pytest.approx(10 + 0.5 + 1)
    assert result.dropped_stale == 0


def test_stream_trainer_bound_admission_holds_the_generator_back_so_nothing_goes_stale() -> None:
    # A fast generator, a slow trainer: admission control (as the controller's) starts a request only
    # if its groups will be trained within max_policy_lag, so none is dropped.
    costs = ConstantCosts(generate=1, train=10, weight_sync=1)
    settings = StreamSettings(groups_per_step=4, groups_per_request=2, buffer_groups=8, max_policy_lag=1)
    result = simulate_stream(8, costs, settings)
    assert result.step_times[-1] == pytest.approx(10 + 1)
    assert all(lag <= 1 for step in result.lags for lag in step)
    assert result.dropped_stale == 0
    produced = [s for s in result.spans if s.name == "generate" and s.end <= result.train_ends[0]]
    # Before the first step ends, with version 0: the groups of steps 0 and 1 only (step 2's would
    # train at version 2, two versions off).
    assert len(produced) * 2 == 4 + 4


def test_stream_without_admission_runs_ahead_and_drops_what_went_stale() -> None:
    # The same run without admission control: the generator runs ahead until the buffer and its outbox
    # are full; the trainer never trains on groups more than max_policy_lag versions old (it drops them).
    costs = ConstantCosts(generate=1, train=10, weight_sync=1)
    settings = StreamSettings(
        groups_per_step=4, groups_per_request=2, buffer_groups=8, max_policy_lag=1, admission=False
    )
    result = simulate_stream(8, costs, settings)
    assert result.step_times[-1] == pytest.approx(10 + 1)
    assert all(lag <= 1 for step in result.lags for lag in step)
    assert result.dropped_stale > 0
    produced = [s for s in result.spans if s.name == "generate" and s.end <= result.train_ends[0]]
    # Before the first step ends: the step taken, a full buffer, a full outbox (2 batches of 2
    # groups) and the request that then blocks; back-pressure stops the generator there.
    assert len(produced) * 2 == 4 + 8 + 2 * 2 + 2


def test_stream_waits_for_a_full_step_and_takes_in_order() -> None:
    costs = ConstantCosts(generate=2, train=1)
    settings = StreamSettings(groups_per_step=4, groups_per_request=1, max_policy_lag=3)
    result = simulate_stream(3, costs, settings)
    assert result.train_ends[0] == pytest.approx(4 * 2 + 1)  # four requests, then training
    assert [len(step) for step in result.lags] == [4, 4, 4]


def test_engine_processor_sharing_and_joins() -> None:
    sim = Simulation({"cpu": 1})

    def worker(seconds: float):
        yield Work("w", seconds)
        yield Join("j", frozenset({"a", "b"}), 2.0, "j")

    sim.add("a", worker(1.0), "cpu")
    sim.add("b", worker(3.0), "cpu")
    spans = sim.run()
    ends = {(s.actor, s.name): s.end for s in spans}
    assert ends[("a", "w")] == pytest.approx(2.0)  # half speed while both run
    assert ends[("b", "w")] == pytest.approx(4.0)  # then alone
    assert ends[("a", "j")] == pytest.approx(6.0) and ends[("b", "j")] == pytest.approx(6.0)


def test_engine_reports_a_deadlock() -> None:
    sim = Simulation()

    def stuck():
        yield WaitUntil(lambda: False)

    sim.add("x", stuck())
    with pytest.raises(Deadlock, match="stuck"):
        sim.run()


def _group(version: int, ticket: int) -> RolloutBatch:
    """One group of two one-token samples sampled by `version`; its prompt position is its ticket."""
    ones = torch.ones(2, 1, dtype=torch.int64)
    return RolloutBatch(
        prompt_ids_BP=ones,
        prompt_mask_BP=ones,
        completion_ids_BC=ones,
        completion_mask_BC=ones,
        behavior_logprobs_BC=torch.zeros(2, 1),
        rewards_B=torch.zeros(2),
        policy_version_B=torch.full((2,), version, dtype=torch.int64),
        group_size=2,
        prompt_position_B=torch.full((2,), ticket, dtype=torch.int64),
    )


@pytest.mark.parametrize(
    "gen,train,lag,admission,generators",
    [
        (1.0, 10.0, 1, False, 1),
        (1.0, 10.0, 2, False, 1),
        (3.0, 2.0, 1, False, 1),
        (2.0, 5.0, 0, False, 1),
        (3.0, 2.0, 1, True, 2),
        (2.0, 5.0, 0, True, 3),
    ],
)
def test_stream_buffer_matches_the_controllers_rollout_buffer(
    gen: float, train: float, lag: int, admission: bool, generators: int
) -> None:
    # Replays the simulated puts into llamarl.control.run.channels.buffer.RolloutBuffer: every take gets the
    # same groups (in ticket order, within the staleness bound) and drops the same stale ones (without
    # admission control some go stale, in arrival order; with it groups go in admission order).
    settings = StreamSettings(
        groups_per_step=4, groups_per_request=2, buffer_groups=8, max_policy_lag=lag, admission=admission
    )
    placement = Placement(generators=generators)
    result = simulate_stream(
        8, ConstantCosts(generate=gen, train=train, weight_sync=0.5), settings, placement
    )
    buffer = RolloutBuffer(
        capacity_groups=10_000,
        max_policy_lag=lag,
        ticket_of=(lambda position: position) if admission else None,
    )
    takes = 0
    for op in result.buffer_ops:
        if op[0] == "put":
            buffer.put(_group(op[2], op[1]), timeout_s=1)
            continue
        _, version, taken, dropped = op
        before = buffer.counts.dropped_stale
        batch = buffer.take(len(taken), current_version=version, timeout_s=1)
        assert batch.policy_version_B[::2].tolist() == list(taken)
        assert buffer.counts.dropped_stale - before == dropped
        takes += 1
    if admission:
        assert result.dropped_stale == 0
    assert takes == 8


def test_the_simulators_admission_rule_is_the_controllers() -> None:
    # Every case of a small grid gives the same answer: the simulator cannot import the controller's
    # rule, so this is what keeps the two one rule.
    names = ("taken", "ahead", "groups", "version", "prompts_per_step", "max_policy_lag", "steps")
    grid = itertools.product(range(3), range(9), (1, 2, 4), range(-1, 4), (1, 2, 4), (0, 1, 2), (1, 3, 6))
    for values in grid:
        case = dict(zip(names, values, strict=True))
        assert simulated.stream_admits(**case) == stream_admits(**case), case
