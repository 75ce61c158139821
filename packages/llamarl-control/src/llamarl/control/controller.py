"""The single controller: what every rank runs (SPMD), around the two roles.

Ranks 0..N-1 are the trainer (FSDP2 over their own process group when N > 1; rank 0 logs metrics);
ranks N..N+G-1 are generators, each scoring its own completions with a rewarder in worker processes.
Each rank holds one role (`llamarl.control.roles`): a `TrainerRole` (take a batch -> train -> send
weights; every trainer rank sends its own shards through llamarl.comm, no gather) or a `GeneratorRole`
(receive weights -> generate and score -> hand over a batch). The controller builds them, moves what
they hand over between ranks, and runs them on a schedule:

- `sync` and `async`: lock step, tick by tick, as written down in `llamarl.control.schedule` (async
  overlaps generation and training on their own ranks, one policy version apart; sync runs them one
  after the other: the synchronous baseline on the same work).
- `stream`: generators sample back to back and send groups to a bounded `RolloutBuffer` on the first
  trainer rank; the trainer trains on the oldest groups still within max_policy_lag (dropping older)
  and announces new weights, which HF generators take between decoding steps (in flight) and vLLM
  generators between requests.

Around the loop the controller loads the models, evaluates, checkpoints, and writes the summary.
"""

from __future__ import annotations

import json
import os
import random
import resource
import signal
import threading
import time
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from llamarl.comm import WeightSender, WeightSyncGroup
from llamarl.control import checkpoint as ckpt
from llamarl.control.buffer import RolloutBuffer
from llamarl.control.channels import concat_rollouts, recv_rollouts, send_rollouts
from llamarl.control.config import RunConfig
from llamarl.control.evaluation import EvalResult, paired_delta_ci
from llamarl.control.executors import (
    build_generator,
    build_rewarder,
    build_trainer,
    load_tokenizer,
    open_weight_receiver,
    trainer_uses_fsdp,
    weight_wire_dtype,
)
from llamarl.control.metrics import MetricsLogger
from llamarl.control.net import free_port
from llamarl.control.report import write_report
from llamarl.control.roles import (
    GeneratorRole,
    GeneratorSetup,
    PolicyLagError,
    PromptStream,
    RolloutOutbox,
    StreamControl,
    TrainerRole,
    drain_into_buffer,
)
from llamarl.control.schedule import Phase, Tick, lockstep_ticks
from llamarl.control.tasks import TASKS, Example
from llamarl.control.timeline import Timeline, write_chrome_trace
from llamarl.exec.types import RolloutBatch

TRAINER_RANK = 0  # the first trainer rank: receives rollouts, logs metrics, writes the summary
# Settings that fix which prompts each tick sees and how they are split: a resumed run must keep them.
_MUST_MATCH_ON_RESUME = ("mode", "seed", "prompts_per_step", "samples_per_prompt", "num_generators", "task")
EVAL_CHUNK = 32  # prompts per greedy generate call during evaluation
# "RANK:TICK" raises on that rank at the start of that tick, "RANK:TICK:kill" kills it (SIGKILL);
# a last ":checkpoint" strikes instead inside the checkpoint write of that tick, after the rank has
# written its part and before the commit; "RANK:N:engine" kills (SIGKILL) the vLLM engine of that
# generator rank half a second into its stream request N. Faults strike in the first attempt only,
# not after a restart.
FAULT_ENV = "LLAMARL_FAULT"


__all__ = ["Controller", "PolicyLagError"]


