"""Reward ranks end to end: the arith app on a tiny policy with a tiny reward model (both built from a
config, SmolLM2's tokenizer), on real processes: a trainer, a generator and a reward rank.

Each mode must train with rewards that are the rule reward plus the reward model's score, the reward
rank must show in the trace as its own lane and in the summary with its scoring time; a reward rank
killed mid-run must fail the run within the deadline, in one line naming it.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from test_rl_apps import read_step_metrics, run_app

from llamarl.control.outputs.timeline import read_chrome_trace

REWARD_RANK = 2  # trainer 0, generator 1, reward 2


@pytest.fixture(scope="module")
def tiny_reward_model_dir(tmp_path_factory) -> Path:
    from transformers import AutoTokenizer

    from llamarl.exec.models import smollm2_path, tiny_reward_model

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path())
    model = tiny_reward_model(len(tokenizer), pad_token_id=tokenizer.pad_token_id, seed=3)
    path = tmp_path_factory.mktemp("tiny_reward_model")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def reward_args(model: Path, reward_model: Path, out: Path, mode: str) -> list[str]:
    return [
        "--model", str(model), "--output-dir", str(out), "--mode", mode, "--steps", "2",
        "--prompts-per-step", "2", "--samples-per-prompt", "2", "--max-new-tokens", "6", "--eval-size", "0",
        "--no-save-model", "--no-wandb", "--num-reward-ranks", "1", "--reward-model-path", str(reward_model),
        "--reward-model-weight", "0.5", "--timeout", "120",
    ]  # fmt: skip


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("mode", "generators"), [("async", 1), ("stream", 2)])
def test_reward_rank_scores_between_generator_and_trainer(
    tiny_model_dir, tiny_reward_model_dir, tmp_path, mode, generators
):
    """Stream mode with two generators: one reward rank forwards both streams to the trainer, told apart
    by their tags."""
    out = tmp_path / mode
    reward_rank = 1 + generators
    args = reward_args(tiny_model_dir, tiny_reward_model_dir, out, mode)
    result = run_app("arith_rl", *args, "--num-generators", str(generators))
    assert result.returncode == 0, result.stderr[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["num_reward_ranks"] == 1
    assert summary["reward_model_placement"] == "reward ranks"
    assert summary["reward_model_scoring_s"] > 0 and summary["reward_model_samples_per_s"] > 0
    # The reward rank scored every sample the trainer took (stream mode may score more than it trains).
    scores = [
        json.loads(line) for line in (out / f"reward_scores.rank{reward_rank}.jsonl").read_text().splitlines()
    ]
    # The summary counts the samples of the batches the trainer took; in stream mode the reward rank may
    # have scored more by the time the run stopped (groups arriving after the last step).
    if mode == "stream":
        assert 2 * 2 * 2 <= summary["reward_model_samples"] <= len(scores)
    else:
        assert summary["reward_model_samples"] == len(scores) >= 2 * 2 * 2
    for record in scores:  # reward = rule reward (0 or 1) + 0.5 x the model's score
        rule = record["reward"] - 0.5 * record["model_score"]
        assert min(abs(rule), abs(rule - 1.0)) < 1e-5, record
    # The trainer trained on the combined rewards: in lock step, step t on the batch of tick t.
    steps = read_step_metrics(out)
    assert len(steps) == 2
    if mode != "stream":
        for t, step in enumerate(steps):
            rewards = [r["reward"] for r in scores if r["tick"] == t]
            assert step["train/reward_mean"] == pytest.approx(sum(rewards) / len(rewards), abs=1e-5)
            assert step["reward_model/samples"] == len(rewards)
    spans, roles = read_chrome_trace(out / "trace.json")
    assert roles[reward_rank] == f"rank {reward_rank} reward {reward_rank}"
    assert {s.name for s in spans[reward_rank]} >= {"reward_model"}
    assert not any(s.name == "weight_sync" for s in spans[reward_rank])  # its weights are its own


@pytest.mark.timeout(300)
def test_a_colocated_reward_model_scores_in_the_generator_rank(
    tiny_model_dir, tiny_reward_model_dir, tmp_path
):
    out = tmp_path / "colocated"
    args = reward_args(tiny_model_dir, tiny_reward_model_dir, out, "async")
    args[args.index("--num-reward-ranks") + 1] = "0"
    result = run_app("arith_rl", *args)
    assert result.returncode == 0, result.stderr[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["reward_model_placement"] == "colocated" and summary["reward_model_samples"] == 8
    spans, roles = read_chrome_trace(out / "trace.json")
    assert len(roles) == 2 and any(s.name == "reward_model" for s in spans[1])


@pytest.mark.timeout(300)
def test_a_killed_reward_rank_fails_the_run_in_one_line(tiny_model_dir, tiny_reward_model_dir, tmp_path):
    out = tmp_path / "killed"
    args = reward_args(tiny_model_dir, tiny_reward_model_dir, out, "async")
    args[args.index("--timeout") + 1] = "30"
    start = time.monotonic()
    result = run_app("arith_rl", *args, env={"LLAMARL_FAULT": f"{REWARD_RANK}:1:kill"})
    elapsed = time.monotonic() - start
    assert result.returncode == 1, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert f"rank {REWARD_RANK} (reward) died (SIGKILL)" in lines[-1], result.stderr[-3000:]
    print(lines[-1])
    assert elapsed < 120, elapsed


@pytest.mark.timeout(400)
def test_a_run_with_a_reward_rank_resumes_to_the_same_weights(
    tiny_model_dir, tiny_reward_model_dir, tmp_path
):
    """Async, 3 steps; the trainer fails at tick 2 and torch elastic restarts every rank from the
    checkpoint of tick 1, when the reward rank holds batch 1 scored and not yet forwarded."""
    from safetensors.torch import load_file

    def run(out: Path, *extra: str, env: dict[str, str] | None = None):
        args = reward_args(tiny_model_dir, tiny_reward_model_dir, out, "async")
        args[args.index("--steps") + 1] = "3"
        args.remove("--no-save-model")
        result = run_app("arith_rl", *args, *extra, env=env)
        assert result.returncode == 0, result.stderr[-4000:]
        return result

    reference, resumed = tmp_path / "reference", tmp_path / "resumed"
    run(reference)
    run(resumed, "--checkpoint-every", "1", "--max-restarts", "1", env={"LLAMARL_FAULT": "0:2"})
    assert json.loads((resumed / "errors" / "injected_fault.json").read_text())["rank"] == 0
    summary = json.loads((resumed / "summary.json").read_text())
    assert summary["resumed_from_step"] == 1 and summary["final_policy_version"] == 3
    scores = [
        (out / f"reward_scores.rank{REWARD_RANK}.jsonl").read_text().splitlines()
        for out in (reference, resumed)
    ]
    assert scores[0] == scores[1] and len(scores[0]) == 3 * 2 * 2
    a, b = (load_file(out / "final_model" / "model.safetensors") for out in (reference, resumed))
    assert not [name for name in a if not (a[name] == b[name]).all()]
    start = load_file(tiny_model_dir / "model.safetensors")
    assert any(not (start[k] == a[k]).all() for k in start if k in a), "training did not change the weights"
