"""The schedules, run with fake executors in one process: the order of events of every mode.

The loops are the real `GeneratorLoop` and `TrainerLoop` (in stream mode driven by the real
`GeneratorStream` and `TrainerIntake`); only the model work is faked (a generator
that stamps versions, a trainer that counts steps, weights that are just a version number), so each
test asserts what a mode promises: which policy version sampled what the trainer learns from.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time

import pytest
import torch
from memory_store import DictStore

from llamarl.control.config import ScheduleConfig
from llamarl.control.outputs.timeline import Timeline
from llamarl.control.run.channels.buffer import RolloutBuffer
from llamarl.control.run.channels.stream import PauseServer, RolloutOutbox, StreamControl
from llamarl.control.run.generator_loop import GeneratorLoop
from llamarl.control.run.generator_stream import GeneratorStream
from llamarl.control.run.schedule import PausePlan, lockstep_ticks, stream_admits
from llamarl.control.run.trainer_intake import TrainerIntake
from llamarl.control.run.trainer_loop import PolicyLagError, TrainerLoop
from llamarl.control.tasks.prompts import PromptStream
from llamarl.exec.config import SamplingConfig
from llamarl.exec.types import GenerationPaused, PauseGeneration, RolloutBatch

pytestmark = pytest.mark.timeout(60)


class FakeGenerator:
    """Emits `steps` tokens per sequence; the token ids are the prompt's dataset index (so rewards can
    depend on it) and every token is stamped with the version held when it was drawn."""

    supports_in_flight_updates = True
    can_restart_engine = False

    def __init__(self, events: list[str], *, steps: int = 3, step_s: float = 0.0, link=None) -> None:
        self.policy_version = 0
        self.events = events
        self.steps = steps
        self.step_s = step_s
        self.link = link

    def receive_weights(self, timeout_s: float) -> int:
        self.policy_version = self.link.receive()
        return self.policy_version

    def mark_weights_lost(self) -> None:
        self.policy_version = None

    def serve_initial_weights(self) -> None:
        self.policy_version = 0

    def generate(
        self, prompts, *, samples_per_prompt, max_new_tokens, greedy=False, between_steps=None
    ) -> RolloutBatch:
        """Draws min(steps, max_new_tokens) tokens (a continued completion: what its budget allows); a
        `between_steps` that raises PauseGeneration stops it with what it drew (GenerationPaused)."""
        B = len(prompts) * samples_per_prompt
        versions: list[int] = []
        steps = min(self.steps, max_new_tokens)
        for step in range(steps):
            versions.append(self.policy_version)
            time.sleep(self.step_s)
            if between_steps is not None and step < steps - 1:
                try:
                    between_steps()
                except PauseGeneration:
                    raise GenerationPaused(
                        self._batch(prompts, samples_per_prompt, versions), torch.zeros(B, dtype=torch.bool)
                    ) from None
        self.events.append(f"generate {[p[0] for p in prompts]} v{versions[0]}")
        return self._batch(prompts, samples_per_prompt, versions)

    @staticmethod
    def _batch(prompts, samples_per_prompt, versions) -> RolloutBatch:
        B, C = len(prompts) * samples_per_prompt, len(versions)
        ids = torch.tensor([p[0] for p in prompts for _ in range(samples_per_prompt)])
        return RolloutBatch(
            prompt_ids_BP=ids[:, None],
            prompt_mask_BP=torch.ones(B, 1, dtype=torch.int64),
            completion_ids_BC=ids[:, None].repeat(1, C),
            completion_mask_BC=torch.ones(B, C, dtype=torch.int64),
            behavior_logprobs_BC=torch.zeros(B, C),
            rewards_B=torch.zeros(B),
            policy_version_B=torch.full((B,), versions[0]),
            token_version_BC=torch.tensor(versions, dtype=torch.int64).repeat(B, 1),
            group_size=samples_per_prompt,
        )


class FakeRewarder:
    """Reward = 1 for the first sample of a group whose prompt index is odd: even prompts' groups have
    equal rewards (zero variance), odd ones do not."""

    num_failures = 0

    def score(self, prompts: list, completions: list[str], rows: list[dict], *, progress=None) -> list[float]:
        return [
            float(int(c) % 2 == 1 and r["reference"] == "first")
            for c, r in zip(completions, rows, strict=True)
        ]


class FakeTrainer:
    def __init__(self, events: list[str], *, step_s: float = 0.0) -> None:
        self.policy_version = 0
        self.events = events
        self.step_s = step_s
        self.trained: list[RolloutBatch] = []

    def train_step(self, batch: RolloutBatch) -> dict[str, float]:
        time.sleep(self.step_s)
        self.events.append(f"train v{batch.policy_version_B.min().item()} -> v{self.policy_version + 1}")
        self.trained.append(batch)
        self.policy_version += 1
        return {"loss": 0.0}


class WeightLink:
    """Trainer -> generator weights as a version number, with the real handshake: the send returns
    only once the generator took it."""

    def __init__(self, events: list[str]) -> None:
        self.events = events
        self._to_generator: queue.Queue[int] = queue.Queue()
        self._ack: queue.Queue[None] = queue.Queue()
        self.threaded = False  # lock step in one thread: the receive follows the send

    def send(self, version: int) -> None:
        self.events.append(f"send weights v{version}")
        self._to_generator.put(version)
        if self.threaded:
            self._ack.get(timeout=10)

    def receive(self) -> int:
        version = self._to_generator.get(timeout=10)
        if self.threaded:
            self._ack.put(None)
        return version


class FakePrompts:
    """Prompt i is the token [i]; the first sample of each group decodes to its prompt index."""

    def encode(self, index: int) -> list[int]:
        return [index]

    def row(self, index: int) -> dict:
        return {"reference": "first"}

    def messages(self, index: int) -> list[dict]:
        return [{"role": "user", "content": f"q{index}"}]

    def question(self, index: int) -> str:
        return f"q{index}"

    def decode(self, batch: RolloutBatch) -> list[str]:
        return [
            str(int(row[0])) if j % batch.group_size == 0 else "0"
            for j, row in enumerate(batch.completion_ids_BC)
        ]


def make_loops(
    events: list[str],
    *,
    prompts_per_step: int = 2,
    max_policy_lag: int = 1,
    dynamic_sampling: bool = False,
    generator_step_s: float = 0.0,
    trainer_step_s: float = 0.0,
    max_rounds: int = 4,
) -> tuple[GeneratorLoop, TrainerLoop, WeightLink]:
    link = WeightLink(events)
    trainer = TrainerLoop(
        trainer=FakeTrainer(events, step_s=trainer_step_s),
        send_weights=link.send,
        max_policy_lag=max_policy_lag,
        timeline=Timeline(),
    )
    generator = GeneratorLoop(
        generator=FakeGenerator(events, step_s=generator_step_s, link=link),
        rewarder=FakeRewarder(),
        prompts=PromptStream(
            list(range(100)), prompts_per_step=prompts_per_step, generator_index=0, num_generators=1
        ),
        source=FakePrompts(),
        sampling=SamplingConfig(samples_per_prompt=2, max_new_tokens=3),
        schedule=ScheduleConfig(
            prompts_per_step=prompts_per_step,
            dynamic_sampling=dynamic_sampling,
            max_sampling_rounds=max_rounds,
        ),
        weights_timeout_s=10,
        timeline=Timeline(),
    )
    return generator, trainer, link


def run_lockstep(mode: str, steps: int, generator: GeneratorLoop, trainer: TrainerLoop) -> list[dict]:
    """Both loops of a lock-step run in one thread, phase by phase (what each side does on its ranks,
    with the channels replaced by handing the batch over)."""
    pending = received = None
    records = []
    for tick in lockstep_ticks(mode, steps):
        for phase in tick.phases:
            if phase.name == "generate":
                pending = generator.make_batch(tick.index)
            elif phase.name == "move_rollouts":
                trainer.generator_stats.update(0, pending.metrics)
                received, pending = pending.batch, None
            elif phase.name == "sync_weights":
                trainer.send_weights()
                generator.receive_weights()
            elif phase.name == "train":
                records.append(trainer.train(received))
    return records


def test_sync_plan_trains_each_batch_with_the_policy_that_sampled_it():
    events: list[str] = []
    generator, trainer, _ = make_loops(events)
    records = run_lockstep("sync", 3, generator, trainer)
    assert events == [
        "generate [0, 1] v0", "train v0 -> v1", "send weights v1",
        "generate [2, 3] v1", "train v1 -> v2", "send weights v2",
        "generate [4, 5] v2", "train v2 -> v3", "send weights v3",
    ]  # fmt: skip
    assert [r["policy/lag"] for r in records] == [0, 0, 0]
    assert all(r["staleness/lag_0_frac"] == 1.0 for r in records)


def test_async_plan_overlaps_generation_with_training_one_version_apart():
    events: list[str] = []
    generator, trainer, _ = make_loops(events)
    records = run_lockstep("async", 3, generator, trainer)
    # In a tick the generate and train phases run at the same time on their own ranks; in one thread
    # they run in plan order. Batch t is sampled by version t - 1 while version t is being trained.
    assert events == [
        "generate [0, 1] v0",
        "generate [2, 3] v0", "train v0 -> v1",
        "send weights v1", "generate [4, 5] v1", "train v0 -> v2",
        "send weights v2", "train v1 -> v3",
        "send weights v3",
    ]  # fmt: skip
    assert [r["policy/lag"] for r in records] == [0, 1, 1]
    assert records[1]["staleness/lag_1_frac"] == 1.0


def test_lockstep_plans_are_what_the_docstring_says():
    plans = {
        mode: [[str(p) for p in t.phases] for t in lockstep_ticks(mode, 2)] for mode in ("sync", "async")
    }
    assert plans["sync"] == [
        ["generate(0)", "move_rollouts(0)", "train(0)", "sync_weights", "checkpoint"],
        ["generate(1)", "move_rollouts(1)", "train(1)", "sync_weights", "checkpoint"],
    ]
    assert plans["async"] == [
        ["generate(0)"],
        ["move_rollouts(0)", "generate(1)", "train(0)", "checkpoint"],
        ["move_rollouts(1)", "sync_weights", "train(1)", "checkpoint", "sync_weights"],
    ]
    # A resumed run starts at its tick; the policy version after each tick is what checkpoints record.
    assert [(t.index, t.policy_version) for t in lockstep_ticks("async", 3, start_tick=2)] == [(2, 2), (3, 3)]
    assert [(t.index, t.policy_version) for t in lockstep_ticks("sync", 3)] == [(0, 1), (1, 2), (2, 3)]
    assert [(t.index, t.policy_version) for t in lockstep_ticks("sync", 3, start_tick=1)] == [(1, 2), (2, 3)]
    with pytest.raises(ValueError, match="stream"):
        list(lockstep_ticks("stream", 2))


def test_an_async_run_generates_alone_first_and_trains_alone_last():
    # (the ticks where the side at work borrows the waiting side's cores, llamarl.control.launch.threads)
    sides = [set(t.working_sides()) for t in lockstep_ticks("async", 3)]
    assert sides == [{"generators"}, {"generators", "trainers"}, {"generators", "trainers"}, {"trainers"}]
    assert all(t.working_sides() == {"generators", "trainers"} for t in lockstep_ticks("sync", 3))
    assert [set(t.working_sides()) for t in lockstep_ticks("async", 3, start_tick=3)] == [{"trainers"}]


def test_dynamic_sampling_refills_the_batch_with_groups_that_have_reward_variance():
    events: list[str] = []
    generator, trainer, _ = make_loops(events, dynamic_sampling=True)
    made = generator.make_batch(0)
    batch, metrics = made.batch, made.metrics
    # Even prompts' groups have equal rewards (dropped), odd ones' do not (kept); each further round
    # samples only as many prompts as the batch still lacks.
    assert events == ["generate [0, 1] v0", "generate [2] v0", "generate [3] v0"]
    assert batch.prompt_ids_BP[:, 0].tolist() == [1, 1, 3, 3]
    assert metrics["groups_total"] == 4 and metrics["filtered_total"] == 2
    trainer.generator_stats.update(0, metrics)
    record = trainer.train(batch)
    assert record["sampling/filtered_groups"] == 2 and record["sampling/groups"] == 4


def test_dynamic_sampling_gives_up_after_max_rounds_and_tops_up():
    events: list[str] = []
    generator, _, _ = make_loops(events, dynamic_sampling=True, prompts_per_step=1, max_rounds=2)
    batch = generator.make_batch(0).batch  # prompts 0 then 1: only prompt 1's group is kept
    assert batch.prompt_ids_BP[:, 0].tolist() == [1, 1]
    generator.prompts.position = 10  # now prompts 20 and 22: both even, so both groups are flat
    generator.prompts.order = [i * 2 for i in range(100)]
    made = generator.make_batch(1)
    batch, metrics = made.batch, made.metrics
    # Three flat groups were sampled in all (0, 20, 22); 20 tops the batch up and is trained on, so only
    # the other two count as filtered.
    assert batch.num_sequences == 2 and metrics["filtered_total"] == 2


def test_trainer_refuses_rollouts_older_than_the_lag_bound():
    events: list[str] = []
    _, trainer, _ = make_loops(events, max_policy_lag=1)
    old = FakeGenerator(events).generate([[0]], samples_per_prompt=2, max_new_tokens=3)
    trainer.trainer.policy_version = 2
    with pytest.raises(PolicyLagError, match="2 policy versions old"):
        trainer.train(old)
    assert trainer.trainer.trained == []  # nothing reached the loss


def run_stream(
    generator: GeneratorLoop,
    trainer: TrainerLoop,
    link: WeightLink,
    *,
    steps: int,
    buffer_groups: int,
    checkpoint_every: int = 0,
    on_checkpoint=None,
    restored: dict | None = None,
    first_step: int = 0,
    control: StreamControl | None = None,
    generators_done=contextlib.nullcontext,
):
    """Both loops of a stream run on their own threads, joined by a real intake (buffer and receiving
    thread) and outbox; returns (every step's record, the buffer, the intake).

    With `checkpoint_every` the trainer pauses the run after those steps as the trainer side does
    (markers first, the buffer holding what arrives) and calls `on_checkpoint(version, intake)` while
    the generator is paused too (its part, `on_checkpoint(version, None)`, runs first, in its own
    thread). `restored`: the intake's state of a checkpoint, put back before the stream starts.
    """
    link.threaded = True
    generator.schedule = generator.schedule.model_copy(update={"steps": steps})  # as the run's config says
    control = control or StreamControl(DictStore())
    paused = threading.Barrier(2, timeout=10)  # the generator stays paused while the trainer saves
    wire: queue.Queue = queue.Queue(maxsize=1)  # a send blocks until the trainer side receives

    def trainer_pause(pause) -> None:
        on_checkpoint(pause.policy_version, intake)
        paused.wait()

    intake = TrainerIntake(
        control=control,
        buffer=RolloutBuffer(
            capacity_groups=buffer_groups, max_policy_lag=trainer.max_policy_lag, ticket_of=control.ticket_of
        ),
        generators=[0],
        receive=lambda g: wire.get(timeout=10),
        stats=trainer.generator_stats,
        send_weights=trainer.send_weights,
        pauses=PauseServer(trainer_pause),
        plan=PausePlan(eval_every=0, checkpoint_every=checkpoint_every, steps=steps),
        prompts_per_step=2,
        timeout_s=10,
    )
    if restored is not None:
        intake.restore(restored)

    def generator_pause(pause) -> None:
        on_checkpoint(pause.policy_version, None)
        paused.wait()

    outbox = RolloutOutbox(lambda b, m: wire.put((b, m)), timeout_s=10)
    stream = GeneratorStream(generator, control, outbox, in_flight=True, on_pause=generator_pause)
    thread = threading.Thread(target=stream.run)
    thread.start()
    records: list[dict] = []
    trainer.on_step = lambda record, whole: records.append(record)
    trainer.generators_done = generators_done
    trainer.stream(intake, steps=steps, first_step=first_step)
    thread.join(10)
    assert not thread.is_alive()
    return records, intake.buffer, intake


def test_stream_admission_holds_a_fast_generator_back_so_no_group_goes_stale():
    events: list[str] = []
    # A fast generator and a slow trainer with a roomy buffer: without admission control groups would
    # wait in the buffer until too old (the generator used to run 3-4 steps ahead, half of it dropped).
    generator, trainer, link = make_loops(events, max_policy_lag=1, trainer_step_s=0.05)
    records, buffer, _ = run_stream(generator, trainer, link, steps=6, buffer_groups=8)
    trained = trainer.trainer.trained
    assert len(trained) == 6
    for step, batch in enumerate(trained):
        assert step - int(batch.token_version_BC.min()) <= 1  # trainer was at version `step`
    assert buffer.counts.dropped_stale == 0
    assert max(r["policy/lag"] for r in records) <= 1
    # Ahead of the trainer the generator only started what the lag bound lets it train on, and nothing
    # past the run's last step (one batch a request here).
    assert generator.work.requests == 6
    assert buffer.counts.received == 6 * 2 + len(buffer)
    assert generator.policy_version == 6  # took the final weights before stopping


def borrowing(events: list[str]):
    """A stand-in for `llamarl.control.launch.threads.borrowed_cores`: logs where it starts and ends."""

    @contextlib.contextmanager
    def borrowed():
        events.append("borrow")
        yield
        events.append("give back")

    return borrowed


def test_a_streams_first_request_alone_is_sampled_with_the_trainers_cores():
    # The trainer can only wait for a fresh stream's first batch: that request runs inside
    # `trainer_waiting` (where the generator side borrows the trainer's cores), no later one does.
    events: list[str] = []
    generator, trainer, link = make_loops(events, max_policy_lag=1)
    generator.trainer_waiting = borrowing(events)
    run_stream(generator, trainer, link, steps=3, buffer_groups=8)
    assert events[:3] == ["borrow", "generate [0, 1] v0", "give back"]
    assert events.count("borrow") == 1 and events.count("give back") == 1


def test_a_streams_last_step_trains_once_the_generators_are_done():
    # The last batch taken, admission lets no generator start anything more: the last step alone trains
    # inside `generators_done` (where the trainer side borrows the generators' cores).
    events: list[str] = []
    generator, trainer, link = make_loops(events, max_policy_lag=1)
    run_stream(generator, trainer, link, steps=3, buffer_groups=8, generators_done=borrowing(events))
    borrowed = events[events.index("borrow") : events.index("give back")]
    assert len(borrowed) == 2 and borrowed[1].startswith("train") and borrowed[1].endswith("-> v3")
    assert events.count("borrow") == 1
    assert generator.work.requests == 3  # nothing sampled past the last step


def test_admission_stops_at_the_runs_last_step():
    # Two groups a step, three steps: the groups of batch 2 are the last a generator may start.
    rule = dict(groups=2, version=2, prompts_per_step=2, max_policy_lag=1)
    assert stream_admits(taken=2, ahead=0, **rule, steps=3)
    assert not stream_admits(taken=2, ahead=2, **rule, steps=3)  # they would make a fourth batch
    assert stream_admits(taken=2, ahead=2, **rule)  # (a run without an end in sight)


class InterleavingStore(DictStore):
    """Runs `between` once, right after the first counter write of the trainer's `consumed`: a generator
    reading the counters while the trainer is half-way through updating them."""

    def __init__(self, between) -> None:
        super().__init__()
        self.between = between
        self.armed = False

    def add(self, key: str, amount: int) -> int:
        value = super().add(key, amount)
        if self.armed and amount > 0:
            self.armed = False
            self.between()
        return value


@pytest.mark.parametrize(("ahead", "version"), [(4, 5), (2, 5), (2, 4), (6, 6), (3, 5), (4, 6)])
def test_admission_read_in_the_middle_of_a_take_never_admits_a_group_that_would_go_stale(ahead, version):
    """A generator at `version` asks for 2 groups (2 prompts a step, lag bound 1) while the trainer
    records a take of 2 groups with `ahead` admitted and not yet consumed. Whatever it reads half-way,
    it may refuse what it could have had (it retries) but never admit a group trained past the bound."""
    decisions: list[bool] = []

    def generator_asks(control: StreamControl) -> bool:
        return control.admit(2, version=version, prompts_per_step=2, max_policy_lag=1)

    store = InterleavingStore(lambda: decisions.append(generator_asks(control) is not None))
    control = StreamControl(store)
    counts = {control._ADMITTED: 10 + ahead, control._CONSUMED: 10, control._TAKEN: 5}
    control.restore_counts(counts)
    store.armed = True
    control.consumed(2)  # the batch that trains version 5 taken
    assert len(decisions) == 1
    # Admitted half-way or not, the settled counters decide again (as if nothing had been admitted).
    control.restore_counts({**counts, control._CONSUMED: 12, control._TAKEN: 6})
    settled = generator_asks(control)
    # Settled: 5 + 1 batches taken, `ahead - 2` groups ahead; the last new group trains at this version.
    trained_at = 6 + (ahead - 2 + 2 - 1) // 2
    assert (settled is not None) == (trained_at - version <= 1)
    assert settled is None or settled == 10 + ahead  # its first ticket: the groups admitted before
    assert not decisions[0] or settled is not None, "admitted half-way a group the settled counters refuse"


def one_group(position: int, version: int) -> RolloutBatch:
    """A group of 2 samples of the prompt at `position`, sampled by `version`."""
    group = FakeGenerator._batch([[position]], 2, [version])
    group.prompt_position_B = torch.full((2,), position)
    return group


@pytest.mark.parametrize("in_admission_order", [True, False])
def test_a_group_admitted_first_and_finished_last_still_trains_within_the_bound(in_admission_order):
    """Two generators, one prompt a step, lag bound 1. Generator A is admitted first (prompt 0, version
    0: trained at version 0), then B (prompt 1: at version 1). B finishes first and is admitted again
    (prompt 2, version 1: at version 2) and finishes that too before A. Taken in arrival order, A's
    group would train at version 2 and be dropped as stale; taken in admission order (the tickets) the
    trainer waits for it and every group trains within the bound."""
    control = StreamControl(DictStore())
    buffer = RolloutBuffer(
        capacity_groups=4, max_policy_lag=1, ticket_of=control.ticket_of if in_admission_order else None
    )

    def admit(position: int, version: int) -> None:
        ticket = control.admit(1, version=version, prompts_per_step=1, max_policy_lag=1)
        assert ticket is not None
        control.label({position: ticket})

    trained: list[tuple[int, int]] = []  # (prompt, version trained at)

    def take(version: int) -> None:
        batch = buffer.take(1, current_version=version, timeout_s=10)
        control.consumed(1)
        trained.append((int(batch.prompt_position_B[0]), version))

    admit(0, version=0)  # A
    admit(1, version=0)  # B
    buffer.put(one_group(1, version=0), timeout_s=10)  # B's first group arrives
    trainer = threading.Thread(target=take, args=(0,))
    trainer.start()
    trainer.join(0.3)
    if in_admission_order:
        assert trainer.is_alive(), "took B's group before A's, admitted earlier"
        buffer.put(one_group(0, version=0), timeout_s=10)  # A's group arrives
        trainer.join(10)
        admit(2, version=1)
        buffer.put(one_group(2, version=1), timeout_s=10)
        take(1)
        take(2)
        assert trained == [(0, 0), (1, 1), (2, 2)] and buffer.counts.dropped_stale == 0
    else:
        trainer.join(10)
        admit(2, version=1)
        buffer.put(one_group(2, version=1), timeout_s=10)
        take(1)
        buffer.put(one_group(0, version=0), timeout_s=10)  # A's group, last
        buffer.put(one_group(3, version=2), timeout_s=10)
        take(2)
        assert trained == [(1, 0), (2, 1), (3, 2)] and buffer.counts.dropped_stale == 1


def test_the_buffer_drops_groups_older_than_the_lag_bound_and_counts_them():
    events: list[str] = []
    buffer = RolloutBuffer(capacity_groups=8, max_policy_lag=1)
    fake = FakeGenerator(events)
    for version in (0, 1, 2, 2):
        fake.policy_version = version
        buffer.put(fake.generate([[version]], samples_per_prompt=2, max_new_tokens=3), timeout_s=1)
    batch = buffer.take(2, current_version=3, timeout_s=1)  # version 0 and 1 are 3 and 2 steps old
    assert batch.policy_version_B.tolist() == [2, 2, 2, 2]
    assert (buffer.counts.dropped_stale, buffer.counts.taken) == (2, 2)


@pytest.mark.parametrize("all_flat", [False, True])
def test_stream_dynamic_sampling_samples_again_under_the_filtered_groups_tickets(all_flat):
    """Stream mode with dynamic sampling: a filtered group is never sent, so the trainer, taking groups
    in admission order, waits for its ticket; the generator's next request samples new prompts under
    that ticket. Even prompts' groups are flat (filtered): only odd ones train. With every prompt flat,
    after max_sampling_rounds the flat groups are sent after all (under their own tickets)."""
    events: list[str] = []
    generator, trainer, link = make_loops(events, max_policy_lag=1, dynamic_sampling=True, max_rounds=2)
    if all_flat:
        generator.prompts.order = [2 * i for i in range(100)]
    _, buffer, _ = run_stream(generator, trainer, link, steps=4, buffer_groups=4)
    trained = [int(p) for b in trainer.trainer.trained for p in b.prompt_ids_BP[::2, 0]]
    assert len(trained) == 4 * 2 and buffer.counts.dropped_stale == 0
    assert all(p % 2 == 0 for p in trained) if all_flat else all(p % 2 == 1 for p in trained), trained
    assert generator.totals["filtered_total"] >= (0 if all_flat else 4 * 2)  # as many even as odd


def test_stream_takes_weights_in_flight_and_stamps_every_token():
    events: list[str] = []
    # A slow generator (3 decoding steps of 50 ms) and a fast trainer: new weights land mid-sequence.
    generator, trainer, link = make_loops(events, max_policy_lag=2, generator_step_s=0.05)
    records, _, _ = run_stream(generator, trainer, link, steps=4, buffer_groups=4)
    mixed = [b for b in trainer.trainer.trained if b.token_version_BC.unique().numel() > 1]
    assert mixed, "no sequence took new weights in flight"
    for b in mixed:
        # Tokens are stamped in order, never going back, and the sequence's version is its oldest token's.
        assert (b.token_version_BC.diff(dim=1) >= 0).all()
        assert (b.policy_version_B == b.token_version_BC[:, 0]).all()
    assert sum(
        r["staleness/lag_0_frac"] + r["staleness/lag_1_frac"] + r["staleness/lag_2_frac"] for r in records
    ) == (pytest.approx(len(records)))


def test_a_full_buffer_blocks_the_generator_until_the_trainer_takes():
    events: list[str] = []
    generator, trainer, link = make_loops(events, max_policy_lag=4, trainer_step_s=0.1)
    records, buffer, _ = run_stream(generator, trainer, link, steps=6, buffer_groups=2)
    # The generator, allowed 4 versions ahead, was held back by the full buffer (it waited: idle time),
    # and sampled no batch past the run's last step.
    generated = sum(1 for e in events if e.startswith("generate"))
    assert generated == 6
    assert buffer.counts.dropped_stale == 0
    assert records[-2]["idle/generator_frac"] > 0.0  # (the last step brings no generator metrics: nan)


def test_a_buffer_take_has_a_deadline():
    buffer = RolloutBuffer(capacity_groups=2, max_policy_lag=1)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="2 more groups"):
        buffer.take(2, current_version=0, timeout_s=0.2)
    assert time.monotonic() - start < 2


def test_a_stream_checkpoint_is_a_consistent_cut_that_a_resumed_run_continues_without_loss():
    """The trainer pauses the run every step; the generator stops mid-request (its completions so far
    kept), flushes its outbox behind a marker and saves its work in hand while the trainer saves its
    buffer. Every prompt the generator took is then in exactly one place: trained, in the buffer, or in
    the generator's hands. A fresh pair of loops restored from the cut of step 3 (as a resumed run is)
    finishes the run: every prompt trained at most once, none skipped, partial completions continued."""
    events: list[str] = []
    # A slow generator (3 decoding steps of 20 ms): pauses land in the middle of requests.
    generator, trainer, link = make_loops(events, max_policy_lag=1, generator_step_s=0.02)
    cuts: dict[int, dict] = {}

    def on_checkpoint(version: int, intake: TrainerIntake | None) -> None:
        cut = cuts.setdefault(version, {})
        if intake is None:  # the generator's part
            cut["generator"] = generator.work.state()
            cut["prompt_position"] = generator.prompts.position
        else:
            cut["intake"] = intake.state()
            cut["trained"] = [int(p) for b in trainer.trainer.trained for p in b.prompt_ids_BP[::2, 0]]

    run_stream(
        generator,
        trainer,
        link,
        steps=5,
        buffer_groups=4,
        checkpoint_every=1,
        on_checkpoint=on_checkpoint,
    )
    assert sorted(cuts) == [1, 2, 3, 4, 5]
    paused_mid_request = [
        v for v, c in cuts.items() if c["generator"]["request"] and c["generator"]["request"]["in_flight"]
    ]
    assert paused_mid_request, "no pause caught the generator in the middle of a request"
    for version, cut in cuts.items():
        buffered = [int(g["prompt_ids_BP"][0, 0]) for g in cut["intake"]["buffer"]["groups"].values()]
        in_hand = []
        request = cut["generator"]["request"]
        if request is not None and request["made"] is None:
            in_hand += request["positions"]
        elif request is not None:
            in_hand += request["made"]["batch"]["prompt_position_B"][::2].tolist()
        everywhere = cut["trained"] + buffered + in_hand
        assert sorted(everywhere) == list(range(cut["prompt_position"])), (
            version,
            cut["trained"],
            buffered,
            in_hand,
        )

    # Resume from the cut after step 3 with fresh loops and a fresh store, as a restarted run does.
    cut = cuts[3]
    events2: list[str] = []
    generator2, trainer2, link2 = make_loops(events2, max_policy_lag=1, generator_step_s=0.02)
    generator2.prompts.position = cut["prompt_position"]
    generator2.work.restore(cut["generator"])
    generator2.generator.policy_version = trainer2.trainer.policy_version = 3
    run_stream(generator2, trainer2, link2, steps=6, buffer_groups=4, restored=cut["intake"], first_step=3)
    resumed = [int(p) for b in trainer2.trainer.trained for p in b.prompt_ids_BP[::2, 0]]
    trained = cut["trained"] + resumed
    assert len(trained) == len(set(trained)) == 6 * 2  # steps 1-3 before, 4-6 after: each prompt once
    assert sorted(trained) == list(range(12))  # in first-in-first-out order nothing is skipped
    for batch in trainer2.trainer.trained:  # continued completions keep the versions of their first tokens
        assert (batch.token_version_BC.diff(dim=1) >= 0).all() and batch.completion_ids_BC.shape[1] == 3


def test_a_generator_that_sees_the_stop_first_still_takes_the_last_sync():
    """With several generators the weights go down a chain and the trainer's send returns once the
    first generator has them, so it can stop the run before a slow generator took its last sync. That
    generator must take it before leaving the stream, or it is one sync behind the others and the plain
    sync after the stream never completes (the relaying generator waits for it: the stall under load)."""
    events: list[str] = []
    generator, _, link = make_loops(events)
    control = StreamControl(DictStore())
    link.send(1)  # the trainer's last sync, on its way to this generator
    control.announce()
    control.stop()  # before this generator looked at the control even once
    sent: list = []
    outbox = RolloutOutbox(lambda batch, metrics: sent.append(batch), timeout_s=10)
    GeneratorStream(generator, control, outbox, in_flight=True).run()
    assert generator.policy_version == 1
    assert sent == [None]  # nothing sampled after the stop; the end of the stream delivered


def test_a_generator_two_syncs_behind_takes_both_in_order():
    """The trainer can announce a sync before a slow generator took the previous one (the first generator
    of the chain has them; the trainer trained on buffered groups meanwhile): the slow one receives
    each, one after the other, and never counts two announcements for one receive."""
    events: list[str] = []
    generator, _, link = make_loops(events)
    control = StreamControl(DictStore())
    for version in (1, 2):
        link.send(version)
        control.announce()
    control.stop()
    outbox = RolloutOutbox(lambda batch, metrics: None, timeout_s=10)
    GeneratorStream(generator, control, outbox, in_flight=True).run()
    assert generator.policy_version == 2
    assert link._to_generator.empty()  # nothing left unreceived
