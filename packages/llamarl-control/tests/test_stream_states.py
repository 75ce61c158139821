"""Stream mode's state machines on their own, in one process with no process group: a generator's request
(`WorkInHand`), the first trainer rank's intake (`TrainerIntake`), the pauses (`PauseServer`,
`PausePlan`): their legal and illegal moves, what a checkpoint keeps of them and reads back (today's
states, and those of checkpoints written before the states had a format), and the order of pauses."""

from __future__ import annotations

import io
import queue
import threading
import time

import pytest
import torch
from memory_store import DictStore

from llamarl.control.run.channels.buffer import RolloutBuffer
from llamarl.control.run.channels.rollouts import CHECKPOINT_MARKER, PendingBatch
from llamarl.control.run.channels.stream import Pause, PauseOrderError, PauseServer, StreamControl
from llamarl.control.run.rank_states import (
    GeneratorRankState,
    RewardRankState,
    TrainerRankState,
    TrainerRunState,
)
from llamarl.control.run.schedule import PausePlan
from llamarl.control.run.stream_requests import RequestState, RequestStateError, WorkInHand
from llamarl.control.run.trainer_intake import IntakeStage, IntakeStageError, TrainerIntake
from llamarl.control.run.trainer_loop import GeneratorStats
from llamarl.exec.types import GenerationPaused, RolloutBatch

pytestmark = pytest.mark.timeout(60)

G = 2  # samples per prompt
WAIT_S = 10.0


def group_batch(*positions: int, version: int = 0, tokens: int = 2) -> RolloutBatch:
    """One group of G samples per prompt position (its prompt token and rewards are the position)."""
    B = len(positions) * G
    ids = torch.tensor(positions).repeat_interleave(G)
    return RolloutBatch(
        prompt_ids_BP=ids[:, None],
        prompt_mask_BP=torch.ones(B, 1, dtype=torch.int64),
        completion_ids_BC=ids[:, None].repeat(1, tokens),
        completion_mask_BC=torch.ones(B, tokens, dtype=torch.int64),
        behavior_logprobs_BC=torch.full((B, tokens), -0.5),
        rewards_B=ids.float(),
        policy_version_B=torch.full((B,), version),
        group_size=G,
        prompt_position_B=ids.clone(),
    )


def paused_after(positions: list[int], tokens: int) -> GenerationPaused:
    """A request of `positions` stopped after `tokens` tokens, every completion unfinished."""
    partial = group_batch(*positions, tokens=tokens)
    return GenerationPaused(partial, torch.zeros(partial.num_sequences, dtype=torch.bool))


