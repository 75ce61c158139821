"""The stream buffer on its own: order, exact drop counts, back-pressure, close, and a take that times out
half way losing nothing. Every wait here ends on an event (a put, a take, a close) or on the buffer's own
deadline, never on a sleep."""

from __future__ import annotations

import itertools
import threading
import time
import types

import pytest
import torch

from llamarl.control.run import legacy_checkpoints
from llamarl.control.run.channels import buffer as buffer_module
from llamarl.control.run.channels.buffer import BufferClosed, BufferTimeout, RolloutBuffer
from llamarl.exec.types import RolloutBatch

pytestmark = pytest.mark.timeout(60)

GROUP_SIZE = 2
WAIT_S = 30.0  # a deadline that only a hang reaches


def groups(*ids: int, versions: tuple[int, ...] | None = None, lengths: tuple[int, ...] | None = None):
    """One batch of len(ids) groups of GROUP_SIZE samples; group g's rewards are ids[g] (its tag), its
    prompt position too, its samples were sampled by versions[g] (default 0) and have lengths[g]
    completion tokens (default 2)."""
    versions = versions or (0,) * len(ids)
    lengths = lengths or (2,) * len(ids)
    rows = len(ids) * GROUP_SIZE
    width = max(lengths)
    mask = torch.zeros(rows, width, dtype=torch.int64)
    for g, length in enumerate(lengths):
        mask[g * GROUP_SIZE : (g + 1) * GROUP_SIZE, :length] = 1
    return RolloutBatch(
        prompt_ids_BP=torch.ones(rows, 3, dtype=torch.int64),
        prompt_mask_BP=torch.ones(rows, 3, dtype=torch.int64),
        completion_ids_BC=torch.arange(rows * width).reshape(rows, width) * mask,
        completion_mask_BC=mask,
        behavior_logprobs_BC=-mask.float(),
        rewards_B=torch.tensor(ids, dtype=torch.float32).repeat_interleave(GROUP_SIZE),
        policy_version_B=torch.tensor(versions, dtype=torch.int64).repeat_interleave(GROUP_SIZE),
        group_size=GROUP_SIZE,
        prompt_position_B=torch.tensor(ids, dtype=torch.int64).repeat_interleave(GROUP_SIZE),
    )


def tags(batch: RolloutBatch) -> list[int]:
    """The tag of each group of `batch`, in order."""
    return [int(r) for r in batch.rewards_B[::GROUP_SIZE]]


def run_in_thread(fn) -> tuple[threading.Thread, dict]:
    """Starts `fn()` in a thread; the dict gets its "result" or its "error"."""
    out: dict = {}

    def target() -> None:
        try:
            out["result"] = fn()
        except BaseException as e:
            out["error"] = e

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, out


def test_a_buffer_needs_room_for_a_group_and_a_lag_of_zero_or_more():
    for capacity, lag in ((0, 1), (1, -1)):
        with pytest.raises(ValueError) as error:
            RolloutBuffer(capacity_groups=capacity, max_policy_lag=lag)
        assert str(error.value) == "capacity_groups must be >= 1 and max_policy_lag >= 0"
    on_policy = RolloutBuffer(capacity_groups=1, max_policy_lag=0)  # only the current version's samples
    on_policy.put(groups(1, versions=(2,)), timeout_s=WAIT_S)
    assert tags(on_policy.take(1, current_version=2, timeout_s=WAIT_S)) == [1]


def test_groups_come_out_whole_in_the_order_they_went_in():
    buffer = RolloutBuffer(capacity_groups=8, max_policy_lag=1)
    buffer.put(groups(1, 2, 3, lengths=(1, 3, 2)), timeout_s=WAIT_S)
    buffer.put(groups(4), timeout_s=WAIT_S)
    assert len(buffer) == 4
    first = buffer.take(2, current_version=0, timeout_s=WAIT_S)
    assert tags(first) == [1, 2] and first.num_sequences == 2 * GROUP_SIZE
    assert first.group_size == GROUP_SIZE
    # Each group keeps its own samples: completions of lengths 1 and 3, padded to the longest.
    assert first.completion_mask_BC.sum(1).tolist() == [1, 1, 3, 3]
    assert tags(buffer.take(2, current_version=0, timeout_s=WAIT_S)) == [3, 4]
    assert len(buffer) == 0
    assert (buffer.counts.received, buffer.counts.taken, buffer.counts.dropped_stale) == (4, 4, 0)


