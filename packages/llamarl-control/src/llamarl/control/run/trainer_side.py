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
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO

import torch
import torch.distributed as dist

from llamarl.comm import WeightSender, WeightSyncEndpoint, WeightSyncGroup
from llamarl.control.launch.devices import generation_dtype, trainer_compute_dtype, weight_wire_dtype
from llamarl.control.outputs.metrics import MetricsLogger
from llamarl.control.outputs.report import write_report
from llamarl.control.outputs.summary import build_summary, write_summary
from llamarl.control.run import checkpoint as ckpt
from llamarl.control.run.channels.buffer import RolloutBuffer
from llamarl.control.run.channels.rollouts import concat_rollouts, recv_rollouts, send_rollouts
from llamarl.control.run.channels.stream import StreamControl, drain_into_buffer
from llamarl.control.run.channels.weights import FIRST_TRAINER_RANK, open_sender
from llamarl.control.run.evaluation import EvalResult
from llamarl.control.run.schedule import Tick
from llamarl.control.run.side import Side
from llamarl.control.run.trainer_loop import TrainerLoop
from llamarl.exec import PolicyTrainer
from llamarl.exec.types import RolloutBatch

TRAINED_LOG = "trained_groups.jsonl"  # OUTPUT_DIR/...: the groups each step trained on


