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
    """Start and end of each held-out figure, the paired 95% confidence interval of its change, and every
    evaluation: accuracy where the task says when an answer is right, the mean reward always, each under
    its own name (None where there is no such figure)."""
    names = ("accuracy", "reward", "sampled_accuracy", "sampled_reward")
    if not history:
        return {f"eval_{name}_{end}": None for name in names for end in ("start", "end")}
    first, last = history[0], history[-1]
    per_question = {
        "accuracy": lambda r: r.greedy_correct_Q,
        "reward": lambda r: r.greedy_reward_Q,
        "sampled_accuracy": lambda r: r.sampled_correct_Q,
        "sampled_reward": lambda r: r.sampled_reward_Q,
    }
    summary: dict[str, Any] = {}
    for name in names:
        before, after = per_question[name](first), per_question[name](last)
        summary[f"eval_{name}_start"] = None if before is None else sum(before) / len(before)
        summary[f"eval_{name}_end"] = None if after is None else sum(after) / len(after)
        if before is not None and after is not None and len(before) >= 2:
            summary[f"eval_{name}_delta_ci95"] = paired_delta_ci(before, after)
    summary["eval_history"] = [
        {"policy_version": r.policy_version}
        | {k.removeprefix("eval/"): v for k, v in r.metrics().items() if k != "eval/policy_version"}
        for r in history
    ]
    return summary


def _mean(values: Iterable[float]) -> float:
    values = list(values)
    return sum(values) / len(values) if values else float("nan")


def _finite(values: Iterable[float | None]) -> list[float]:
    """The values that are numbers (not None, not nan)."""
    return [v for v in values if v is not None and v == v]