def test_stale_groups_are_dropped_and_counted_exactly_at_take_time():
    buffer = RolloutBuffer(capacity_groups=8, max_policy_lag=1)
    # Lags at version 4: 4, 3, 2, 1, 0, 3. Lag 1 (= max_policy_lag) is still trained on.
    buffer.put(groups(10, 11, 12, 13, 14, 15, versions=(0, 1, 2, 3, 4, 1)), timeout_s=WAIT_S)
    taken = buffer.take(2, current_version=4, timeout_s=WAIT_S)
    assert tags(taken) == [13, 14]
    assert buffer.counts.dropped_stale == 3  # 10, 11, 12: only those on the way to the two taken
    assert len(buffer) == 1 and buffer.counts.taken == 2
    # The group left behind is judged when a take reaches it: stale at version 4, fresh enough at 2.
    buffer.put(groups(16, versions=(4,)), timeout_s=WAIT_S)
    assert tags(buffer.take(1, current_version=4, timeout_s=WAIT_S)) == [16]
    assert buffer.counts.dropped_stale == 4 and buffer.counts.received == 7 and buffer.counts.taken == 3


def test_a_group_is_as_old_as_its_oldest_sample():
    buffer = RolloutBuffer(capacity_groups=4, max_policy_lag=1)
    mixed = groups(20, 21, versions=(3, 3))
    mixed.policy_version_B[1] = 1  # one sample of group 20 began two versions earlier
    buffer.put(mixed, timeout_s=WAIT_S)
    assert tags(buffer.take(1, current_version=3, timeout_s=WAIT_S)) == [21]
    assert buffer.counts.dropped_stale == 1


def test_a_full_buffer_holds_a_put_back_until_a_take_makes_room():
    buffer = RolloutBuffer(capacity_groups=2, max_policy_lag=1)
    buffer.put(groups(1, 2), timeout_s=WAIT_S)
    # Back-pressure with a deadline: the put gives up, adding nothing.
    with pytest.raises(BufferTimeout) as error:
        buffer.put(groups(3), timeout_s=0.05)
    assert str(error.value) == "waited too long for room in the rollout buffer (the trainer stopped taking)"
    assert len(buffer) == 2 and buffer.counts.received == 2
    # A put that waits goes in as soon as a take makes room, behind the groups that were there.
    thread, out = run_in_thread(lambda: buffer.put(groups(4), timeout_s=WAIT_S))
    assert tags(buffer.take(1, current_version=0, timeout_s=WAIT_S)) == [1]
    thread.join(WAIT_S)
    assert not thread.is_alive() and "error" not in out, out
    assert tags(buffer.take(2, current_version=0, timeout_s=WAIT_S)) == [2, 4]


def test_a_take_waits_for_the_groups_it_needs():
    buffer = RolloutBuffer(capacity_groups=4, max_policy_lag=1)
    buffer.put(groups(1), timeout_s=WAIT_S)
    thread, out = run_in_thread(lambda: buffer.take(2, current_version=0, timeout_s=WAIT_S))
    buffer.put(groups(2), timeout_s=WAIT_S)
    thread.join(WAIT_S)
    assert not thread.is_alive() and tags(out["result"]) == [1, 2]


def test_a_take_that_times_out_half_way_gives_its_groups_back_in_order():
    buffer = RolloutBuffer(capacity_groups=4, max_policy_lag=1)
    buffer.put(groups(1, 2, versions=(0, 1)), timeout_s=WAIT_S)
    with pytest.raises(BufferTimeout) as error:
        buffer.take(3, current_version=1, timeout_s=0.05)
    assert str(error.value) == "waited too long for 1 more groups from the generators"
    assert len(buffer) == 2 and buffer.counts.taken == 0
    assert tags(buffer.take(2, current_version=1, timeout_s=WAIT_S)) == [1, 2]


def test_a_take_loses_nothing_when_its_deadline_passes_between_two_clock_readings(monkeypatch):
    """The deadline may pass after the take decided to wait on: the groups it holds must still go back.
    A clock that advances 0.6 s at every reading makes that happen at the first wait, every time."""
    readings = iter(0.6 * i for i in range(1000))
    monkeypatch.setattr(buffer_module, "time", types.SimpleNamespace(monotonic=lambda: next(readings)))
    buffer = RolloutBuffer(capacity_groups=4, max_policy_lag=1)
    buffer.put(groups(1), timeout_s=WAIT_S)
    with pytest.raises(BufferTimeout):
        buffer.take(2, current_version=0, timeout_s=1.0)
    assert len(buffer) == 1 and buffer.counts.taken == 0


