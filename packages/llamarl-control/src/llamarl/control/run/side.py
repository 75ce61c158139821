"""What every rank runs, whichever side it is on: the lifecycle and the steps both sides take part in.

A run has two sides: the trainer ranks 0..N-1 (`llamarl.control.run.trainer_side`) and the generator ranks
N..N+G-1 (`llamarl.control.run.generator_side`), and with a reward model on ranks of its own a third: the
reward ranks N+G..N+G+R-1 (`llamarl.control.run.reward_side`). Each rank holds one `Side`. The steps where
ranks of every side meet (process groups created, the weight channel's address, the tick schedule,
evaluations, checkpoints, the trace) run here, in the same order on every rank (SPMD); each side fills
in its own part of them:

    setup()      seed, tokenizer, the trainer ranks' group, build_executors(), the weight channel's
                 address, the checkpoint to resume from, open_channels(), restore()
    run()        evaluate("start") | sync weights after a resume
                 lock step: for each tick of llamarl.control.run.schedule, each phase in order:
                     generate / move_rollouts / sync_weights / train / checkpoint
                 stream:    a barrier (the first trainer rank restored the shared counters), run_stream(),
                            then one plain weight sync; every rank pauses after the steps where an
                            evaluation or a checkpoint is due (`in_stream_pause`, through a `PauseServer`)
                 save_final_model(), evaluate("end"), the trace, the summary (first trainer rank)
    close()      executors, channels, files

Checkpoints and evaluations are taken at the same policy versions in every mode: after the step that
made version v when v is a multiple of `checkpoint.every` (`eval.every`). In lock step every rank
reaches that point by itself at the end of a tick; in stream mode the first trainer rank asks every
generator to pause there (`StreamControl.request_pause`) and each generator does so between two of its
decoding steps, keeping its request in flight.
"""

from __future__ import annotations

import contextlib
import time
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

from llamarl.comm import WeightSyncEndpoint
from llamarl.control.config import RunConfig
from llamarl.control.launch.devices import group_backend, rank_device, weight_sync_backend
from llamarl.control.launch.memory import ProcessTreeMemory
from llamarl.control.launch.progress import ProgressMark
from llamarl.control.launch.threads import borrowed_cores
from llamarl.control.outputs.timeline import Timeline, write_chrome_trace
from llamarl.control.run import checkpoint as ckpt
from llamarl.control.run.channels.stream import Pause
from llamarl.control.run.channels.weights import FIRST_TRAINER_RANK, weight_sync_endpoint
from llamarl.control.run.evaluation import EVAL_SCORES, EvalProgress, EvalResult, sum_over_ranks
from llamarl.control.run.faults import FaultInjector
from llamarl.control.run.schedule import PausePlan, Phase, SideName, Tick, lockstep_ticks
from llamarl.control.tasks.prompts import data_order, load_tokenizer
from llamarl.control.tasks.registry import load_task


class SideState(Protocol):
    """A side's part of a checkpoint (`*RankState`, `TrainerRunState`): plain values for torch.save/JSON."""

    def as_dict(self) -> dict[str, Any]: ...


