"""The single controller: the SPMD tick loop that every rank runs.

Rank 0 is the trainer (and logs metrics); ranks 1..G are generators, each scoring its own completions
with a rewarder in worker processes. In every tick the channels first move what the previous tick
produced (rollouts generator -> trainer, weights trainer -> generator), then every executor does its
own step. In `async` mode generation and training of a tick run at the same time on their own ranks, so
the trainer learns from rollouts sampled by the previous policy version; `sync` mode runs the same
pieces in sequence (generate, score, train, sync): the synchronous baseline on the same work.
"""

from __future__ import annotations

import json
import os
import random
import resource
import signal
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from llamarl.comm import WeightSender, WeightSyncGroup
from llamarl.control.channels import concat_rollouts, recv_rollouts, send_rollouts
from llamarl.control.config import RunConfig
from llamarl.control.executors import (
    build_generator,
    build_rewarder,
    build_trainer,
    load_tokenizer,
    open_weight_receiver,
)
from llamarl.control.metrics import MetricsLogger
from llamarl.control.net import free_port
from llamarl.control.tasks import TASKS, Example
from llamarl.exec.types import RolloutBatch

TRAINER_RANK = 0
EVAL_CHUNK = 32  # prompts per greedy generate call during evaluation
FAULT_ENV = "LLAMARL_FAULT"  # "RANK:TICK" raises on that rank at that tick, "RANK:TICK:kill" kills it


