"""The trainer side of a run: ranks 0..N-1, each with a `PolicyTrainer` (FSDP2 over the trainer ranks'
group when N > 1 or on CUDA) and a `TrainerLoop`.

The first trainer rank receives every generator's rollouts and relays each other trainer rank its part
(whole groups), logs the metrics and which groups each step trained on (OUTPUT_DIR/trained_groups.jsonl,
by their positions in the data order), keeps the histories that checkpoints and the summary need, and
writes the summary, the report and the final model. Every trainer rank sends its own shards of the weights to
the generators (llamarl.comm: nothing is gathered).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, TextIO

import torch

from llamarl.comm import WeightSender, WeightSyncEndpoint, WeightSyncGroup
from llamarl.control.launch.devices import (
    changed_only_syncs,
    generation_dtype,
    trainer_compute_dtype,
    weight_wire_dtype,
)
from llamarl.control.launch.failures import last_checkpoint_note
from llamarl.control.outputs.metrics import MetricsLogger
from llamarl.control.outputs.report import write_report
from llamarl.control.outputs.summary import build_summary, write_summary
from llamarl.control.run import checkpoint as ckpt
from llamarl.control.run import legacy_checkpoints as legacy
from llamarl.control.run.channels.buffer import RolloutBuffer
from llamarl.control.run.channels.rollouts import concat_rollouts, recv_rollouts, send_rollouts
from llamarl.control.run.channels.stream import PauseServer, StreamControl
from llamarl.control.run.channels.weights import FIRST_TRAINER_RANK, open_sender
from llamarl.control.run.evaluation import EvalResult
from llamarl.control.run.rank_states import TrainerRankState, TrainerRunState
from llamarl.control.run.refused_steps import RefusedSteps, TrainingStopped
from llamarl.control.run.schedule import Tick
from llamarl.control.run.side import Side
from llamarl.control.run.trainer_intake import Message, RelayedIntake, TrainerIntake
from llamarl.control.run.trainer_loop import TrainerLoop
from llamarl.exec import PolicyTrainer
from llamarl.exec.types import RolloutBatch


class TrainerSide(Side):
    """A trainer rank."""

    side_name = "trainers"

    # Built by setup(); None until then, so that close() after a partial setup releases what exists.
    trainer: PolicyTrainer | None = None
    weight_group: WeightSyncGroup | None = None
    sender: WeightSender | None = None
    trained_log: TrainedGroupsLog | None = None  # first trainer rank: OUTPUT_DIR/trained_groups.jsonl
    loop: TrainerLoop
    logger: MetricsLogger  # first trainer rank

    def init_state(self) -> None:
        self.step_records: list[dict[str, float]] = []  # first trainer rank: every step's metrics
        self.evaluations: list[EvalResult] = []  # first trainer rank: every evaluation, in order
        # Lock step: (this rank's part, the whole batch on the first rank) arrived, not yet trained on.
        self._received: tuple[RolloutBatch, RolloutBatch] | None = None
        # Stream mode: where the batches come from (the buffer on the first trainer rank, its relay on
        # the others), built with the channels so that a resumed run restores it before the stream.
        self.intake: TrainerIntake | RelayedIntake | None = None

    def build_executors(self) -> None:
        cfg = self.config
        # FSDP2 with several trainer ranks, and on CUDA always (its mixed precision keeps fp32 master
        # weights while computing in bf16); one CPU rank trains the plain module (in bf16 through a
        # compute copy of the fp32 master weights, where the CPU has bf16).
        sharded = cfg.ranks.num_trainers > 1 or self.device.type == "cuda"
        self.trainer = PolicyTrainer(
            cfg.model,
            cfg.trainer,
            cfg.algorithm,
            temperature=cfg.sampling.temperature,
            total_steps=cfg.schedule.steps,
            device=str(self.device),
            compute_dtype=trainer_compute_dtype(cfg.trainer.precision, self.device),
            seed=cfg.seed,
            group=self.trainer_group if sharded else None,
        )
        self.trainer.setup()

    def open_channels(self, endpoint: WeightSyncEndpoint | None) -> None:
        cfg = self.config
        assert endpoint is not None  # a trainer rank is a member of the weight channel
        self.weight_group, self.sender = open_sender(
            self.trainer.sync_tensors(),  # the model, or only its LoRA adapters
            endpoint,
            bucket_mb=cfg.weight_sync.bucket_mb,
            wire_dtype=weight_wire_dtype(generation_dtype(cfg.generator.precision, self.device)),
            delta=changed_only_syncs(cfg),
        )
        self.loop = TrainerLoop(
            trainer=self.trainer,
            send_weights=self.sender.send,
            max_policy_lag=cfg.schedule.max_policy_lag,
            timeline=self.timeline,
            paused_s=lambda: self._eval_s_in_loop,
            tolerate_sync_failures=cfg.replaces_engines,
            before_step=self.faults.strike,
            generators_done=self.borrow_cores,
            on_step=self._log_step,
            refused=RefusedSteps(
                cfg.trainer.max_refused_steps, lambda: last_checkpoint_note(self.output_dir)
            ),
        )
        if cfg.schedule.mode == "stream":
            self.intake = self._open_intake()
        if self.is_logger:
            self._open_logs()

    def _open_logs(self) -> None:
        """The first trainer rank's metrics and trained-groups logs (cut back to the checkpoint's lengths
        on resume: the lines written after it are made again)."""
        cfg = self.config
        self.output_dir.mkdir(parents=True, exist_ok=True)
        saved = None if self.resumed is None else TrainerRunState.from_dict(self.resumed.run_state)
        if saved is not None:
            ckpt.truncate(self.output_dir / "metrics.jsonl", saved.metrics_bytes)
        self.trained_log = TrainedGroupsLog(self.output_dir, None if saved is None else saved.trained_bytes)
        self.logger = MetricsLogger(
            output_dir=self.output_dir,
            total_steps=cfg.schedule.steps,
            config=cfg.model_dump(mode="json"),
            wandb_project=cfg.output.wandb_project if cfg.output.wandb else None,
            wandb_id=None if saved is None else saved.wandb_id,
            initial_step=0 if self.resumed is None else self.resumed.policy_version,
        )

    def _open_intake(self) -> TrainerIntake | RelayedIntake:
        """Stream mode: where this rank's batches come from (`llamarl.control.run.trainer_intake`)."""
        cfg = self.config
        pauses = PauseServer(self.in_stream_pause)
        if not self.is_logger:  # another FSDP2 trainer rank: its part of every batch comes from rank 0
            return RelayedIntake(receive=self._receive_part, pauses=pauses, plan=self.plan)
        control = StreamControl(self.store)
        return TrainerIntake(
            control=control,
            buffer=RolloutBuffer(
                capacity_groups=cfg.buffer_groups,
                max_policy_lag=cfg.schedule.max_policy_lag,
                ticket_of=control.ticket_of,  # groups are taken in admission order
            ),
            generators=self.generator_ranks,
            receive=self._stream_from,
            stats=self.loop.generator_stats,
            relay=self._split_across_trainers,
            send_weights=self.loop.send_weights,
            pauses=pauses,
            plan=self.plan,
            prompts_per_step=cfg.schedule.prompts_per_step,
            timeout_s=cfg.launch.timeout_s,
        )

    def restore(self, resume: ckpt.Resume) -> None:
        ckpt.load_trainer(resume.found, self.trainer.model, self.trainer.optimizer, self.trainer_group)
        self.trainer.policy_version = resume.policy_version
        mine = TrainerRankState.from_dict(resume.rank_state)
        if self.intake is not None:  # stream mode: the buffered groups and the shared counters
            self.intake.restore(mine.intake)
        if self.is_logger:
            saved = TrainerRunState.from_dict(resume.run_state)
            self.step_records = saved.step_records
            self.evaluations = [EvalResult(**legacy.evaluation(e)) for e in saved.evaluations]
            self.loop.last_sync_s = saved.last_sync_s
            self.loop.generator_stats.restore(saved.generator_stats)
            self.logger.write(f"resumed from {resume.found.path} (policy_version {resume.found.step})")

    def checkpoint_state(self) -> TrainerRankState:
        return TrainerRankState(intake=None if self.intake is None else self.intake.state())

    def run_state(self) -> TrainerRunState | None:
        if not self.is_logger:
            return None
        return TrainerRunState(
            step_records=self.step_records,
            evaluations=[e.as_dict() for e in self.evaluations],
            last_sync_s=self.loop.last_sync_s,
            generator_stats=self.loop.generator_stats.state(),
            wandb_id=self.logger.wandb_id,
            metrics_bytes=self.logger.jsonl_bytes(),
            trained_bytes=self.trained_log.length(),
        )

    def trainer_parts(self) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        assert self.trainer.model is not None and self.trainer.optimizer is not None
        return self.trainer.model, self.trainer.optimizer

    # ----------------------------------------------------------------------------------------------
    # lock step

    def move_rollouts(self, tick: Tick) -> None:
        """The first trainer rank receives every generator's batch and relays each other trainer rank
        its part (whole groups); the other trainer ranks receive their part from it."""
        if not self.is_logger:
            part = self._receive_part()
            self._received = (part, part)
            return
        batches = []
        for r in self.generator_ranks:
            batch, metrics = recv_rollouts(**self._rollout_source(r))
            assert batch is not None
            self.loop.generator_stats.update(r, metrics)
            batches.append(batch)
        whole = concat_rollouts(batches)
        self._received = (self._split_across_trainers(whole), whole)

    def _rollout_source(self, generator: int) -> dict[str, int]:
        """Where generator `generator`'s batches come from: the generator itself, or its reward rank
        (which forwards several generators' batches, tagged by the generator's rank)."""
        reward_rank = self.config.reward_rank_of(generator)
        return {"src": generator} if reward_rank is None else {"src": reward_rank, "tag": generator}

    def _stream_from(self, generator: int) -> Message:
        """Stream mode: the next message of generator `generator`'s stream, on the rollout group."""
        return recv_rollouts(**self._rollout_source(generator), group=self.rollout_group)

    def _receive_part(self) -> RolloutBatch:
        """A trainer rank other than the first: its part of the batch, from the first."""
        part, _ = recv_rollouts(src=FIRST_TRAINER_RANK)
        assert isinstance(part, RolloutBatch)
        return part

    def _split_across_trainers(self, batch: RolloutBatch) -> RolloutBatch:
        """Sends trainer rank r its part r of `batch`; returns this rank's part. Rollouts are small next
        to weights, so one rank relays them."""
        num_trainers = len(self.trainer_ranks)
        for r in self.trainer_ranks[1:]:
            send_rollouts(batch.data_parallel_part(r, num_trainers), {}, dst=r)
        return batch.data_parallel_part(0, num_trainers)

    def sync_weights(self) -> None:
        self.loop.tick = self.tick
        self.loop.send_weights()

    def train(self, tick: Tick) -> None:
        assert self._received is not None, "no batch to train on"
        part, whole = self._received
        self._received = None
        self.loop.tick = tick.index
        self._log_step(self.loop.train(part, whole), whole)

    def _log_step(self, record: dict[str, float], whole: RolloutBatch) -> None:
        if self.is_logger:
            if self.loop.refusal is not None:
                self.logger.write(f"warning: {self.loop.refusal}")
            self.step_records.append(record)
            self.logger.log(self.trainer.policy_version, record)
            self.trained_log.write(self.trainer.policy_version, whole)

    # ----------------------------------------------------------------------------------------------
    # stream

    def run_stream(self) -> None:
        """The trainer takes groups still within max_policy_lag from the buffer the generators fill (in
        the order admission control admitted them: no group waits forever), trains, and sends the
        weights; after the steps where an evaluation or a checkpoint is due every rank pauses."""
        assert self.intake is not None
        self.loop.stream(self.intake, steps=self.config.schedule.steps, first_step=self.start_tick)

    # ----------------------------------------------------------------------------------------------
    # the end

    def save_final_model(self) -> None:
        if not self.config.output.save_model:
            return
        state_dict = self.trainer.full_state_dict()  # a collective over the trainer ranks
        if not self.is_logger:
            return
        # Never a model that would only produce NaN (the trainer refuses non-finite updates; this
        # guards the initial weights and anything else that reached them).
        bad = next(
            (name for name, tensor in state_dict.items() if not bool(torch.isfinite(tensor).all())), None
        )
        if bad is not None:
            raise TrainingStopped(
                f"the final model has non-finite values ({bad}): it was not written; "
                f"{last_checkpoint_note(self.output_dir)}"
            )
        _save_model(self.trainer.model, self.tokenizer, self.output_dir / "final_model", state_dict)

    def record_evaluation(self, result: EvalResult, when: str) -> None:
        if not self.is_logger:
            return
        self.logger.write(f"eval ({when}, policy_version {result.policy_version}): {result.describe()}")
        self.logger.log(self.trainer.policy_version, result.metrics(), advance=False)
        self.evaluations.append(result)

    def summarize(
        self, *, run_s: float, loop_s: float, memory: list[dict[str, Any]]
    ) -> dict[str, Any] | None:
        if not self.is_logger:
            return None
        summary = build_summary(
            self.config,
            records=self.step_records,
            evaluations=self.evaluations,
            eval_size=len(self.eval_examples),
            last_sync_s=self.loop.last_sync_s,
            sync_failures=self.loop.sync_failures,
            stream_counts={} if self.intake is None else self.intake.final_counts(),
            final_policy_version=self.trainer.policy_version,
            resumed_from_step=None if self.resumed is None else self.resumed.found.step,
            run_s=run_s,
            loop_s=loop_s,
            memory=memory,
        )
        write_summary(self.output_dir, summary)
        self.logger.close(summary)
        summary["wandb_dir"] = self.logger.wandb_dir
        if not self.draw_report:
            return summary
        try:
            write_report(self.output_dir)
        except Exception as e:  # a picture must never fail a finished run
            self.logger.write(f"warning: could not draw {self.output_dir / 'report.png'}: {e}")
        return summary

    def close(self) -> None:
        for part in (self.sender, self.weight_group, self.trainer, self.trained_log):
            if part is not None:
                part.close()