def saved_and_loaded(state):
    """`state` through torch.save and torch.load, as a checkpoint's rank{r}.pt takes it."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


# --------------------------------------------------------------------------------------------------
# a generator's request


def test_a_request_goes_admitted_sampling_paused_sampling_made_delivered():
    work = WorkInHand()
    request = work.admit([4, 5], [10, 11])
    assert (request.number, request.state, request.tickets) == (0, RequestState.ADMITTED, {4: 10, 5: 11})
    work.start()
    work.pause(paused_after([4, 5], tokens=1))
    assert request.state is RequestState.PAUSED and request.in_flight is not None
    in_flight = request.in_flight
    work.start()
    work.pause(paused_after([4, 5], tokens=2))  # a continued request extends its own completions
    assert request.in_flight is in_flight
    work.start()
    made = PendingBatch(group_batch(4, 5), {"generate_s": 1.0})
    work.make(made, dropped=[])
    assert request.state is RequestState.MADE
    assert work.deliver() is made
    assert request.state is RequestState.DELIVERED and work.request is None
    assert work.admit([6, 7], [12, 13]).number == 1 and work.requests == 2


def test_a_request_refuses_every_move_its_state_does_not_lead_to():
    work = WorkInHand()
    with pytest.raises(RequestStateError, match="no request in hand"):
        work.start()
    work.admit([0], [0])
    with pytest.raises(RequestStateError, match="cannot admit a request while request 0 is admitted"):
        work.admit([1], [1])
    for move in (
        lambda: work.pause(paused_after([0], 1)),
        lambda: work.make(PendingBatch(group_batch(0), {}), dropped=[]),
        lambda: work.filter(dropped=[0]),
        work.deliver,
        work.interrupt,
    ):
        with pytest.raises(RequestStateError, match="the request is admitted"):
            move()
    work.start()
    with pytest.raises(RequestStateError, match="the request is sampling; expected one that is made"):
        work.deliver()
    with pytest.raises(RequestStateError, match="checkpoints are taken paused"):
        work.state()
    with pytest.raises(RequestStateError, match="sampling; expected one that is admitted or paused"):
        work.start()
    assert work.request is not None and work.request.state is RequestState.SAMPLING  # nothing moved


def test_an_interrupted_request_goes_back_to_its_last_pause():
    work = WorkInHand()
    request = work.admit([0, 1], [0, 1])
    work.start()
    work.interrupt()  # an engine died before the first pause: nothing kept, sampled again from scratch
    assert request.state is RequestState.ADMITTED and request.in_flight is None
    work.start()
    work.pause(paused_after([0, 1], tokens=2))
    work.start()
    work.interrupt()  # after a pause: goes on from the completions kept there
    assert request.state is RequestState.PAUSED and request.in_flight is not None


def test_dropped_groups_leave_their_tickets_to_the_next_request_in_order():
    work = WorkInHand()
    work.admit([0, 1, 2], [5, 3, 4])
    work.start()
    work.make(PendingBatch(group_batch(1), {}), dropped=[2, 0])  # prompts 0 and 2: flat groups
    assert work.request is not None and work.request.tickets == {1: 3}  # the kept group's ticket only
    work.deliver()
    work.admit([7], [6])
    work.start()
    work.filter(dropped=[7])  # every group flat: nothing delivered, the request is gone
    assert work.request is None
    assert work.take_held() == [4, 5, 6] and work.held == []


@pytest.mark.parametrize("where", ["admitted", "paused", "made"])
def test_the_work_in_hand_at_a_checkpoint_reads_back_and_goes_on(where):
    work = WorkInHand()
    request = work.admit([8, 9], [20, 21])
    if where != "admitted":
        work.start()
        work.pause(paused_after([8, 9], tokens=3))
    if where == "made":
        work.start()
        work.make(PendingBatch(group_batch(8, 9, version=2), {"reward_mean": 0.5}), dropped=[])
    work.held = [17]
    restored = WorkInHand()
    restored.restore(saved_and_loaded(work.state()))
    again = restored.request
    assert again is not None and (again.number, again.state.value) == (0, where)
    assert (again.positions, again.tickets, restored.requests, restored.held) == (
        [8, 9],
        {8: 20, 9: 21},
        1,
        [17],
    )
    if where == "paused":
        assert again.in_flight is not None and torch.equal(
            again.in_flight.as_batch().completion_ids_BC, request.in_flight.as_batch().completion_ids_BC
        )
    if where == "made":
        delivered = restored.deliver()
        assert delivered.metrics == {"reward_mean": 0.5}
        assert torch.equal(delivered.batch.policy_version_B, torch.full((4,), 2))
    else:
        restored.start()  # it goes on where it stopped
        assert again.state is RequestState.SAMPLING


def test_a_checkpoint_cannot_hold_a_request_that_is_no_longer_in_hand():
    state = {"request": None, "requests": 1, "held": []}
    work = WorkInHand()
    work.admit([0], [0])
    state["request"] = {**work.request.as_dict(), "state": "delivered"}
    with pytest.raises(RequestStateError, match="cannot hold a request that is delivered"):
        WorkInHand().restore(state)


# --------------------------------------------------------------------------------------------------
# pauses


def test_pauses_are_served_once_each_in_the_order_requested():
    served: list[Pause] = []
    server = PauseServer(served.append)
    control = StreamControl(DictStore())
    assert not server.pending(control)
    control.request_pause("eval", 2)
    control.request_pause("checkpoint", 2)
    assert server.pending(control)
    server.serve_requested(control)
    assert [(p.number, p.kind, p.policy_version) for p in served] == [(1, "eval", 2), (2, "checkpoint", 2)]
    server.serve_requested(control)  # nothing new: nothing served twice
    assert len(served) == 2 and not server.pending(control)
    with pytest.raises(PauseOrderError, match=r"pause 2 .* after pause 2"):
        server.serve(Pause(2, "checkpoint", 2))
    with pytest.raises(PauseOrderError, match=r"pause 4 .* after pause 2"):
        server.serve(Pause(4, "eval", 3))
    server.serve_next("checkpoint", 3)  # planned here (the trainer ranks other than the first)
    assert served[-1] == Pause(3, "checkpoint", 3)


def test_the_pause_plan_evaluates_before_it_checkpoints_and_not_after_the_last_step():
    plan = PausePlan(eval_every=2, checkpoint_every=3, steps=6)
    assert [plan.stream_pauses(v) for v in range(1, 7)] == [
        [], ["eval"], ["checkpoint"], ["eval"], [], ["checkpoint"]
    ]  # fmt: skip
    assert PausePlan(eval_every=1, checkpoint_every=1, steps=2).stream_pauses(1) == ["eval", "checkpoint"]
    assert PausePlan(eval_every=0, checkpoint_every=0, steps=2).stream_pauses(1) == []


# --------------------------------------------------------------------------------------------------
# the first trainer rank's intake


class FakeGenerator:
    """One generator's stream, played by a thread into a queue: the batches given, a marker for every
    checkpoint pause the trainer requests, and the end of its stream once the trainer stops."""

    def __init__(self, control: StreamControl, batches: list[RolloutBatch]) -> None:
        self.control = control
        self.wire: queue.Queue = queue.Queue()
        for batch in batches:
            self.wire.put((batch, {}))
        self.thread = threading.Thread(target=self._serve_pauses, daemon=True)
        self.thread.start()

    def _serve_pauses(self) -> None:
        served = 0
        while not self.control.stopped():
            while served < self.control.pauses_requested():
                served += 1
                if self.control.pause(served).kind == "checkpoint":
                    self.wire.put((CHECKPOINT_MARKER, {}))
            time.sleep(0.01)
        self.wire.put((None, {}))

    def receive(self, generator: int):
        return self.wire.get(timeout=WAIT_S)


def an_intake(control: StreamControl, generator: FakeGenerator, *, on_pause=None, plan=None) -> TrainerIntake:
    return TrainerIntake(
        control=control,
        buffer=RolloutBuffer(capacity_groups=8, max_policy_lag=1, ticket_of=control.ticket_of),
        generators=[1],
        receive=generator.receive,
        stats=GeneratorStats(),
        send_weights=lambda: None,
        pauses=PauseServer(on_pause or (lambda pause: None)),
        plan=plan or PausePlan(eval_every=0, checkpoint_every=0, steps=4),
        prompts_per_step=2,
        timeout_s=WAIT_S,
    )


def admitted(control: StreamControl, *positions: int) -> None:
    """Admission as a generator goes through it: tickets in order, labelled by prompt position."""
    first = control.admit(len(positions), version=0, prompts_per_step=2, max_policy_lag=8)
    assert first is not None
    control.label({p: first + i for i, p in enumerate(positions)})


def test_the_intake_moves_ready_open_paused_closed_ended_and_refuses_the_rest():
    control = StreamControl(DictStore())
    admitted(control, 0, 1)
    generator = FakeGenerator(control, [group_batch(0, 1)])
    stages: list[IntakeStage] = []
    intake = an_intake(
        control,
        generator,
        on_pause=lambda pause: stages.append(intake.stage),
        plan=PausePlan(eval_every=1, checkpoint_every=0, steps=4),
    )
    with pytest.raises(IntakeStageError, match="the intake is ready; expected open"):
        intake.take(0)
    with pytest.raises(IntakeStageError, match="the intake is ready; expected paused"):
        intake.state()
    intake.open()
    with pytest.raises(IntakeStageError, match="the intake is open; expected ready"):
        intake.restore({})
    part, whole = intake.take(0)
    assert part is whole and [int(p) for p in whole.prompt_position_B[::G]] == [0, 1]
    intake.pause_after(1)
    assert stages == [IntakeStage.PAUSED] and intake.stage is IntakeStage.OPEN
    with pytest.raises(IntakeStageError, match="expected ended"):
        intake.final_counts()
    intake.close()
    assert intake.stage is IntakeStage.ENDED
    assert intake.final_counts() == {
        "dropped_stale_groups": 0,
        "received_groups": 2,
        "unused_groups": 0,
        "discarded_groups": 0,
        "dropped_stale_frac": 0.0,
    }
    with pytest.raises(IntakeStageError, match="the intake is ended; expected open"):
        intake.take(1)


def test_an_intake_checkpoint_waits_for_every_marker_and_reads_back_into_a_fresh_intake():
    """Pauses after version 1: the evaluation, then the checkpoint once the generator's marker came
    (every group it sent is in the buffer). What the checkpoint kept, put back into a fresh intake on a
    fresh store, takes the same groups in the same order."""
    control = StreamControl(DictStore())
    admitted(control, 0, 1, 2, 3)
    generator = FakeGenerator(control, [group_batch(0, 1), group_batch(2, 3)])
    pauses: list[tuple[str, int, int]] = []
    saved: list[dict] = []

    def on_pause(pause: Pause) -> None:
        pauses.append((pause.kind, pause.policy_version, intake.buffer.counts.markers))
        if pause.kind == "checkpoint":
            saved.append(saved_and_loaded(intake.state()))

    intake = an_intake(control, generator, on_pause=on_pause, plan=PausePlan(1, 1, steps=4))
    intake.open()
    intake.take(0)
    intake.pause_after(1)
    assert pauses == [("eval", 1, 0), ("checkpoint", 1, 1)]
    ahead = intake.take(1)[1]
    intake.close()

    fresh = StreamControl(DictStore())
    restored = an_intake(fresh, FakeGenerator(fresh, []))
    restored.restore(saved[0])
    assert fresh.counts() == saved[0]["admission"] and restored.buffer.counts.markers == 1
    restored.open()
    again = restored.take(1)[1]
    assert torch.equal(again.prompt_position_B, ahead.prompt_position_B)
    assert restored.buffer.counts.taken == 4  # the counts go on from the checkpoint's
    restored.close()


# --------------------------------------------------------------------------------------------------
# checkpoints: today's states, and those written before the states had a format


def test_a_batch_and_a_pending_batch_read_back_from_a_checkpoint_bitwise():
    pending = PendingBatch(group_batch(3, 4, version=5), {"generate_s": 2.5})
    back = PendingBatch.from_state(saved_and_loaded(pending.state()))
    assert back.metrics == pending.metrics and back.batch.group_size == G
    for name, tensor in pending.batch.tensors().items():
        assert (
            torch.equal(back.batch.tensors()[name], tensor)
            and back.batch.tensors()[name].dtype == tensor.dtype
        )


def old_batch(*positions: int, version: int = 0) -> tuple[dict, int]:
    """A batch as format-1 checkpoints kept it: (tensors, group_size)."""
    return group_batch(*positions, version=version).tensors(), G


def test_a_format1_generator_state_reads_as_the_work_in_hand_it_was():
    totals = {"groups_total": 4.0}
    common = {"prompt_position": 6, "generator_totals": totals, "samples_bytes": 99, "rng": {}}
    tensors, _ = old_batch(4, 5)
    made = {
        **common,
        "pending": None,
        "stream": {"request": None, "in_flight": None, "undelivered": (tensors, G, {"reward_mean": 1.0}),
                   "requests": 3, "tickets": {4: 8, 5: 9}, "held": [7]},
    }  # fmt: skip
    paused = paused_after([4, 5], tokens=2)
    in_flight = {"batch": paused.partial.tensors(), "group_size": G, "finished_B": paused.finished_B}
    mid_request = {
        **common,
        "pending": (*old_batch(0, 1), {"generate_s": 1.0}),  # async's batch made, not yet sent
        "stream": {"request": [4, 5], "in_flight": in_flight, "undelivered": None, "requests": 3},
    }  # (no tickets: a checkpoint from before admission tickets)

    state = GeneratorRankState.from_dict(made)
    assert (state.prompt_position, state.generator_totals, state.samples_bytes) == (6, totals, 99)
    work = WorkInHand()
    work.restore(state.work)
    assert work.request is not None and work.request.state is RequestState.MADE
    assert (work.request.number, work.request.positions, work.request.tickets) == (2, [4, 5], {4: 8, 5: 9})
    assert work.held == [7] and work.deliver().metrics == {"reward_mean": 1.0}

    state = GeneratorRankState.from_dict(mid_request)
    assert state.pending is not None and state.pending.metrics == {"generate_s": 1.0}
    work = WorkInHand()
    work.restore(state.work)
    assert work.request is not None and work.request.state is RequestState.PAUSED
    assert work.request.tickets == {} and work.request.in_flight is not None
    assert work.request.in_flight.num_tokens == 2 * 4  # 4 completions of 2 tokens, kept
    # Today's state reads back as itself.
    assert GeneratorRankState.from_dict({**state.as_dict(), "format": 2}).work == state.work


def old_counts(received: int, taken: int, markers: int = 0) -> dict[str, int]:
    return {"received": received, "dropped_stale": 0, "taken": taken, "markers": markers}


def old_stream(buffer: dict, admitted: int, consumed: int, taken: int) -> dict:
    """A first trainer rank's format-1 state: its buffer and the admission counters under "stream"."""
    counters = (StreamControl._ADMITTED, StreamControl._CONSUMED, StreamControl._TAKEN)
    admission = dict(zip(counters, (admitted, consumed, taken), strict=True))
    return {"stream": {"buffer": buffer, "admission": admission, "discarded": 0}, "rng": {}}