class PolicyLagError(RuntimeError):
    """Rollouts older than max_policy_lag reached the trainer."""


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
        self.is_trainer = self.rank == TRAINER_RANK
        self.generator_ranks = list(range(1, self.world_size))
        self.generator_index = self.rank - 1  # this rank's index among generators (-1 on the trainer)
        self._prompt_order = list(range(len(train_examples)))
        random.Random(config.seed).shuffle(self._prompt_order)
        self._prompt_ids: dict[int, list[int]] = {}
        self._pending: tuple[RolloutBatch, dict[str, float]] | None = None  # generator: made, not yet sent
        self._received: tuple[RolloutBatch, dict[str, float]] | None = None  # trainer: arrived, not trained
        self._fault = _parse_fault(os.environ.get(FAULT_ENV))
        self._step_records: list[dict[str, float]] = []
        self._last_sync_s = float("nan")
        self._train_end_times: list[float] = []

    # ----------------------------------------------------------------------------------------------
    # lifecycle

    def setup(self) -> None:
        """Loads the model on every rank, builds the executors and the weight-sync group."""
        cfg = self.config
        device = _device(cfg.device)
        torch.manual_seed(cfg.seed + self.rank)
        self.tokenizer = load_tokenizer(cfg.model)
        if self.is_trainer:
            self.trainer = build_trainer(cfg, device)
            self.trainer.setup()
        else:
            self.generator = build_generator(cfg, device, seed=cfg.seed + self.rank, rank=self.rank)
            self.generator.setup()
            self.rewarder = build_rewarder(cfg)
        # The weight-sync group has its own store on a port chosen by the trainer: it never depends on
        # the default process group, which here only carries rollouts and small control messages.
        port = torch.tensor([free_port() if self.is_trainer else 0], dtype=torch.int64)
        dist.broadcast(port, TRAINER_RANK)
        group_args = dict(
            host=os.environ.get("MASTER_ADDR", "127.0.0.1"),
            port=int(port.item()),
            rank=self.rank,
            world_size=self.world_size,
            timeout_s=cfg.timeout_s,
        )
        if self.is_trainer:
            self.weight_group = WeightSyncGroup(**group_args)
            bucket_bytes = cfg.weight_bucket_mb << 20
            self.sender = WeightSender(self.weight_group, self.trainer.model, bucket_bytes=bucket_bytes)
            self.output_dir.mkdir(parents=True, exist_ok=True)
            self.logger = MetricsLogger(
                output_dir=self.output_dir,
                total_steps=cfg.steps,
                config=_plain(cfg),
                wandb_project=cfg.wandb_project if cfg.wandb else None,
            )
        else:
            # A vLLM generator's engine joins in this rank's place and receives straight from the trainer.
            self.receiver = open_weight_receiver(self.generator, **group_args, src_rank=TRAINER_RANK)
            self._samples = (self.output_dir / f"samples.rank{self.rank}.jsonl").open("a", encoding="utf-8")

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
        eval_start = self._evaluate("start")
        loop_start = time.perf_counter()
        if cfg.mode == "async":
            # Tick t: move batch t-1 and weights of version t-1, then generate batch t while the
            # trainer trains on batch t-1 (sampled by version t-2): one policy version off.
            for tick in range(cfg.steps + 1):
                self._maybe_fail(tick)
                if tick >= 1:
                    self._move_rollouts()
                if tick >= 2:
                    self._sync_weights()
                if tick < cfg.steps:
                    self._generate(tick)
                if tick >= 1:
                    self._train()
            self._sync_weights()  # the generators serve the final policy for evaluation
        else:
            for tick in range(cfg.steps):
                self._maybe_fail(tick)
                self._generate(tick)
                self._move_rollouts()
                self._train()
                self._sync_weights()
        loop_s = time.perf_counter() - loop_start
        if self.is_trainer and cfg.save_model:
            _save_model(self.trainer.model, self.tokenizer, self.output_dir / "final_model")
        eval_end = self._evaluate("end")
        peak_rss_mb = self._gather_peak_rss_mb()
        if not self.is_trainer:
            return None
        summary = self._summary(
            run_s=time.perf_counter() - run_start,
            loop_s=loop_s,
            eval_start=eval_start,
            eval_end=eval_end,
            peak_rss_mb=peak_rss_mb,
        )
        (self.output_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        self.logger.close(summary)
        summary["wandb_dir"] = self.logger.wandb_dir
        return summary

    def _generate(self, tick: int) -> None:
        """Generator ranks: sample this tick's prompts, score them, keep the batch for the channel."""
        if self.is_trainer:
            return
        cfg = self.config
        per_generator = cfg.prompts_per_step // cfg.num_generators
        first = tick * cfg.prompts_per_step + self.generator_index * per_generator
        indices = [self._prompt_order[(first + j) % len(self._prompt_order)] for j in range(per_generator)]
        prompts = [self._tokenized_prompt(i) for i in indices]
        start = time.perf_counter()
        batch = self.generator.generate(
            prompts, samples_per_prompt=cfg.samples_per_prompt, max_new_tokens=cfg.max_new_tokens
        )
        generate_s = time.perf_counter() - start
        texts = self._decode_completions(batch)
        references = [
            self.train_examples[i].reference for i in indices for _ in range(cfg.samples_per_prompt)
        ]
        start = time.perf_counter()
        batch.rewards_B = torch.tensor(self.rewarder.score(texts, references), dtype=torch.float32)
        score_s = time.perf_counter() - start
        for j, text in enumerate(texts):
            record = {
                "tick": tick,
                "policy_version": int(batch.policy_version_B[j]),
                "question": self.train_examples[indices[j // cfg.samples_per_prompt]].question,
                "completion": text,
                "reward": float(batch.rewards_B[j]),
            }
            self._samples.write(json.dumps(record) + "\n")
        self._samples.flush()
        metrics = {
            "generate_s": generate_s,
            "score_s": score_s,
            "num_completion_tokens": batch.num_completion_tokens,
            "reward_mean": float(batch.rewards_B.mean()),
            "policy_version": self.generator.policy_version,
        }
        self._pending = (batch, metrics)

    def _move_rollouts(self) -> None:
        """Generators send the batch they made; the trainer receives one from each generator."""
        if not self.is_trainer:
            assert self._pending is not None, "no batch to send"
            send_rollouts(*self._pending, dst=TRAINER_RANK)
            self._pending = None
            return
        parts = [recv_rollouts(src=r) for r in self.generator_ranks]
        batch = concat_rollouts([b for b, _ in parts])
        tokens = sum(m["num_completion_tokens"] for _, m in parts)
        metrics = {
            "generate_s": max(m["generate_s"] for _, m in parts),
            "score_s": max(m["score_s"] for _, m in parts),
            "num_completion_tokens": tokens,
            "reward_mean": float(batch.rewards_B.mean()),
        }
        self._received = (batch, metrics)

    def _train(self) -> None:
        """Trainer: one optimizer step on the received batch, then log the step."""
        if not self.is_trainer:
            return
        assert self._received is not None, "no batch to train on"
        batch, gen_metrics = self._received
        self._received = None
        lag = self.trainer.policy_version - int(batch.policy_version_B.min())
        if lag > self.config.max_policy_lag:
            raise PolicyLagError(
                f"rollouts are {lag} policy versions old (max_policy_lag={self.config.max_policy_lag})"
            )
        start = time.perf_counter()
        train_metrics = self.trainer.train_step(batch)
        now = time.perf_counter()
        train_s = now - start
        step_s = now - self._train_end_times[-1] if self._train_end_times else float("nan")
        self._train_end_times.append(now)
        step = self.trainer.policy_version
        tokens = gen_metrics["num_completion_tokens"]
        record = {
            "train/reward_mean": gen_metrics["reward_mean"],
            "time/step_s": step_s,
            "time/train_s": train_s,
            "time/generate_s": gen_metrics["generate_s"],
            "time/score_s": gen_metrics["score_s"],
            "time/weight_sync_s": self._last_sync_s,
            "throughput/generated_tokens_per_s": tokens / step_s if step_s == step_s else float("nan"),
            "throughput/generator_tokens_per_s": tokens / gen_metrics["generate_s"],
            "throughput/trainer_tokens_per_s": tokens / train_s,
            "policy/lag": float(lag),
            "policy/version": float(step),
            "train/num_completion_tokens": float(tokens),
            **{f"train/{k}": v for k, v in train_metrics.items()},
        }
        self._step_records.append(record)
        self.logger.log(step, record)

    def _sync_weights(self) -> None:
        """Trainer sends its current weights; every generator receives them and takes their version."""
        start = time.perf_counter()
        if self.is_trainer:
            self.sender.send(self.trainer.policy_version)
            self._last_sync_s = time.perf_counter() - start
        else:
            self.generator.policy_version = self.receiver.receive()

    def _evaluate(self, when: str) -> float | None:
        """Greedy accuracy on the held-out questions, split across generators; None when eval_size is 0."""
        if not self.eval_examples:
            return None
        counts = torch.zeros(2, dtype=torch.float64)  # correct, total
        if not self.is_trainer:
            mine = self.eval_examples[self.generator_index :: self.config.num_generators]
            # The trainer idles during evaluation, so the generators may use its cores too.
            threads = torch.get_num_threads()
            torch.set_num_threads(max(threads, (os.cpu_count() or 1) // self.config.num_generators))
            for first in range(0, len(mine), EVAL_CHUNK):
                chunk = mine[first : first + EVAL_CHUNK]
                prompts = [self._chat_prompt(e) for e in chunk]
                batch = self.generator.generate(
                    prompts, samples_per_prompt=1, max_new_tokens=self.config.max_new_tokens, greedy=True
                )
                scores = self.rewarder.score(self._decode_completions(batch), [e.reference for e in chunk])
                counts += torch.tensor([sum(s > 0.5 for s in scores), len(chunk)], dtype=torch.float64)
            torch.set_num_threads(threads)
        dist.all_reduce(counts)
        accuracy = float(counts[0] / counts[1])
        if self.is_trainer:
            self.logger.write(f"eval ({when}): accuracy {accuracy:.3f} on {int(counts[1])} questions")
        return accuracy

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

    def _maybe_fail(self, tick: int) -> None:
        if self._fault is None or self._fault[:2] != (self.rank, tick):
            return
        # Tests measure how long the run takes to end after the fault, so record when it struck.
        marker = {"rank": self.rank, "tick": tick, "time": time.time()}
        (self.output_dir / "errors" / "injected_fault.json").write_text(json.dumps(marker))
        if self._fault[2]:
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError(f"injected failure on rank {self.rank} at tick {tick} ({FAULT_ENV})")

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
        eval_start: float | None,
        eval_end: float | None,
        peak_rss_mb: list[float],
    ) -> dict[str, Any]:
        cfg = self.config
        records = self._step_records
        step_times = [r["time/step_s"] for r in records[1:]]
        total_tokens = sum(r["train/num_completion_tokens"] for r in records)
        syncs = [
            r["time/weight_sync_s"] for r in records if r["time/weight_sync_s"] == r["time/weight_sync_s"]
        ]
        syncs.append(self._last_sync_s)
        return {
            "mode": cfg.mode,
            "task": cfg.task,
            "model": cfg.model,
            "steps": len(records),
            "num_generators": cfg.num_generators,
            "wall_s": run_s,  # replaced by the launcher with the whole command's wall time
            "run_s": run_s,  # evaluations and training on the ranks, after setup
            "loop_s": loop_s,  # the training ticks alone
            "step_time_s": sum(step_times) / len(step_times) if step_times else loop_s,
            "gen_tokens_per_s": total_tokens / loop_s,
            "num_completion_tokens": total_tokens,
            "generate_s_mean": _mean(r["time/generate_s"] for r in records),
            "train_s_mean": _mean(r["time/train_s"] for r in records),
            "trainer_tokens_per_s": _mean(r["throughput/trainer_tokens_per_s"] for r in records),
            "weight_sync_s": _mean(syncs),
            "train_reward_mean": [r["train/reward_mean"] for r in records],
            "eval_size": len(self.eval_examples),
            "eval_accuracy_start": eval_start,
            "eval_accuracy_end": eval_end,
            "final_policy_version": self.trainer.policy_version,
            "peak_rss_mb_per_rank": peak_rss_mb,
            "peak_rss_mb_total": sum(peak_rss_mb),
        }


def _save_model(model: torch.nn.Module, tokenizer, path: Path) -> None:
    """Writes the policy as a transformers folder, atomically: a crash never leaves half a model."""
    import shutil

    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else float("nan")


def _device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    return torch.device("cpu")


def _parse_fault(spec: str | None) -> tuple[int, int, bool] | None:
    if not spec:
        return None
    parts = spec.split(":")
    return int(parts[0]), int(parts[1]), len(parts) > 2 and parts[2] == "kill"


def _plain(config: RunConfig) -> dict[str, Any]:
    return asdict(config)