def test_close_wakes_every_waiter_and_later_waits_fail_at_once():
    empty = RolloutBuffer(capacity_groups=1, max_policy_lag=1)
    full = RolloutBuffer(capacity_groups=1, max_policy_lag=1)
    full.put(groups(1), timeout_s=WAIT_S)
    taker, took = run_in_thread(lambda: empty.take(1, current_version=0, timeout_s=WAIT_S))
    putter, put = run_in_thread(lambda: full.put(groups(2), timeout_s=WAIT_S))
    # Whether each thread waits already or is about to: it ends with BufferClosed, not at its deadline.
    empty.close()
    full.close()
    for thread in (taker, putter):
        thread.join(WAIT_S)
        assert not thread.is_alive()
    assert isinstance(took.get("error"), BufferClosed), took
    assert str(took["error"]) == "rollout buffer closed while waiting for 1 more groups from the generators"
    assert isinstance(put.get("error"), BufferClosed), put
    assert len(full) == 1 and full.counts.received == 1
    # After the close, a put or take that would wait fails at once; a take that got part of what it
    # asked for gives it back.
    with pytest.raises(BufferClosed) as error:
        full.put(groups(3), timeout_s=WAIT_S)
    assert str(error.value) == (
        "rollout buffer closed while waiting for room in the rollout buffer (the trainer stopped taking)"
    )
    with pytest.raises(BufferClosed) as error:
        full.take(2, current_version=0, timeout_s=WAIT_S)
    assert str(error.value) == "rollout buffer closed while waiting for 1 more groups from the generators"
    assert len(full) == 1 and full.counts.taken == 0


def test_waiting_for_markers_calls_on_wait_until_the_markers_arrive():
    """A checkpoint's wait for the generators' markers calls `on_wait` too, without the lock: a generator
    whose engine was replaced asks for weights there before it can pause and send its marker (without
    it, the trainer waited for the marker and the generator for the weights). The second call here
    stands for that generator: its marker arrives once it was answered."""
    buffer = RolloutBuffer(capacity_groups=2, max_policy_lag=1)
    calls: list[int] = []

    def on_wait() -> None:
        calls.append(buffer.counts.markers)  # takes the lock: it would deadlock were the lock held
        if len(calls) == 2:
            buffer.note_marker()

    buffer.wait_for_markers(1, timeout_s=5.0, on_wait=on_wait, poll_s=0.05)
    assert calls == [0, 0] and buffer.counts.markers == 1
    buffer.wait_for_markers(1, timeout_s=5.0, on_wait=on_wait, poll_s=0.05)  # already there: no call
    assert calls == [0, 0]
    with pytest.raises(BufferTimeout):
        buffer.wait_for_markers(2, timeout_s=0.2, on_wait=on_wait, poll_s=0.05)


def test_a_waiting_take_calls_on_wait_every_poll_and_takes_what_it_puts():
    """While a take waits it calls `on_wait` every `poll_s`, without the buffer's lock: there the trainer
    answers requests for weights. Here the third call delivers the group the take waits for."""
    buffer = RolloutBuffer(capacity_groups=2, max_policy_lag=1)
    calls: list[int] = []
    times: list[float] = []

    def on_wait() -> None:
        calls.append(len(buffer))  # takes the lock: it would deadlock were the lock held
        times.append(time.monotonic())
        if len(calls) == 3:
            buffer.put(groups(7), timeout_s=WAIT_S)

    # The deadline is far beyond three polls: a take that waited for it instead would time out first.
    taken = buffer.take(1, current_version=0, timeout_s=5.0, on_wait=on_wait, poll_s=0.05)
    assert tags(taken) == [7] and calls == [0, 0, 0]
    # Between two calls the take waited a poll (a lower bound: no machine is too fast for it).
    assert all(later - earlier >= 0.04 for earlier, later in itertools.pairwise(times)), times


def test_a_checkpointed_buffer_restores_its_groups_counts_and_group_size():
    buffer = RolloutBuffer(capacity_groups=4, max_policy_lag=1)
    buffer.put(groups(1, 2), timeout_s=WAIT_S)
    buffer.note_marker()
    state = buffer.state()
    restored = RolloutBuffer(capacity_groups=4, max_policy_lag=1)
    restored.restore(state)
    assert len(restored) == 2 and restored.counts.markers == 1
    assert vars(restored.counts) == vars(buffer.counts)
    taken = restored.take(2, current_version=0, timeout_s=WAIT_S)
    assert (
        tags(taken) == [1, 2]
        and taken.group_size == buffer.take(2, current_version=0, timeout_s=WAIT_S).group_size
    )