def test_a_format1_trainer_and_reward_state_read_back():
    groups = [(3, *old_batch(6)), (4, *old_batch(7))]
    old_buffer = {"groups": groups, "next": 3, "arrivals": 5, "gone": [], "counts": old_counts(5, 3, 2)}
    old = old_stream(old_buffer, admitted=6, consumed=3, taken=1)
    admission = old["stream"]["admission"]
    trainer = TrainerRankState.from_dict(old)
    control = StreamControl(DictStore())
    intake = an_intake(control, FakeGenerator(control, []))
    intake.restore(trainer.intake)
    assert len(intake.buffer) == 2 and intake.buffer.ticket_of is not None and control.counts() == admission
    intake.open()
    assert [int(p) for p in intake.take(1)[1].prompt_position_B[::G]] == [6, 7]
    intake.close()
    assert TrainerRankState.from_dict({"rng": {}}).intake is None  # a lock-step run's trainer rank

    scored = [(2, *old_batch(1), {"reward_mean": 0.0})]
    totals = {2: {"reward_model_s_total": 1.5}}
    reward = RewardRankState.from_dict({"pending": scored, "totals": totals, "scores_bytes": 10})
    assert list(reward.scored) == [2] and reward.totals == {2: {"reward_model_s_total": 1.5}}
    assert RewardRankState.from_dict({**reward.as_dict(), "format": 2}).scores_bytes == 10