class SideHooks:
    """What each side fills in (`Side` runs them). Every hook is called on every rank of the side, in the
    same order as on the ranks of the other sides."""

    def build_executors(self) -> None:
        """Builds and sets up this rank's executors (load the model, start an engine, ...)."""
        raise NotImplementedError

    def open_channels(self, endpoint: WeightSyncEndpoint | None) -> None:
        """Joins the weight channel as `endpoint` says (None on a reward rank, which never joins); opens
        this side's outputs (truncated to the resumed checkpoint's lengths when resuming)."""
        raise NotImplementedError

    def restore(self, resume: ckpt.Resume) -> None:
        """Loads this rank's part of the checkpoint the run continues from (RNG states excepted)."""
        raise NotImplementedError

    def checkpoint_state(self) -> SideState:
        """This rank's own part of a checkpoint (RNG states are added by the checkpoint)."""
        raise NotImplementedError

    def run_state(self) -> SideState | None:
        """The run's state for a checkpoint: from the first trainer rank only (None elsewhere)."""
        return None

    def generate(self, tick: Tick) -> None:
        """Lock step: make this tick's batch (generators)."""

    def move_rollouts(self, tick: Tick) -> None:
        """Lock step: the batch made moves from the generators to the trainer ranks."""
        raise NotImplementedError

    def sync_weights(self) -> None:
        """Trainer ranks send their current weights; every generator receives them."""
        raise NotImplementedError

    def train(self, tick: Tick) -> None:
        """Lock step: one optimizer step on the batch received (trainer ranks)."""

    def after_resume(self) -> None:
        """After a resumed run's first weight sync, before its first tick."""

    def run_stream(self) -> None:
        """Stream mode: this side's part, until the trainer has taken `schedule.steps` steps (every rank
        is past the stream's start barrier: the first trainer rank restored the shared counters)."""
        raise NotImplementedError

    def save_final_model(self) -> None:
        """After the loop: the trainer writes OUTPUT_DIR/final_model (a collective over the trainer ranks)."""

    def score_evaluation(self, scores_4Q: torch.Tensor, version: torch.Tensor, when: str) -> None:
        """This rank's share of an evaluation, written into the zero tensors (summed over ranks after;
        rows of `scores_4Q` as `EVAL_SCORES`). A long share calls `eval_heartbeat()` as it goes (e.g.
        between decoding steps): the other ranks wait as long as it shows progress."""

    def record_evaluation(self, result: EvalResult, when: str) -> None:
        """What the first trainer rank does with an evaluation's result."""

    def summarize(
        self, *, run_s: float, loop_s: float, memory: list[dict[str, Any]]
    ) -> dict[str, Any] | None:
        """The summary on the first trainer rank (written to OUTPUT_DIR/summary.json); None elsewhere.
        `memory`: the peak RSS of every process of every rank (see llamarl.control.launch.memory)."""
        return None

    def close(self) -> None:
        """Releases executors, channels and files; safe after a partial setup."""