class TrainedGroupsLog:
    """OUTPUT_DIR/trained_groups.jsonl: a line a step, the groups it trained on, by their prompts'
    positions in the data order, with the version that sampled each group's oldest token. On resume it is
    cut back to its length at the checkpoint (`length`: the steps after it are trained again)."""

    NAME = "trained_groups.jsonl"

    def __init__(self, output_dir: Path, resumed_length: int | None) -> None:
        path = output_dir / self.NAME
        if resumed_length is not None:
            ckpt.truncate(path, resumed_length)
        elif path.exists():
            path.unlink()  # a fresh run in an old output folder
        self._file: TextIO = path.open("a", encoding="utf-8")

    def write(self, step: int, whole: RolloutBatch) -> None:
        """The line of the step that made version `step` from the batch `whole`."""
        assert whole.prompt_position_B is not None
        G = whole.group_size
        line = {
            "step": step,
            "positions": whole.prompt_position_B[::G].tolist(),
            # a sequence's first token is its oldest (versions only grow within a sequence)
            "oldest_versions": whole.policy_version_B.view(-1, G).min(1).values.tolist(),
        }
        self._file.write(json.dumps(line) + "\n")
        self._file.flush()

    def length(self) -> int:
        """Bytes written so far (what a checkpoint keeps)."""
        self._file.flush()
        return self._file.tell()

    def close(self) -> None:
        self._file.close()


def _save_model(model: torch.nn.Module, tokenizer, path: Path, state_dict: dict[str, torch.Tensor]) -> None:
    """Writes the policy (its gathered `state_dict`) as a transformers folder, atomically: a crash never
    leaves half a model."""
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, state_dict=state_dict)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)