def test_a_buffer_saved_before_tickets_goes_on_in_arrival_order():
    control = StreamControl(DictStore())
    old_buffer = {"groups": [old_batch(9), old_batch(8)], "counts": old_counts(2, 0)}
    trainer = TrainerRankState.from_dict(old_stream(old_buffer, admitted=2, consumed=0, taken=0))
    intake = an_intake(control, FakeGenerator(control, []))
    intake.restore(trainer.intake)
    assert intake.buffer.ticket_of is None  # no labels to read: the groups' order is their arrival's
    intake.open()
    assert [int(p) for p in intake.take(0)[1].prompt_position_B[::G]] == [9, 8]
    intake.close()


def test_a_run_state_from_before_the_trained_groups_log_reads_with_an_empty_one():
    run_state = {
        "step_records": [{"loss": 1.0}], "evaluations": [], "last_sync_s": 0.5, "generator_stats": {},
        "wandb_id": None, "metrics_bytes": 12, "tick": 2, "policy_version": 2, "settings": {},
    }  # fmt: skip
    saved = TrainerRunState.from_dict(run_state)
    assert saved.trained_bytes == 0 and saved.metrics_bytes == 12
    assert TrainerRunState.from_dict({**run_state, "trained_bytes": 7}).trained_bytes == 7


def test_a_steps_reward_failures_count_the_reward_models_as_well_as_the_reward_functions():
    from llamarl.control.run.channels.rollouts import GENERATOR_TOTALS

    stats = GeneratorStats()
    totals = dict.fromkeys(GENERATOR_TOTALS, 0.0) | {"alive_s_total": 1.0}
    stats.update(1, totals)
    stats.step()
    stats.update(1, totals | {"reward_failures_total": 2.0, "reward_model_failures_total": 3.0})
    stats.update(2, totals | {"reward_model_failures_total": 1.0})
    assert stats.step()["reward_failures"] == 6.0
