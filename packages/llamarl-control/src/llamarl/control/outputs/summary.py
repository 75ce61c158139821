"""A run's summary (OUTPUT_DIR/summary.json): its headline figures, from the step records and evaluations
the first trainer rank kept."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from llamarl.control.config import RunConfig
from llamarl.control.run.evaluation import EvalResult, paired_delta_ci
from llamarl.control.launch.memory import memory_summary


def build_summary(
    config: RunConfig,
    *,
    records: list[dict[str, float]],
    evaluations: list[EvalResult],
    eval_size: int,
    last_sync_s: float,
    sync_failures: int,
    stream_counts: dict[str, int],
    final_policy_version: int,
    resumed_from_step: int | None,
    run_s: float,
    loop_s: float,
    memory: list[dict[str, Any]],
) -> dict[str, Any]:
    """The summary of a run whose training steps produced `records` (one per step, in order). `memory`:
    the peak RSS of every process of the ranks (the launcher adds its own)."""
    # A resumed run's first step has no previous end to measure from (nan): left out.
    step_times = [r["time/step_s"] for r in records[1:] if r["time/step_s"] == r["time/step_s"]]
    total_tokens = sum(r["train/num_completion_tokens"] for r in records)
    syncs = [*_finite(r["time/weight_sync_s"] for r in records), last_sync_s]
    return {
        "mode": config.schedule.mode,
        "task": config.task.name,
        "model": config.model,
        "steps": len(records),
        "num_trainers": config.ranks.num_trainers,
        "num_generators": config.ranks.num_generators,
        "num_reward_ranks": config.ranks.num_reward_ranks,
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
        "weight_sync_failures": sync_failures,
        "sampled_groups": sum(_finite(r.get("sampling/groups") for r in records)),
        **reward_model_summary(config, records),
        **({"stream": stream_counts} if stream_counts else {}),
        "eval_size": eval_size,
        **eval_summary(evaluations),
        "final_policy_version": final_policy_version,
        "resumed_from_step": resumed_from_step,
        # every process of every rank (ranks, vLLM engines, reward workers) and, once the launcher adds
        # itself, the launcher: per process and summed
        **memory_summary(memory),
    }


def reward_model_summary(config: RunConfig, records: list[dict[str, float]]) -> dict[str, Any]:
    """The reward model's scoring time and throughput over the steps (none without a reward model)."""
    if config.reward_model.path is None:
        return {}
    seconds = sum(_finite(r.get("time/reward_model_s") for r in records))
    samples = sum(_finite(r.get("reward_model/samples") for r in records))
    return {
        "reward_model": config.reward_model.path,
        "reward_model_placement": "reward ranks" if config.ranks.num_reward_ranks else "colocated",
        "reward_model_scoring_s": seconds,  # summed over reward ranks (or generators, colocated)
        "reward_model_samples": samples,
        "reward_model_samples_per_s": samples / seconds if seconds > 0 else float("nan"),
    }


def write_summary(output_dir: Path, summary: dict[str, Any]) -> None:
    """OUTPUT_DIR/summary.json."""
    (output_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")


def eval_summary(history: list[EvalResult]) -> dict[str, Any]:
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


def _mean(values: Iterable[float]) -> float:
    values = list(values)
    return sum(values) / len(values) if values else float("nan")


def _finite(values: Iterable[float | None]) -> list[float]:
    """The values that are numbers (not None, not nan)."""
    return [v for v in values if v is not None and v == v]