class Controller:
    """Runs one RL job on this rank. Construct on every rank, then `setup()`, `run()`, `close()`."""

    def __init__(
        self, config: RunConfig, train_examples: list[Example], eval_examples: list[Example]
    ) -> None:
        self.config = config
        self.task = TASKS[config.task]
        self.train_examples = train_examples
        self.eval_examples = eval_examples[: config.eval_size]
        self.output_dir = Path(config.output_dir)
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.trainer_ranks = list(range(config.num_trainers))
        self.is_trainer = self.rank in self.trainer_ranks
        self.is_logger = self.rank == TRAINER_RANK
        self.generator_ranks = list(range(config.num_trainers, self.world_size))
        self.generator_index = self.rank - config.num_trainers  # index among generators (<0 on trainers)
        self._prompt_order = list(range(len(train_examples)))
        random.Random(config.seed).shuffle(self._prompt_order)
        self._prompt_ids: dict[int, list[int]] = {}
        self._pending: tuple[RolloutBatch, dict[str, float]] | None = None  # generator: made, not yet sent
        # trainer: (this rank's part, the whole batch on the first rank) arrived, not yet trained on
        self._received: tuple[RolloutBatch, RolloutBatch] | None = None
        self._fault = _parse_fault(os.environ.get(FAULT_ENV))
        self._step_records: list[dict[str, float]] = []
        self._stream_counts: dict[str, float] = {}  # stream mode: the buffer's counts at the end
        self.timeline = Timeline()  # this rank's phases, gathered into OUTPUT_DIR/trace.json at the end
        self._tick = -1  # the tick being run (-1 before and after the training loop)
        self._eval_history: list[EvalResult] = []  # trainer: every evaluation, in order
        self._eval_s_in_loop = 0.0  # time spent evaluating inside the training loop (not training)
        self._resume: ckpt.Found | None = None  # the checkpoint this run continues from
        self._start_tick = 0  # the first tick to run (after the resumed checkpoint's)

    # ----------------------------------------------------------------------------------------------
    # lifecycle

    def setup(self) -> None:
        """Loads the model on every rank, builds the executors and the weight-sync group."""
        cfg = self.config
        device = _device(cfg.device)
        torch.manual_seed(cfg.seed + self.rank)
        self.tokenizer = load_tokenizer(cfg.model)
        self.trainer_group = self._new_trainer_group()  # FSDP2, the trainer's all-reduces, checkpoints
        if self.is_trainer:
            self.trainer = build_trainer(
                cfg, device, self.trainer_group if trainer_uses_fsdp(cfg, device) else None
            )
            self.trainer.setup()
        else:
            self.generator = build_generator(cfg, device, seed=cfg.seed + self.rank, rank=self.rank)
            self.generator.setup()
            self.rewarder = build_rewarder(cfg)
        # The weight-sync group has its own store on a port chosen by the trainer: it never depends on
        # the default process group, which here only carries rollouts and small control messages.
        port = torch.tensor([free_port() if self.is_logger else 0], dtype=torch.int64)
        dist.broadcast(port, TRAINER_RANK)
        group_args = dict(
            host=os.environ.get("MASTER_ADDR", "127.0.0.1"),
            port=int(port.item()),
            rank=self.rank,
            world_size=self.world_size,
            timeout_s=cfg.sync_deadline_s,  # each step of a sync; waiting for one to start is timeout_s
        )
        saved = self._setup_checkpoints()
        samples_path = self.output_dir / f"samples.rank{self.rank}.jsonl"
        if self.is_trainer:
            self.weight_group = WeightSyncGroup(**group_args)
            # Every trainer rank is a source: with FSDP2 each sends the slices its shards hold.
            self.sender = WeightSender(
                self.weight_group,
                self.trainer.model,
                bucket_bytes=cfg.weight_bucket_mb << 20,
                wire_dtype=weight_wire_dtype(device),
            )
        if self.is_logger:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            if cfg.resume:  # lines written after the checkpoint are made again, so cut them
                ckpt.truncate(self.output_dir / "metrics.jsonl", saved.get("metrics_bytes", 0))
            self.logger = MetricsLogger(
                output_dir=self.output_dir,
                total_steps=cfg.steps,
                config=_plain(cfg),
                wandb_project=cfg.wandb_project if cfg.wandb else None,
                wandb_id=saved.get("wandb_id"),
                initial_step=saved.get("policy_version", 0),
            )
        if not self.is_trainer:
            # A vLLM generator's engine joins in this rank's place and receives straight from the trainer.
            self.receiver = open_weight_receiver(
                self.generator, **group_args, src_rank=TRAINER_RANK, announce_timeout_s=cfg.timeout_s
            )
            if cfg.resume:
                ckpt.truncate(samples_path, saved.get("samples_bytes", {}).get(str(self.rank), 0))
            self._samples = samples_path.open("a", encoding="utf-8")
        self._build_roles()
        if cfg.mode == "stream":
            # Generators stream rollouts to the first trainer rank on a group of their own, so those
            # transfers never interleave with the default group's relays and collectives.
            self.rollout_group = dist.new_group(
                [TRAINER_RANK, *self.generator_ranks], timeout=timedelta(seconds=cfg.timeout_s)
            )
        if self._resume is not None:
            self._restore(saved)

    def _build_roles(self) -> None:
        cfg = self.config
        if self.is_trainer:
            self.trainer_role = TrainerRole(
                trainer=self.trainer,
                send_weights=self.sender.send,
                max_policy_lag=cfg.max_policy_lag,
                timeline=self.timeline,
                clock=self._loop_clock,
                tolerate_sync_failures=self._replaces_engines(),
            )
            return
        share = cfg.prompts_per_step // cfg.num_generators
        self.generator_role = GeneratorRole(
            generator=self.generator,
            rewarder=self.rewarder,
            receive_weights=self.receiver.receive,
            prompts=PromptStream(
                self._prompt_order,
                prompts_per_step=cfg.prompts_per_step,
                generator_index=self.generator_index,
                num_generators=cfg.num_generators,
            ),
            encode=self._tokenized_prompt,
            reference=lambda i: self.train_examples[i].reference,
            question=lambda i: self.train_examples[i].question,
            decode=self._decode_completions,
            setup=GeneratorSetup(
                samples_per_prompt=cfg.samples_per_prompt,
                prompts_per_request=share,
                max_new_tokens=cfg.max_new_tokens,
                dynamic_sampling=cfg.dynamic_sampling,
                max_sampling_rounds=cfg.max_sampling_rounds,
            ),
            timeline=self.timeline,
            sample_log=self._samples,
            before_request=lambda n: self._maybe_fail(n, phase="request"),
            replace_engines=self._replaces_engines(),
        )

    def _replaces_engines(self) -> bool:
        """Whether a dead vLLM engine is replaced while the trainer keeps its state: in stream mode with
        one trainer rank (elsewhere the run fails and torch elastic restarts it from a checkpoint)."""
        cfg = self.config
        return cfg.mode == "stream" and cfg.generator == "vllm" and cfg.num_trainers == 1

    def _setup_checkpoints(self) -> dict[str, Any]:
        """Builds the checkpoint writer; on resume picks the checkpoint and returns its controller state.

        Returns {} for a fresh start.
        """
        cfg = self.config
        if not (cfg.checkpoint_every or cfg.resume):
            return {}
        root = self.output_dir / ckpt.CHECKPOINTS_DIR
        self.checkpoints = ckpt.CheckpointWriter(
            root, rank=self.rank, world_size=self.world_size, keep=cfg.keep_checkpoints
        )
        if not cfg.resume:
            return {}
        self._resume = ckpt.choose_on_rank0(root, rank=self.rank, log=print)
        if self._resume is None:
            if self.is_logger:
                print(f"no complete checkpoint in {root}: starting from the beginning", flush=True)
            return {}
        saved = ckpt.load_controller_state(self._resume)
        for key in _MUST_MATCH_ON_RESUME:
            if saved["config"][key] != getattr(cfg, key):
                raise ckpt.CheckpointError(
                    f"{self._resume.path} was written with {key}={saved['config'][key]!r}, "
                    f"this run has {getattr(cfg, key)!r}"
                )
        return saved

    def _restore(self, saved: dict[str, Any]) -> None:
        """Loads this rank's part of the chosen checkpoint; the generators get its weights in run()."""
        assert self._resume is not None
        self._start_tick = saved["tick"]
        mine = ckpt.load_rank_state(self._resume, self.rank, self.world_size)
        if self.is_trainer:  # every trainer rank loads its shards
            ckpt.load_trainer(self._resume, self.trainer.model, self.trainer.optimizer, self.trainer_group)
            self.trainer.policy_version = saved["policy_version"]
        if self.is_logger:
            self._step_records = saved["step_records"]
            self._eval_history = [EvalResult(**e) for e in saved["eval_history"]]
            self.trainer_role.last_sync_s = saved["last_sync_s"]
            self.logger.write(f"resumed from {self._resume.path} (policy_version {self._resume.step})")
        if not self.is_trainer:
            share = self.config.prompts_per_step // self.config.num_generators
            self.generator_role.prompts.position = mine.get("prompt_position", saved["tick"] * share)
            if mine.get("pending") is not None:
                tensors, group_size, metrics = mine["pending"]
                self._pending = (RolloutBatch(group_size=group_size, **tensors), metrics)
            # The generator's cumulative counters continue from the checkpoint (the trainer takes
            # their differences per step).
            self.generator_role.restore_totals(mine.get("generator_totals"))
        if self.is_logger:
            self.trainer_role.generator_stats.restore(saved.get("generator_stats"))
        ckpt.restore_rng(mine["rng"])  # last: nothing above may draw from the restored streams

    def _new_trainer_group(self) -> dist.ProcessGroup:
        """The trainer ranks' own process group (FSDP2 and the trainer's all-reduces run on it, never
        involving the generators). Every rank must take part in creating it, members or not."""
        return dist.new_group(self.trainer_ranks)

    def close(self) -> None:
        """Releases executors and groups; safe to call after a partial setup."""
        for name in ("sender", "receiver", "weight_group", "rewarder", "generator", "trainer"):
            part = getattr(self, name, None)
            if part is not None and hasattr(part, "close"):
                part.close()
        if getattr(self, "_samples", None) is not None:
            self._samples.close()

    # ----------------------------------------------------------------------------------------------
    # the tick loop

    def run(self) -> dict[str, Any] | None:
        """Runs the whole job; returns the summary on the trainer rank, None elsewhere."""
        cfg = self.config
        run_start = time.perf_counter()
        self._maybe_fail(tick=-1)
        if self._resume is None:
            self._evaluate("start")
        else:
            # The generators loaded the initial model: they serve the checkpointed policy from here.
            self._sync_weights()
            # A checkpoint of an async run's last tick holds no rollouts in flight; a longer run needs
            # them, so they are made now (by the restored policy: lag 0 for that one batch).
            in_flight_lost = cfg.mode == "async" and not self.is_trainer and self._pending is None
            if in_flight_lost and 0 < self._start_tick <= cfg.steps:
                self._pending = self.generator_role.make_batch(self._start_tick - 1)
        loop_start = self._loop_clock()
        if cfg.mode == "stream":
            self._run_stream()
            # Every rank is out of the stream now: one plain sync makes sure every generator serves the
            # final policy for evaluation, even one whose last in-stream sync failed.
            self._sync_weights()
        else:
            for tick in lockstep_ticks(cfg.mode, cfg.steps, self._start_tick):
                self._run_tick(tick)
        loop_s = self._loop_clock() - loop_start
        self._tick = -1
        if self.is_trainer and cfg.save_model:
            state_dict = self.trainer.full_state_dict()  # a collective over the trainer ranks
            if self.is_logger:
                _save_model(self.trainer.model, self.tokenizer, self.output_dir / "final_model", state_dict)
        self._evaluate("end")
        peak_rss_mb = self._gather_peak_rss_mb()
        self._write_trace()
        if not self.is_logger:
            return None
        summary = self._summary(
            run_s=time.perf_counter() - run_start,
            loop_s=loop_s,
            peak_rss_mb=peak_rss_mb,
        )
        (self.output_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        self.logger.close(summary)
        summary["wandb_dir"] = self.logger.wandb_dir
        try:
            write_report(self.output_dir)
        except Exception as e:  # a picture must never fail a finished run
            self.logger.write(f"warning: could not draw {self.output_dir / 'report.png'}: {e}")
        return summary

    # lock step ----------------------------------------------------------------------------------

    def _run_tick(self, tick: Tick) -> None:
        """Runs one tick of the lock-step schedule: this rank's part of every phase, in order."""
        self._tick = tick.index
        for role in (getattr(self, "trainer_role", None), getattr(self, "generator_role", None)):
            if role is not None:
                role.tick = tick.index
        self._maybe_fail(tick.index)
        self._maybe_evaluate(tick.index)
        for phase in tick.phases:
            self._run_phase(phase, tick)

    def _run_phase(self, phase: Phase, tick: Tick) -> None:
        if phase.name == "generate":
            if not self.is_trainer:
                self._pending = self.generator_role.make_batch(tick.index)
        elif phase.name == "move_rollouts":
            with self.timeline.phase("rollouts", tick.index):
                self._exchange_rollouts()
        elif phase.name == "sync_weights":
            self._sync_weights()
        elif phase.name == "train":
            if self.is_trainer:
                assert self._received is not None, "no batch to train on"
                part, whole = self._received
                self._received = None
                self._log_step(self.trainer_role.train(part, whole))
        elif phase.name == "checkpoint":
            self._maybe_checkpoint(tick.index, policy_version=tick.policy_version)
        else:
            raise ValueError(f"unknown phase {phase}")

    def _exchange_rollouts(self) -> None:
        """Generators send the batch they made to the first trainer rank, which keeps its own part and
        sends every other trainer rank its part (whole groups; see `_split_across_trainers`)."""
        if not self.is_trainer:
            assert self._pending is not None, "no batch to send"
            send_rollouts(*self._pending, dst=TRAINER_RANK)
            self._pending = None
            return
        if not self.is_logger:
            part, _ = recv_rollouts(src=TRAINER_RANK)
            assert part is not None
            self._received = (part, part)
            return
        batches = []
        for r in self.generator_ranks:
            batch, metrics = recv_rollouts(src=r)
            assert batch is not None
            self.trainer_role.generator_stats.update(r, metrics)
            batches.append(batch)
        whole = concat_rollouts(batches)
        self._received = (self._split_across_trainers(whole), whole)

    def _split_across_trainers(self, batch: RolloutBatch) -> RolloutBatch:
        """Sends trainer rank r its part r of `batch`; returns this rank's part. Rollouts are small
        next to weights, so one rank relays them."""
        num_trainers = len(self.trainer_ranks)
        for r in self.trainer_ranks[1:]:
            send_rollouts(batch.data_parallel_part(r, num_trainers), {}, dst=r)
        return batch.data_parallel_part(0, num_trainers)

    def _log_step(self, record: dict[str, float]) -> None:
        if self.is_logger:
            self._step_records.append(record)
            self.logger.log(self.trainer.policy_version, record)

    def _sync_weights(self) -> None:
        """Trainer ranks send their current weights; every generator receives them and their version."""
        if self.is_trainer:
            self.trainer_role.send_weights()
        else:
            self.generator_role.receive_weights()

    # stream ---------------------------------------------------------------------------------------

    def _run_stream(self) -> None:
        """Stream mode: generators sample continuously; the trainer takes the oldest groups still
        within max_policy_lag (first in, first out: no group waits forever)."""
        cfg = self.config
        control = StreamControl(dist.distributed_c10d._get_default_store())
        if not self.is_trainer:
            outbox = RolloutOutbox(
                lambda batch, metrics: send_rollouts(
                    batch, metrics, dst=TRAINER_RANK, group=self.rollout_group
                ),
                timeout_s=cfg.timeout_s,
            )
            in_flight = bool(getattr(self.generator, "supports_in_flight_updates", False))
            self.generator_role.stream(control, outbox, in_flight=in_flight)
            return
        if not self.is_logger:  # another FSDP2 trainer rank: its part of every batch comes from rank 0

            def take_part() -> RolloutBatch:
                part, _ = recv_rollouts(src=TRAINER_RANK)
                assert part is not None
                return part

            self.trainer_role.stream(
                steps=cfg.steps, take=take_part, relay=lambda b: b, control=None, on_step=self._log_step
            )
            return
        buffer = RolloutBuffer(capacity_groups=cfg.buffer_groups, max_policy_lag=cfg.max_policy_lag)
        errors: list[BaseException] = []
        discarded = [0]

        def drain(src: int) -> None:
            try:
                discarded[0] += drain_into_buffer(
                    buffer,
                    lambda: recv_rollouts(src=src, group=self.rollout_group),
                    self.trainer_role.generator_stats,
                    src,
                    timeout_s=cfg.timeout_s,
                )
            except BaseException as e:  # the trainer's take() raises it through the closed buffer
                errors.append(e)
                buffer.close()

        threads = [
            threading.Thread(target=drain, args=(r,), name=f"rollouts-from-{r}", daemon=True)
            for r in self.generator_ranks
        ]
        for thread in threads:
            thread.start()

        def take() -> RolloutBatch:
            try:
                return buffer.take(
                    cfg.prompts_per_step,
                    current_version=self.trainer.policy_version,
                    timeout_s=cfg.timeout_s,
                    on_wait=lambda: self.trainer_role.answer_weight_requests(control),
                )
            except Exception as e:
                if errors:
                    raise errors[0] from e
                raise

        def on_step(record: dict[str, float]) -> None:
            record["stream/dropped_stale_groups"] = float(buffer.counts.dropped_stale)
            record["stream/buffered_groups"] = float(len(buffer))
            self._log_step(record)

        self.trainer_role.stream(
            steps=cfg.steps, take=take, relay=self._split_across_trainers, control=control, on_step=on_step
        )
        buffer.close()  # what still arrives is received and discarded until every generator ends
        for thread in threads:
            thread.join(cfg.timeout_s)
            if thread.is_alive():
                raise TimeoutError(f"{thread.name}: a generator did not end its stream in time")
        if errors:
            raise errors[0]
        self._stream_counts = {
            "dropped_stale_groups": buffer.counts.dropped_stale,
            "received_groups": buffer.counts.received,
            "unused_groups": buffer.counts.received - buffer.counts.taken - buffer.counts.dropped_stale,
            "discarded_batches": discarded[0],
        }

    def _maybe_checkpoint(self, tick: int, *, policy_version: int) -> None:
        """Every `checkpoint_every` policy versions, at the end of a tick: every rank writes its part.

        Every rank knows `policy_version` from the tick alone (no message needed). Nothing is in the
        channels then; in async mode the generators' batch made but not yet sent is saved with them.
        """
        every = self.config.checkpoint_every
        if not every or policy_version % every:
            return
        rank_state: dict[str, Any] = {}
        controller_state = None
        if self.is_trainer:
            assert policy_version == self.trainer.policy_version
        if self.is_logger:
            controller_state = {
                "tick": tick + 1,  # the tick a resumed run starts with
                "policy_version": policy_version,
                "config": {k: getattr(self.config, k) for k in _MUST_MATCH_ON_RESUME},
                "step_records": self._step_records,
                "eval_history": [asdict(e) for e in self._eval_history],
                "last_sync_s": self.trainer_role.last_sync_s,
                "generator_stats": self.trainer_role.generator_stats.state(),
                "wandb_id": self.logger.wandb_id,
                "metrics_bytes": self.logger.jsonl_bytes(),
                "samples_bytes": self._gather_samples_bytes(),
            }
        else:
            self._gather_samples_bytes()
        if not self.is_trainer:
            rank_state["prompt_position"] = self.generator_role.prompts.position
            rank_state["generator_totals"] = self.generator_role.metrics()
            if self._pending is not None:
                batch, metrics = self._pending
                rank_state["pending"] = (batch.tensors(), batch.group_size, metrics)
        with self.timeline.phase("checkpoint", tick):
            self.checkpoints.save(
                policy_version,
                rank_state=rank_state,
                trainer=(self.trainer.model, self.trainer.optimizer) if self.is_trainer else None,
                trainer_group=self.trainer_group,
                controller_state=controller_state,
                before_commit=lambda: self._maybe_fail(tick, phase="checkpoint"),
            )

    def _gather_samples_bytes(self) -> dict[str, int] | None:
        """The length of every generator's samples file, on the logging rank (collective)."""
        size = torch.zeros(self.world_size, dtype=torch.int64)
        if not self.is_trainer:
            self._samples.flush()
            size[self.rank] = self._samples.tell()
        dist.all_reduce(size)
        return {str(r): int(size[r]) for r in self.generator_ranks} if self.is_logger else None

    def _loop_clock(self) -> float:
        """Seconds on a clock that stops while evaluating inside the loop: step times are training only."""
        return time.perf_counter() - self._eval_s_in_loop

    def _maybe_evaluate(self, tick: int) -> None:
        """Evaluates every `eval_every` ticks inside the training loop (learning curves)."""
        every = self.config.eval_every
        if every and tick > 0 and tick % every == 0:
            start = time.perf_counter()
            self._evaluate(f"tick {tick}")
            self._eval_s_in_loop += time.perf_counter() - start

    def _evaluate(self, when: str) -> EvalResult | None:
        """Accuracy on the held-out questions, split across generators; None when eval_size is 0.

        Greedy always; with `eval_samples` K > 0 also the mean over K completions sampled at the
        training temperature (what RL optimises directly). Scores are kept per question so that the
        change from start to end gets a paired confidence interval.
        """
        if not self.eval_examples:
            return None
        cfg = self.config
        num_questions = len(self.eval_examples)
        greedy_Q = torch.zeros(num_questions, dtype=torch.float64)
        sampled_Q = torch.zeros(num_questions, dtype=torch.float64)
        version = torch.zeros(1, dtype=torch.int64)  # the generators' policy_version (all hold the same)
        with self.timeline.phase("eval", self._tick):
            if not self.is_trainer:
                version[0] = self.generator.policy_version
                mine = list(range(num_questions))[self.generator_index :: cfg.num_generators]
                # The trainer idles during evaluation, so the generators may use its cores too (unless
                # the user fixed the threads per rank: on a shared machine more threads can be slower).
                threads = torch.get_num_threads()
                if cfg.threads_per_rank is None:
                    torch.set_num_threads(max(threads, (os.cpu_count() or 1) // cfg.num_generators))
                for first in range(0, len(mine), EVAL_CHUNK):
                    chunk = mine[first : first + EVAL_CHUNK]
                    greedy_Q[chunk] = torch.tensor(
                        self._score_questions(chunk, samples=1, greedy=True), dtype=torch.float64
                    )
                    if cfg.eval_samples:
                        sampled_Q[chunk] = torch.tensor(
                            self._score_questions(chunk, samples=cfg.eval_samples, greedy=False),
                            dtype=torch.float64,
                        )
                torch.set_num_threads(threads)
            for tensor in (greedy_Q, sampled_Q):
                dist.all_reduce(tensor)
            dist.all_reduce(version, op=dist.ReduceOp.MAX)
        result = EvalResult(
            policy_version=int(version),
            greedy_Q=greedy_Q.tolist(),
            sampled_Q=sampled_Q.tolist() if cfg.eval_samples else None,
        )
        if self.is_logger:
            sampled = f", sampled {result.sampled_accuracy:.3f}" if result.has_samples else ""
            self.logger.write(
                f"eval ({when}, policy_version {result.policy_version}): greedy accuracy "
                f"{result.accuracy:.3f}{sampled} on {num_questions} questions"
            )
            record = {"eval/accuracy": result.accuracy, "eval/policy_version": float(result.policy_version)}
            if result.has_samples:
                record["eval/sampled_accuracy"] = result.sampled_accuracy
            self.logger.log(self.trainer.policy_version, record, advance=False)
            self._eval_history.append(result)
        return result

    def _score_questions(self, indices: list[int], *, samples: int, greedy: bool) -> list[float]:
        """Generator rank: the mean reward of `samples` completions of each held-out question."""
        examples = [self.eval_examples[i] for i in indices]
        prompts = [self._chat_prompt(e) for e in examples]
        batch = self.generator.generate(
            prompts, samples_per_prompt=samples, max_new_tokens=self.config.max_new_tokens, greedy=greedy
        )
        references = [e.reference for e in examples for _ in range(samples)]
        scores = self.rewarder.score(self._decode_completions(batch), references)
        return [sum(scores[q * samples : (q + 1) * samples]) / samples for q in range(len(examples))]

    # ----------------------------------------------------------------------------------------------
    # helpers

    def _tokenized_prompt(self, index: int) -> list[int]:
        if index not in self._prompt_ids:
            self._prompt_ids[index] = self._chat_prompt(self.train_examples[index])
        return self._prompt_ids[index]

    def _chat_prompt(self, example: Example) -> list[int]:
        ids = self.tokenizer.apply_chat_template(
            self.task.messages(example), add_generation_prompt=True, tokenize=True
        )
        # Newer transformers return a BatchEncoding here; older ones a plain list.
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def _decode_completions(self, batch: RolloutBatch) -> list[str]:
        ids = [
            row[mask.bool()].tolist()
            for row, mask in zip(batch.completion_ids_BC, batch.completion_mask_BC, strict=True)
        ]
        return self.tokenizer.batch_decode(ids, skip_special_tokens=True)

    def _maybe_fail(self, tick: int, phase: str = "tick") -> None:
        if self._fault is None or self._fault[:2] != (self.rank, tick) or self._fault[3] != phase:
            return
        if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
            return  # the restarted run must get past the point where the first attempt failed
        if phase == "request":  # the engine dies in the middle of this request; the rank lives on
            pid = getattr(self.generator, "engine_pid", None)
            if pid is None:
                raise ValueError(
                    f"{FAULT_ENV}: the engine fault needs a generator with an engine (--generator vllm)"
                )
            threading.Timer(0.5, os.kill, args=(pid, signal.SIGKILL)).start()
            self._fault = None
            return
        # Tests measure how long the run takes to end after the fault, so record when it struck.
        marker = {"rank": self.rank, "tick": tick, "phase": phase, "time": time.time()}
        (self.output_dir / "errors" / "injected_fault.json").write_text(json.dumps(marker))
        if self._fault[2]:
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError(f"injected failure on rank {self.rank} at tick {tick}, {phase} ({FAULT_ENV})")

    def _write_trace(self) -> None:
        """Gathers every rank's phases on the trainer, which writes OUTPUT_DIR/trace.json."""
        gathered: list[list] | None = [[] for _ in range(self.world_size)] if self.is_logger else None
        dist.gather_object(self.timeline.spans, gathered, dst=TRAINER_RANK)
        if self.is_logger:
            roles = [
                ("trainer" if len(self.trainer_ranks) == 1 else f"trainer {r}")
                if r in self.trainer_ranks
                else f"generator {r}"
                for r in range(self.world_size)
            ]
            write_chrome_trace(self.output_dir / "trace.json", gathered, roles)

    def _gather_peak_rss_mb(self) -> list[float]:
        rss = torch.zeros(self.world_size, dtype=torch.float64)
        rss[self.rank] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
        dist.all_reduce(rss)
        return rss.tolist()

    def _summary(
        self,
        *,
        run_s: float,
        loop_s: float,
        peak_rss_mb: list[float],
    ) -> dict[str, Any]:
        cfg = self.config
        records = self._step_records
        # A resumed run's first step has no previous end to measure from (nan): left out.
        step_times = [r["time/step_s"] for r in records[1:] if r["time/step_s"] == r["time/step_s"]]
        total_tokens = sum(r["train/num_completion_tokens"] for r in records)
        syncs = [
            r["time/weight_sync_s"] for r in records if r["time/weight_sync_s"] == r["time/weight_sync_s"]
        ]
        syncs.append(self.trainer_role.last_sync_s)
        return {
            "mode": cfg.mode,
            "task": cfg.task,
            "model": cfg.model,
            "steps": len(records),
            "num_trainers": cfg.num_trainers,
            "num_generators": cfg.num_generators,
            "wall_s": run_s,  # replaced by the launcher with the whole command's wall time
            "run_s": run_s,  # evaluations and training on the ranks, after setup
            "loop_s": loop_s,  # the training ticks alone (evaluations inside the loop excluded)
            "step_time_s": sum(step_times) / len(step_times) if step_times else loop_s,
            "gen_tokens_per_s": total_tokens / loop_s,
            "num_completion_tokens": total_tokens,
            "generate_s_mean": _mean(r["time/generate_s"] for r in records),
            "train_s_mean": _mean(r["time/train_s"] for r in records),
            "trainer_tokens_per_s": _mean(r["throughput/trainer_tokens_per_s"] for r in records),
            "weight_sync_s": _mean(syncs),
            "train_reward_mean": [r["train/reward_mean"] for r in records],
            "policy_lag_max": max((r["policy/lag"] for r in records), default=float("nan")),
            "generator_idle_frac_mean": _mean(_finite(r.get("idle/generator_frac") for r in records)),
            "trainer_idle_frac_mean": _mean(_finite(r.get("idle/trainer_frac") for r in records)),
            "filtered_groups": sum(_finite(r.get("sampling/filtered_groups") for r in records)),
            "engine_restarts": sum(_finite(r.get("generator/engine_restarts") for r in records)),
            "weight_sync_failures": self.trainer_role.sync_failures,
            "sampled_groups": sum(_finite(r.get("sampling/groups") for r in records)),
            **({"stream": self._stream_counts} if self._stream_counts else {}),
            "eval_size": len(self.eval_examples),
            **_eval_summary(self._eval_history),
            "final_policy_version": self.trainer.policy_version,
            "resumed_from_step": None if self._resume is None else self._resume.step,
            "peak_rss_mb_per_rank": peak_rss_mb,
            "peak_rss_mb_total": sum(peak_rss_mb),
        }


def _eval_summary(history: list[EvalResult]) -> dict[str, Any]:
    """Start and end accuracies, their paired 95% confidence intervals of the change, every evaluation."""
    if not history:
        return {"eval_accuracy_start": None, "eval_accuracy_end": None}
    first, last = history[0], history[-1]
    summary: dict[str, Any] = {
        "eval_accuracy_start": first.accuracy,
        "eval_accuracy_end": last.accuracy,
        "eval_accuracy_delta_ci95": paired_delta_ci(first.greedy_Q, last.greedy_Q),
    }
    if first.has_samples:
        summary["eval_sampled_accuracy_start"] = first.sampled_accuracy
        summary["eval_sampled_accuracy_end"] = last.sampled_accuracy
        summary["eval_sampled_accuracy_delta_ci95"] = paired_delta_ci(first.sampled_Q, last.sampled_Q)
    summary["eval_history"] = [
        {"policy_version": r.policy_version, "accuracy": r.accuracy}
        | ({"sampled_accuracy": r.sampled_accuracy} if r.has_samples else {})
        for r in history
    ]
    return summary


def _save_model(model: torch.nn.Module, tokenizer, path: Path, state_dict: dict[str, torch.Tensor]) -> None:
    """Writes the policy (its gathered `state_dict`) as a transformers folder, atomically: a crash
    never leaves half a model."""
    import shutil

    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, state_dict=state_dict)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else float("nan")


def _finite(values) -> list[float]:
    """The values that are numbers (not None, not nan)."""
    return [v for v in values if v is not None and v == v]


def _device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    return torch.device("cpu")


def _parse_fault(spec: str | None) -> tuple[int, int, bool, str] | None:
    """(rank, tick, kill, phase) from "RANK:TICK[:kill][:checkpoint]" or "RANK:REQUEST:engine"."""
    if not spec:
        return None
    parts = spec.split(":")
    flags = set(parts[2:])
    phase = "checkpoint" if "checkpoint" in flags else "request" if "engine" in flags else "tick"
    return int(parts[0]), int(parts[1]), "kill" in flags, phase


def _plain(config: RunConfig) -> dict[str, Any]:
    return asdict(config)