def test_a_holding_buffer_takes_puts_beyond_its_capacity_without_waiting():
    # While the run pauses (a checkpoint) the generators' sends must never wait on the trainer.
    buffer = RolloutBuffer(capacity_groups=1, max_policy_lag=1)
    buffer.hold(True)
    buffer.put(groups(1, 2, 3), timeout_s=0.01)
    assert len(buffer) == 3
    buffer.hold(False)
    with pytest.raises(BufferTimeout):
        buffer.put(groups(4), timeout_s=0.05)


def in_admission_order(capacity_groups: int = 4, max_policy_lag: int = 1) -> RolloutBuffer:
    """A buffer whose groups' admission tickets are their tags minus 10 (tag 10 was admitted first)."""
    return RolloutBuffer(
        capacity_groups=capacity_groups,
        max_policy_lag=max_policy_lag,
        ticket_of=lambda position: position - 10,
    )


def test_groups_are_taken_in_admission_order_and_one_admitted_earlier_is_waited_for():
    """With two generators a group admitted early can arrive after later ones; admission control's
    bound assumes the trainer takes them in admission order, so a take waits for it."""
    buffer = in_admission_order()
    buffer.put(groups(12, 11), timeout_s=WAIT_S)  # arrived first, admitted second and third
    thread, out = run_in_thread(lambda: buffer.take(2, current_version=0, timeout_s=WAIT_S))
    thread.join(0.2)
    assert thread.is_alive(), "took groups past one admitted before them"
    buffer.put(groups(10), timeout_s=WAIT_S)
    thread.join(WAIT_S)
    assert not thread.is_alive() and tags(out["result"]) == [10, 11]
    assert tags(buffer.take(1, current_version=0, timeout_s=WAIT_S)) == [12]
    with pytest.raises(
        BufferTimeout, match=r"1 more groups from the generators \(the next one admitted: ticket 3\)"
    ):
        buffer.take(1, current_version=0, timeout_s=0.05)


def test_a_full_buffer_holds_puts_back_only_while_the_trainer_can_take_from_it():
    # While the group taken next is missing, the trainer takes nothing, so room would never come: the
    # missing group may be the one put, or come from a generator whose send waits behind it.
    buffer = in_admission_order(capacity_groups=2)
    buffer.put(groups(11, 12), timeout_s=WAIT_S)
    buffer.put(groups(13), timeout_s=0.05)  # 10 is missing: no wait
    buffer.put(groups(10), timeout_s=0.05)
    assert len(buffer) == 4
    with pytest.raises(BufferTimeout):  # 10 is there: a full buffer holds the next put back again
        buffer.put(groups(14), timeout_s=0.05)
    assert tags(buffer.take(3, current_version=0, timeout_s=WAIT_S)) == [10, 11, 12]


def test_a_failed_take_keeps_what_it_dropped_dropped_and_a_checkpoint_of_it_resumes_in_order():
    buffer = in_admission_order(max_policy_lag=0)
    buffer.put(groups(10, 11, 13, versions=(0, 1, 1)), timeout_s=WAIT_S)  # 12 still sampling
    with pytest.raises(BufferTimeout):
        buffer.take(3, current_version=1, timeout_s=0.05)  # drops 10 (stale), holds 11, waits for 12
    assert len(buffer) == 2 and (buffer.counts.dropped_stale, buffer.counts.taken) == (1, 0)
    restored = in_admission_order(max_policy_lag=0)
    restored.restore(buffer.state())
    for each in (buffer, restored):
        each.put(groups(12, versions=(1,)), timeout_s=WAIT_S)
        assert tags(each.take(3, current_version=1, timeout_s=WAIT_S)) == [11, 12, 13]
        assert (each.counts.dropped_stale, each.counts.taken) == (1, 3)


def test_a_checkpoint_from_before_tickets_restores_its_groups_in_arrival_order():
    old_state = {
        "groups": [(groups(7).tensors(), GROUP_SIZE), (groups(8).tensors(), GROUP_SIZE)],
        "counts": {"received": 5, "dropped_stale": 1, "taken": 2, "markers": 1},
    }
    buffer = RolloutBuffer(capacity_groups=4, max_policy_lag=1)
    buffer.restore(legacy_checkpoints.buffer_state(old_state))
    buffer.put(groups(9), timeout_s=WAIT_S)
    assert tags(buffer.take(3, current_version=0, timeout_s=WAIT_S)) == [7, 8, 9]