class TrainerSide(Side):
    """A trainer rank."""

    side_name = "trainers"

    # Built by setup(); None until then, so that close() after a partial setup releases what exists.
    trainer: PolicyTrainer | None = None
    weight_group: WeightSyncGroup | None = None
    sender: WeightSender | None = None
    trained_log: TextIO | None = None  # first trainer rank: OUTPUT_DIR/trained_groups.jsonl

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
        self.stream_counts: dict[str, int] = {}  # stream mode: the buffer's counts at the end
        self.step_records: list[dict[str, float]] = []  # first trainer rank: every step's metrics
        self.evaluations: list[EvalResult] = []  # first trainer rank: every evaluation, in order
        # (this rank's part, the whole batch on the first rank) arrived, not yet trained on
        self._received: tuple[RolloutBatch, RolloutBatch] | None = None
        # Stream mode on the first trainer rank: the buffer, the shared counters and the batches
        # discarded after the run ended; a resumed run's saved buffer and counters until the stream starts.
        self._stream: tuple[RolloutBuffer, StreamControl, list[int]] | None = None
        self._restored_stream: dict[str, Any] | None = None

    def open_channels(self, endpoint: WeightSyncEndpoint | None) -> None:
        cfg = self.config
        assert endpoint is not None  # a trainer rank is a member of the weight channel
        self.weight_group, self.sender = open_sender(
            self.trainer.sync_tensors(),  # the model, or only its LoRA adapters
            endpoint,
            bucket_mb=cfg.weight_sync.bucket_mb,
            wire_dtype=weight_wire_dtype(generation_dtype(cfg.generator.precision, self.device)),
        )
        self.loop = TrainerLoop(
            trainer=self.trainer,
            send_weights=self.sender.send,
            max_policy_lag=cfg.schedule.max_policy_lag,
            timeline=self.timeline,
            paused_s=lambda: self._eval_s_in_loop,
            tolerate_sync_failures=cfg.replaces_engines,
        )
        if self.is_logger:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            saved = self.resumed.run_state if self.resumed is not None else {}
            if self.resumed is not None:  # lines written after the checkpoint are made again, so cut them
                ckpt.truncate(self.output_dir / "metrics.jsonl", saved["metrics_bytes"])
                ckpt.truncate(self.output_dir / TRAINED_LOG, saved.get("trained_bytes", 0))
            elif (self.output_dir / TRAINED_LOG).exists():
                (self.output_dir / TRAINED_LOG).unlink()  # a fresh run in an old output folder
            self.trained_log = (self.output_dir / TRAINED_LOG).open("a", encoding="utf-8")
            self.logger = MetricsLogger(
                output_dir=self.output_dir,
                total_steps=cfg.schedule.steps,
                config=cfg.model_dump(mode="json"),
                wandb_project=cfg.output.wandb_project if cfg.output.wandb else None,
                wandb_id=saved.get("wandb_id"),
                initial_step=saved.get("policy_version", 0),
            )

    def restore(self, resume: ckpt.Resume) -> None:
        ckpt.load_trainer(resume.found, self.trainer.model, self.trainer.optimizer, self.trainer_group)
        self.trainer.policy_version = resume.run_state["policy_version"]
        if self.is_logger:
            saved = resume.run_state
            self.step_records = saved["step_records"]
            self.evaluations = [EvalResult(**e) for e in saved["evaluations"]]
            self.loop.last_sync_s = saved["last_sync_s"]
            self.loop.generator_stats.restore(saved["generator_stats"])
            self._restored_stream = resume.rank_state.get("stream")
            self.logger.write(f"resumed from {resume.found.path} (policy_version {resume.found.step})")

    def checkpoint_state(self) -> dict[str, Any]:
        if self._stream is None:
            return {}
        buffer, control, discarded = self._stream
        # Taken while every generator is paused after its marker: nothing is in the channel, so the
        # buffer and the counters are the whole of the stream's state on this side.
        return {
            "stream": {"buffer": buffer.state(), "admission": control.counts(), "discarded": discarded[0]}
        }

    def run_state(self) -> dict[str, Any] | None:
        if not self.is_logger:
            return None
        return {
            "step_records": self.step_records,
            "evaluations": [e.as_dict() for e in self.evaluations],
            "last_sync_s": self.loop.last_sync_s,
            "generator_stats": self.loop.generator_stats.state(),
            "wandb_id": self.logger.wandb_id,
            "metrics_bytes": self.logger.jsonl_bytes(),
            "trained_bytes": self._trained_bytes(),
        }

    def _trained_bytes(self) -> int:
        assert self.trained_log is not None
        self.trained_log.flush()
        return self.trained_log.tell()

    def trainer_parts(self) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        assert self.trainer.model is not None and self.trainer.optimizer is not None
        return self.trainer.model, self.trainer.optimizer

    # ----------------------------------------------------------------------------------------------
    # lock step

    def move_rollouts(self, tick: Tick) -> None:
        """The first trainer rank receives every generator's batch and relays each other trainer rank
        its part (whole groups); the other trainer ranks receive their part from it."""
        if not self.is_logger:
            part, _ = recv_rollouts(src=FIRST_TRAINER_RANK)
            assert part is not None
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
            self.step_records.append(record)
            self.logger.log(self.trainer.policy_version, record)
            self._log_trained(whole)

    def _log_trained(self, whole: RolloutBatch) -> None:
        """One line of OUTPUT_DIR/trained_groups.jsonl: the groups this step trained on, by their
        prompts' positions in the data order, with the version that sampled each group's oldest token."""
        assert self.trained_log is not None and whole.prompt_position_B is not None
        G = whole.group_size
        line = {
            "step": self.trainer.policy_version,
            "positions": whole.prompt_position_B[::G].tolist(),
            # a sequence's first token is its oldest (versions only grow within a sequence)
            "oldest_versions": whole.policy_version_B.view(-1, G).min(1).values.tolist(),
        }
        self.trained_log.write(json.dumps(line) + "\n")
        self.trained_log.flush()

    # ----------------------------------------------------------------------------------------------
    # stream

    def run_stream(self) -> None:
        """The trainer takes groups still within max_policy_lag from the buffer the generators fill
        (in the order admission control admitted them: no group waits forever), trains, and sends the
        weights; after the steps where an evaluation or a checkpoint is due every rank pauses."""
        cfg = self.config
        steps = cfg.schedule.steps

        def strike(step: int) -> None:
            self.faults.strike(step)

        if not self.is_logger:  # another FSDP2 trainer rank: its part of every batch comes from rank 0

            def take_part() -> RolloutBatch:
                part, _ = recv_rollouts(src=FIRST_TRAINER_RANK)
                assert isinstance(part, RolloutBatch)
                return part

            def pause_too(version: int) -> None:
                for kind in self._pauses_due(version):
                    self.in_stream_pause(kind, version)

            dist.barrier()  # the first trainer rank set the shared counters
            self.loop.stream(
                steps=steps,
                take=take_part,
                relay=lambda b: b,
                control=None,
                on_step=self._log_step,
                first_step=self.start_tick,
                before_step=strike,
                generators_done=self.borrow_cores,
                after_step=pause_too,
            )
            return
        control = StreamControl(self.store)
        restored = self._restored_stream
        # Groups are taken in admission order; a checkpoint written before tickets resumes in arrival order.
        in_admission_order = restored is None or "next" in restored["buffer"]
        buffer = RolloutBuffer(
            capacity_groups=cfg.buffer_groups,
            max_policy_lag=cfg.schedule.max_policy_lag,
            ticket_of=control.ticket_of if in_admission_order else None,
        )
        discarded = [0]
        if restored is not None:  # the groups buffered at the checkpoint, and the counters
            buffer.restore(restored["buffer"])
            control.restore_counts(restored["admission"])
            discarded[0] = restored["discarded"]
        self._stream = (buffer, control, discarded)
        dist.barrier()  # generators admit requests only once the counters are set
        errors: list[BaseException] = []

        def drain(src: int) -> None:
            try:
                discarded[0] += drain_into_buffer(
                    buffer,
                    lambda: recv_rollouts(**self._rollout_source(src), group=self.rollout_group),
                    lambda metrics: self.loop.generator_stats.update(src, metrics),
                    timeout_s=cfg.launch.timeout_s,
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

        @contextmanager
        def drain_errors() -> Iterator[None]:
            """A wait on the buffer that fails because a receiving thread failed raises its error."""
            try:
                yield
            except Exception as e:
                if errors:
                    raise errors[0] from e
                raise

        def take() -> RolloutBatch:
            consumed = buffer.counts.taken + buffer.counts.dropped_stale
            with drain_errors():
                batch = buffer.take(
                    cfg.schedule.prompts_per_step,
                    current_version=self.trainer.policy_version,
                    timeout_s=cfg.launch.timeout_s,
                    on_wait=lambda: self.loop.answer_weight_requests(control),
                )
            control.consumed(buffer.counts.taken + buffer.counts.dropped_stale - consumed)
            return batch

        def on_step(record: dict[str, float], whole: RolloutBatch) -> None:
            record["stream/dropped_stale_groups"] = float(buffer.counts.dropped_stale)
            record["stream/buffered_groups"] = float(len(buffer))
            self._log_step(record, whole)

        def pause(version: int) -> None:
            for kind in self._pauses_due(version):
                markers = buffer.counts.markers + len(self.generator_ranks)
                buffer.hold(True)  # the generators' sends never wait on a paused trainer
                control.request_pause(kind, version)
                if kind == "checkpoint":  # every generator sent all it had: the channel is empty
                    with drain_errors():
                        # A generator whose engine died asks for weights before it can pause.
                        buffer.wait_for_markers(
                            markers,
                            timeout_s=cfg.launch.timeout_s,
                            on_wait=lambda: self.loop.answer_weight_requests(control),
                        )
                self.in_stream_pause(kind, version)
                buffer.hold(False)

        self.loop.stream(
            steps=steps,
            take=take,
            relay=self._split_across_trainers,
            control=control,
            on_step=on_step,
            first_step=self.start_tick,
            before_step=strike,
            generators_done=self.borrow_cores,
            after_step=pause,
        )
        buffer.close()  # what still arrives is received and discarded until every generator ends
        for thread in threads:
            thread.join(cfg.launch.timeout_s)
            if thread.is_alive():
                raise TimeoutError(f"{thread.name}: a generator did not end its stream in time")
        if errors:
            raise errors[0]
        counts = buffer.counts
        self.stream_counts = {
            "dropped_stale_groups": counts.dropped_stale,
            "received_groups": counts.received,
            "unused_groups": counts.received - counts.taken - counts.dropped_stale,
            "discarded_groups": discarded[0],  # arrived after the last step: sampled, never trained
            "dropped_stale_frac": counts.dropped_stale / max(1, counts.taken + counts.dropped_stale),
        }

    def _pauses_due(self, policy_version: int) -> list[str]:
        """The pauses after the step that made `policy_version`, in order (an evaluation first, so that
        a checkpoint taken there holds its result)."""
        due = ["eval"] if self.eval_due_in_stream(policy_version) else []
        return due + (["checkpoint"] if self.checkpoint_due(policy_version) else [])

    # ----------------------------------------------------------------------------------------------
    # the end

    def save_final_model(self) -> None:
        if not self.config.output.save_model:
            return
        state_dict = self.trainer.full_state_dict()  # a collective over the trainer ranks
        if self.is_logger:
            _save_model(self.trainer.model, self.tokenizer, self.output_dir / "final_model", state_dict)

    def record_evaluation(self, result: EvalResult, when: str) -> None:
        if not self.is_logger:
            return
        sampled = f", sampled {result.sampled_accuracy:.3f}" if result.has_samples else ""
        self.logger.write(
            f"eval ({when}, policy_version {result.policy_version}): greedy accuracy "
            f"{result.accuracy:.3f}{sampled} on {len(result.greedy_Q)} questions"
        )
        record = {"eval/accuracy": result.accuracy, "eval/policy_version": float(result.policy_version)}
        if result.has_samples:
            record["eval/sampled_accuracy"] = result.sampled_accuracy
        self.logger.log(self.trainer.policy_version, record, advance=False)
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
            stream_counts=self.stream_counts,
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


def _save_model(model: torch.nn.Module, tokenizer, path: Path, state_dict: dict[str, torch.Tensor]) -> None:
    """Writes the policy (its gathered `state_dict`) as a transformers folder, atomically: a crash never
    leaves half a model."""
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, state_dict=state_dict)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)
