"""Bring your own task, end to end on several processes with a tiny model: the README's example as
written, the multi-turn tool app, a user's multi-turn environment named by --task.module, and the
one-line errors of a task module that does not import or defines no task."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch
from test_rl_apps import REPO, read_samples, read_step_metrics, run_app

SMALL_RUN = [
    "--steps", "2", "--prompts-per-step", "2", "--samples-per-prompt", "2", "--max-new-tokens", "8",
    "--eval-size", "2", "--no-save-model", "--no-wandb",
]  # fmt: skip

FEEDBACK_TASK = """
from llamarl.control import Task
from llamarl.exec.testing import FeedbackEnvironment

TASK = Task(
    name="feedback",
    rows={"train": [{"question": f"q{i}", "turns": 3} for i in range(4)],
          "test": [{"question": "t", "turns": 2}, {"question": "u", "turns": 2}]},
    environment=FeedbackEnvironment,
)
"""


NAN_TASK = """
from llamarl.control import Task

def sometimes_nan(prompt, completion, row):
    return float("nan") if len(completion) % 2 else 1.0

TASK = Task(
    name="nan_rewards",
    rows={"train": [{"question": f"q{i}"} for i in range(8)], "test": [{"question": "t"}, {"question": "u"}]},
    rewards=[sometimes_nan],
)
"""


def readme_example() -> str:
    """The README's "Bring your own task" example, as written there."""
    text = (REPO / "README.md").read_text()
    section = text[text.index("## Bring your own task") :]
    return re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)


@pytest.mark.timeout(400)
def test_the_readme_example_runs_as_written(tiny_model_dir, tmp_path):
    example = readme_example()
    assert len(example.splitlines()) <= 25  # the README is a front door: its example stays short
    script = tmp_path / "my_task.py"
    script.write_text(example)
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, str(script), "--model", str(tiny_model_dir), "--output-dir", str(out), *SMALL_RUN],
        capture_output=True, text=True, timeout=380, cwd=tmp_path,
        env={**__import__("os").environ, "WANDB_MODE": "offline"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["final_policy_version"] == 2 and summary["task"] == "shout"
    # The script's task is recorded where it can be imported again: config.toml reruns it from any app.
    assert f'module = "{script}:TASK"' in (out / "config.toml").read_text()
    samples = read_samples(out)
    assert len(samples) == 2 * 2 * 2 and all(0.0 <= s["reward"] <= 1.2 for s in samples)
    assert any(s["reward"] > 0 for s in samples)  # the batched brevity reward scores every answer


@pytest.mark.timeout(400)
def test_the_tool_app_trains_multi_turn(tiny_model_dir, tmp_path):
    out = tmp_path / "calc"
    result = run_app("calc_rl", "--model", str(tiny_model_dir), "--output-dir", str(out), *SMALL_RUN,
                     "--sampling.max-turns", "3")  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["task"] == "calc" and summary["final_policy_version"] == 2
    assert all(s["completion"].startswith("[assistant]") for s in read_samples(out))
    assert all(m["sampling/episodes_dropped"] == 0 for m in read_step_metrics(out))


@pytest.mark.timeout(400)
def test_a_users_environment_by_module_runs_several_turns(tiny_model_dir, tmp_path):
    (tmp_path / "feedback_task.py").write_text(FEEDBACK_TASK)
    out = tmp_path / "feedback"
    result = run_app("task_rl", "--task.module", f"{tmp_path / 'feedback_task.py'}:TASK",
                     "--model", str(tiny_model_dir), "--output-dir", str(out), *SMALL_RUN)  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["task"] == "feedback"
    # Every episode ran three model turns with the environment's two replies between them, and the
    # environment's reward (1.0) reached the trainer.
    for sample in read_samples(out):
        assert sample["completion"].count("[assistant]") == 3, sample
        assert "[user] Try again (2)." in sample["completion"] and sample["reward"] == 1.0
    # The task does not say when an answer is right: the evaluation reports its mean reward, no accuracy.
    assert summary["eval_reward_start"] == 1.0 and summary["eval_accuracy_start"] is None


@pytest.mark.parametrize(
    ("module", "message"),
    [
        ("no_such_pkg.tasks:TASK", "cannot import 'no_such_pkg.tasks'"),
        ("json:TASK", "module 'json' defines no 'TASK'"),
    ],
)
def test_a_bad_task_module_is_one_line(tmp_path, module, message):
    result = run_app("task_rl", "--task.module", module, "--output-dir", str(tmp_path / "x"), timeout=120)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr
    assert not (tmp_path / "x").exists()  # nothing started


@pytest.mark.timeout(400)
def test_a_reward_that_returns_nan_costs_its_samples_and_never_reaches_the_model(tiny_model_dir, tmp_path):
    # Before: the run ended with exit 0, NaN rewards in the samples, no word, and a final model of NaNs.
    (tmp_path / "nan_task.py").write_text(NAN_TASK)
    out = tmp_path / "nan"
    args = [arg for arg in SMALL_RUN if arg != "--no-save-model"]
    result = run_app("task_rl", "--task.module", f"{tmp_path / 'nan_task.py'}:TASK",
                     "--model", str(tiny_model_dir), "--output-dir", str(out), *args)  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    assert "reward function 'sometimes_nan' returned nan, not a finite number; sample" in result.stderr
    rewards = [s["reward"] for s in read_samples(out)]
    assert rewards and all(r in (0.0, 1.0) for r in rewards), rewards  # a NaN scored 0, as a raise does
    from safetensors.torch import load_file

    final = load_file(out / "final_model" / "model.safetensors")
    assert final and all(bool(torch.isfinite(t).all()) for t in final.values())