class Side(SideHooks):
    """One rank's side of the run. Construct on every rank, then `setup()`, `run()`, `close()`.

    Subclasses implement the side-specific hooks (`SideHooks`).
    """

    side_name: SideName | None = None  # which phases of a tick this side computes in (None: reward ranks)

    # Built by setup(), on every rank.
    memory: ProcessTreeMemory  # this rank's process tree, sampled until the end
    device: torch.device
    tokenizer: Any
    store: dist.Store  # the launcher's key-value store: stream mode's counters, evaluations' progress
    trainer_group: dist.ProcessGroup  # the trainer ranks' own group
    rollout_group: dist.ProcessGroup | None = None  # stream mode: the first trainer rank, generators, reward

    def __init__(
        self,
        config: RunConfig,
        train_examples: list[dict],
        eval_examples: list[dict],
        *,
        rank: int,
        progress: ProgressMark | None = None,
    ) -> None:
        self.config = config
        self.draw_report = True  # the first trainer rank's report.png (the launcher draws it instead)
        self.task = load_task(config.task.name, config.task.module)
        self.train_examples = train_examples
        self.eval_examples = eval_examples[: config.eval.size]
        self.rank = rank
        self.world_size = config.world_size
        self.trainer_ranks = config.trainer_ranks
        self.generator_ranks = config.generator_ranks
        self.reward_ranks = config.reward_ranks  # after the generators; none by default
        self.output_dir = config.output_dir
        # This rank's phases, gathered into OUTPUT_DIR/trace.json at the end; each also marks the rank's
        # progress, which names a rank that stalls (llamarl.control.launch.progress).
        self.progress = progress
        self.timeline = Timeline(observer=progress)
        self.faults = FaultInjector(rank, self.output_dir)
        self.tick = -1  # the tick being run (-1 before and after the training loop)
        self.resumed: ckpt.Resume | None = None  # the checkpoint this run continues from
        self.start_tick = 0  # the first tick (stream: step) to run (after the resumed checkpoint's)
        self.checkpoints: ckpt.RunCheckpoints | None = None  # with checkpoint.every or checkpoint.resume
        self.plan = PausePlan(config.eval.every, config.checkpoint.every, config.schedule.steps)
        self._eval_s_in_loop = 0.0  # time spent evaluating inside the training loop (not training)
        self._evaluations = 0  # evaluations so far (every rank counts the same)
        self._eval_progress: EvalProgress | None = None  # the evaluation under way
        self.prompt_order = data_order(len(train_examples), config.seed)  # the same on every rank
        self.init_state()

    def init_state(self) -> None:
        """The side's own state before setup(), from `config` and `rank` (a subclass's part of
        `__init__`, whose arguments every side takes the same)."""

    # ----------------------------------------------------------------------------------------------
    # lifecycle

    @property
    def is_logger(self) -> bool:
        """Whether this rank logs metrics and writes the summary (the first trainer rank)."""
        return self.rank == FIRST_TRAINER_RANK

    def setup(self) -> None:
        """Loads the models, opens the channels, and on resume loads this rank's part of the checkpoint."""
        cfg = self.config
        # This rank and every process it starts (an engine, reward workers), sampled until the end.
        self.memory = ProcessTreeMemory.of_rank(self.rank, cfg.role_of(self.rank)).start()
        self.device = rank_device(cfg)
        torch.manual_seed(cfg.seed + self.rank)
        self.tokenizer = load_tokenizer(cfg.model)
        # The launcher's key-value store (a namespace per restart): stream mode's shared counters and
        # the evaluations' progress.
        self.store = dist.distributed_c10d._get_default_store()
        # The trainer ranks' own group (FSDP2 and the trainer's all-reduces, never involving the
        # generators); every rank must take part in creating it, members or not. On CUDA its GPU
        # tensors go over NCCL and its CPU bookkeeping over gloo (llamarl.control.launch.devices).
        self.trainer_group = dist.new_group(self.trainer_ranks, backend=group_backend(self.device))
        if cfg.schedule.mode == "stream":
            # Generators stream rollouts to the first trainer rank on a group of their own, so those
            # transfers never interleave with the default group's relays and collectives.
            self.rollout_group = dist.new_group(
                [FIRST_TRAINER_RANK, *self.generator_ranks, *self.reward_ranks],
                timeout=timedelta(seconds=cfg.launch.timeout_s),
            )
        self.build_executors()
        # Reward ranks take part in choosing the address but never join the weight channel: a reward
        # model's weights are its own.
        endpoint = weight_sync_endpoint(
            self.rank,
            len(self.trainer_ranks) + len(self.generator_ranks),
            backend=weight_sync_backend(cfg),
            timeout_s=cfg.sync_deadline_s,
            dead_after_s=cfg.weight_sync.dead_after_s,
        )
        if cfg.checkpoint.every or cfg.checkpoint.resume:
            self.checkpoints = ckpt.RunCheckpoints(
                self.output_dir,
                rank=self.rank,
                world_size=self.world_size,
                keep=cfg.checkpoint.keep,
                settings={key: cfg.setting(key) for key in ckpt.MUST_MATCH_ON_RESUME},
            )
            if cfg.checkpoint.resume:
                self.resumed = self.checkpoints.resume(log=lambda m: print(m, flush=True))
        self.open_channels(endpoint)
        if self.resumed is not None:
            self.start_tick = self.resumed.tick  # stream mode: the step (= policy_version)
            self.restore(self.resumed)
            ckpt.restore_rng(self.resumed.rank_state["rng"])  # last: nothing above may draw from them

    def run(self) -> dict[str, Any] | None:
        """Runs the whole job; returns the summary on the first trainer rank, None elsewhere."""
        cfg = self.config
        run_start = time.perf_counter()
        self.faults.strike(tick=-1)
        if self.resumed is None:
            self.evaluate("start")
        else:
            # The generators loaded the initial model: they serve the checkpointed policy from here.
            self.sync_weights()
            self.after_resume()
        loop_start = self.loop_clock()
        if cfg.schedule.mode == "stream":
            dist.barrier()  # nobody streams before the first trainer rank restored the shared counters
            self.run_stream()
            # Every rank is out of the stream now: one plain sync makes sure every generator serves the
            # final policy for evaluation, even one whose last in-stream sync failed.
            self.sync_weights()
        else:
            self.run_lockstep()
        loop_s = self.loop_clock() - loop_start
        self.tick = -1
        self.save_final_model()
        self.evaluate("end")
        memory = self._gather_memory()
        self._write_trace()
        return self.summarize(run_s=time.perf_counter() - run_start, loop_s=loop_s, memory=memory)

    def loop_clock(self) -> float:
        """Seconds on a clock that stops while evaluating inside the loop: step times are training only.
        (The timeline's clock, less the in-loop evaluations' spans: the trace and the metrics agree.)"""
        return self.timeline.now() - self._eval_s_in_loop

    # ----------------------------------------------------------------------------------------------
    # lock step

    def run_lockstep(self) -> None:
        """Sync and async modes: every rank runs this rank's part of each phase of each tick, in order
        (`llamarl.control.run.schedule.lockstep_ticks`). Async, tick t (the paper's schedule):

            move batch t-1 -> sync weights v(t-1) -> generate batch t | train on batch t-1 -> checkpoint

        consumes:     the tick's batch: moved from the generators (through the reward ranks if any)
        waits for:    the peers of each phase's transfer or collective (a side with nothing to compute
                      in a tick waits in the next phase's transfer)
        unblocked by: the other side reaching the same phase
        """
        cfg = self.config
        for tick in lockstep_ticks(cfg.schedule.mode, cfg.schedule.steps, self.start_tick):
            self.tick = tick.index
            self.faults.strike(tick.index)
            self._maybe_evaluate(tick.index)
            with self._cores_for(tick):  # the side alone at work borrows the waiting side's cores
                for phase in tick.phases:
                    self._run_phase(phase, tick)

    def _cores_for(self, tick: Tick) -> contextlib.AbstractContextManager[None]:
        """The only side at work in a tick borrows the cores of the side that waits (first and last
        tick of an async run)."""
        return self.borrow_cores() if tick.working_sides() == {self.side_name} else contextlib.nullcontext()

    def borrow_cores(self) -> contextlib.AbstractContextManager[None]:
        """While this side alone computes (the other only waits for it), its ranks borrow the other
        side's cores (`llamarl.control.launch.threads`); reward ranks count as at work."""
        ranks = self.trainer_ranks if self.side_name == "trainers" else self.generator_ranks
        return borrowed_cores(self.config, len(ranks) + len(self.reward_ranks))

    def _run_phase(self, phase: Phase, tick: Tick) -> None:
        if phase.name == "generate":
            self.generate(tick)
        elif phase.name == "move_rollouts":
            with self.timeline.phase("rollouts", tick.index):
                self.move_rollouts(tick)
        elif phase.name == "sync_weights":
            self.sync_weights()
        elif phase.name == "train":
            self.train(tick)
        elif phase.name == "checkpoint":
            self._maybe_checkpoint(tick)
        else:
            raise ValueError(f"unknown phase {phase}")

    def _maybe_checkpoint(self, tick: Tick) -> None:
        """Every `checkpoint.every` policy versions, at the end of a tick: every rank writes its part.

        Every rank knows the policy version from the tick alone (no message needed). Nothing is in the
        channels then; in async mode the generators' batch made but not yet sent is saved with them.
        """
        if self.plan.checkpoint_due(tick.policy_version):
            with self.timeline.phase("checkpoint", tick.index):
                self.save_checkpoint(tick=tick.index, policy_version=tick.policy_version)

    def save_checkpoint(self, *, tick: int, policy_version: int) -> None:
        """Every rank writes its part of checkpoint `policy_version` (collective); a resumed run starts
        at tick (stream mode: step) `tick + 1`."""
        assert self.checkpoints is not None
        run_state = self.run_state()
        self.checkpoints.save(
            tick=tick,
            policy_version=policy_version,
            rank_state=self.checkpoint_state().as_dict(),
            run_state=None if run_state is None else run_state.as_dict(),
            trainer=self.trainer_parts(),
            trainer_group=self.trainer_group,
            before_commit=lambda: self.faults.strike(tick, "checkpoint"),
        )

    # ----------------------------------------------------------------------------------------------
    # stream

    def in_stream_pause(self, pause: Pause) -> None:
        """Stream mode: this rank's part of a pause after the step that made `pause.policy_version`
        (every rank, in the same order: each side serves it through a `PauseServer`): an evaluation
        inside the loop, or a checkpoint. A resumed run starts at the next step."""
        version = pause.policy_version
        if pause.kind == "eval":
            self.evaluate_in_loop(f"step {version}")
        else:
            with self.timeline.phase("checkpoint", version - 1):
                self.save_checkpoint(tick=version - 1, policy_version=version)

    def trainer_parts(self) -> tuple[torch.nn.Module, torch.optim.Optimizer] | None:
        """(model, optimizer) that checkpoints save through DCP on trainer ranks; None on generators."""
        return None

    # ----------------------------------------------------------------------------------------------
    # evaluation

    def _maybe_evaluate(self, tick: int) -> None:
        """Evaluates every `eval.every` ticks inside the training loop (learning curves)."""
        every = self.config.eval.every
        if every and tick > 0 and tick % every == 0:
            self.evaluate_in_loop(f"tick {tick}")

    def evaluate_in_loop(self, when: str) -> None:
        """An evaluation inside the training loop; its time is left out of the step times (its span on
        the timeline, recording its result included: the trace and the metrics agree)."""
        if self.evaluate(when) is not None:
            span = self.timeline.last("eval")
            self._eval_s_in_loop += span.end - span.start

    def evaluate(self, when: str) -> EvalResult | None:
        """Held-out questions answered by the generators, each share scored where it was answered;
        None when eval.size is 0.

        Greedy always; with `eval.samples` K > 0 also K completions sampled at the training temperature
        (what RL optimises directly). Rewards always, and whether each answer is right where the task
        says (`Task.correct`). Scores are kept per question so that the change from start to end gets a
        paired confidence interval.
        """
        if not self.eval_examples:
            return None
        scores_4Q = torch.zeros(len(EVAL_SCORES), len(self.eval_examples), dtype=torch.float64)
        version = torch.zeros(1, dtype=torch.int64)  # the generators' policy_version (all hold the same)
        self._evaluations += 1
        self._eval_progress = EvalProgress(self.store, self._evaluations)
        with self.timeline.phase("eval", self.tick):
            self.score_evaluation(scores_4Q, version, when)
            if self.rank in self.generator_ranks:
                self._eval_progress.done()
            self._eval_progress.wait(len(self.generator_ranks), timeout_s=self.config.launch.timeout_s)
            result = sum_over_ranks(
                scores_4Q,
                version,
                sampled=bool(self.config.eval.samples),
                judged=self.task.correct is not None,
            )
            self.record_evaluation(result, when)
        return result

    def eval_heartbeat(self) -> None:
        """A generator scoring its share of the evaluation under way shows progress (cheap: at most
        about once a second it reaches the store)."""
        assert self._eval_progress is not None, "no evaluation under way"
        self._eval_progress.beat()
        if self.progress is not None:
            self.progress.beat()

    # ----------------------------------------------------------------------------------------------
    # the end

    def _gather_memory(self) -> list[dict[str, Any]]:
        """Every rank's process-tree peaks, in rank order, on the first trainer rank (empty elsewhere)."""
        self.memory.stop()
        gathered = _gather_on_first_trainer_rank(self.memory.processes(), self.world_size)
        return [p for rank_processes in gathered or [] for p in rank_processes]

    def _write_trace(self) -> None:
        """Gathers every rank's phases on the first trainer rank, which writes OUTPUT_DIR/trace.json."""
        gathered = _gather_on_first_trainer_rank(self.timeline.spans, self.world_size)
        if gathered is not None:
            roles = [self.config.rank_label(r) for r in range(self.world_size)]
            write_chrome_trace(self.output_dir / "trace.json", gathered, roles)


def _gather_on_first_trainer_rank(mine: list, world_size: int) -> list[list] | None:
    """Every rank's `mine`, in rank order, on the first trainer rank (None elsewhere); a collective."""
    here = dist.get_rank() == FIRST_TRAINER_RANK
    gathered: list[list] | None = [[] for _ in range(world_size)] if here else None
    dist.gather_object(mine, gathered, dst=FIRST_TRAINER_RANK)
    return gathered
