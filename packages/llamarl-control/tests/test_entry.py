"""What `llamarl.control.entry` settles before any rank starts: the evaluation's size against the test
split, the completion budget against the model's context, routing replay against the model, and where
a task given in code is recorded so that its run's config.toml reruns it."""

from __future__ import annotations

import subprocess
import sys
import tomllib

import pytest

from llamarl.control.cli import parse_run_config
from llamarl.control.config import ConfigError, replace_in
from llamarl.control.entry import check_model, configure, fit_eval_size
from llamarl.control.launch.output_dir import write_resolved_config
from llamarl.control.tasks.registry import task_origin

SCRIPT_TASK = """
from llamarl.control import Task

def exact(prompt, completion, row):
    return float(completion.strip() == row["word"])

TASK = Task(name="echo_{n}", rows={{"train": [{{"word": "a"}}], "test": [{{"word": "b"}}]}},
            prompt="Say {{word}}.", rewards=[exact])
"""


def test_a_default_evaluation_larger_than_the_test_split_shrinks_to_it_with_a_note(caplog):
    config = parse_run_config([], task="arith", prog="arith_rl", description="")
    assert config.eval.size == 16
    with caplog.at_level("WARNING"):
        fitted = fit_eval_size(config, 2, given=False)
    assert fitted.eval.size == 2
    assert caplog.messages == [
        "the test split has 2 rows: evaluating on all of them (--eval-size 16 by default)"
    ]
    assert fit_eval_size(config, 100, given=False) is config  # it fits: nothing to say


def test_an_evaluation_size_the_user_gave_that_the_split_cannot_hold_is_one_line():
    config = parse_run_config(["--eval-size", "5"], task="arith", prog="arith_rl", description="")
    with pytest.raises(ConfigError, match=r"^--eval-size 5 is larger than the test split \(2 rows\)$"):
        fit_eval_size(config, 2, given=True)


def test_a_completion_budget_beyond_the_models_context_is_one_line(tiny_chat_model_dir):
    config = parse_run_config(
        ["--model", str(tiny_chat_model_dir)], task="arith", prog="arith_rl", description=""
    )
    check_model(config)  # the default fits
    too_long = replace_in(config, **{"sampling.max_new_tokens": 1_000_000})
    with pytest.raises(
        ConfigError, match=r"^--max-new-tokens 1000000 does not fit the model's context of \d+"
    ):
        check_model(too_long)


def test_routing_replay_that_cannot_work_is_one_line_before_any_rank_starts(tiny_chat_model_dir, tmp_path):
    from llamarl.exec.models import tiny_moe_model

    def config(model, *flags):
        return parse_run_config(
            ["--model", str(model), *flags], task="arith", prog="arith_rl", description=""
        )

    check_model(config(tiny_chat_model_dir))  # a dense model: auto replays nothing
    with pytest.raises(
        ConfigError, match=r"routing_replay r3: .* is not a mixture of experts \(nothing to replay\)$"
    ):
        check_model(config(tiny_chat_model_dir, "--algorithm.routing-replay", "r3"))
    moe = tmp_path / "moe"
    tiny_moe_model("olmoe", 64).save_pretrained(moe)
    check_model(config(moe, "--generator", "hf"))
    check_model(config(moe, "--num-trainers", "2", "--trainer.expert-parallel"))
    for flags, message in [
        (["--num-trainers", "2", "--trainer.expert-parallel"], "is not a mixture of experts"),
        (["--trainer.expert-parallel"], "give --num-trainers 2 or more"),
        (
            ["--num-trainers", "3", "--prompts-per-step", "3", "--trainer.expert-parallel"],
            "4 experts per layer cannot be split evenly over 3",
        ),
    ]:
        with pytest.raises(ConfigError, match=message):
            check_model(config(tiny_chat_model_dir if "not a mixture" in message else moe, *flags))
    for replay in ("auto", "off"):
        with pytest.raises(
            ConfigError, match=r"^--generator vllm: .* mixture of experts, .* use --generator hf$"
        ):
            check_model(config(moe, "--generator", "vllm", "--algorithm.routing-replay", replay))


def test_a_script_task_is_recorded_by_its_file_and_its_config_reruns_it_from_anywhere(tmp_path):
    script = tmp_path / "echo_task.py"
    script.write_text(SCRIPT_TASK.format(n=tmp_path.name[-6:]))
    sys.path.insert(0, str(tmp_path))
    try:
        module = __import__("echo_task")
        config, task = configure(module.TASK, ["--output-dir", str(tmp_path / "out")])
    finally:
        sys.path.remove(str(tmp_path))
    assert task is module.TASK and task_origin(task.name) == "echo_task:TASK"
    (tmp_path / "out").mkdir()
    write_resolved_config(config)
    written = tomllib.loads((tmp_path / "out" / "config.toml").read_text())
    assert written["task"] == {"name": task.name, "module": "echo_task:TASK"}
    # A fresh process that never saw the task: the file alone names it (with the script's folder on the
    # path, as `uv run apps/task_rl` from that folder has it).
    check = (
        "from llamarl.control.entry import configure;"
        f"config, task = configure(None, ['--config', {str(tmp_path / 'out' / 'config.toml')!r}]);"
        "print(task.name, task.prompt)"
    )
    result = subprocess.run(
        [sys.executable, "-c", check], capture_output=True, text=True, timeout=120, cwd=tmp_path,
        env={**__import__("os").environ, "PYTHONPATH": str(tmp_path)},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == f"{task.name} Say {{word}}."


def test_a_run_that_names_no_generator_gets_one_said_in_one_line_and_recorded(
    tiny_chat_model_dir, tmp_path, monkeypatch
):
    """`generator.backend` auto: the rule's choice replaces it in the config (which config.toml writes),
    with one line saying why; a probe cached for this machine and model decides without measuring."""
    from llamarl.control.launch.generator_choice import choose_generator, run_workload
    from llamarl.exec.generate.choice import Rates, this_hardware
    from llamarl.exec.generate.probe import ProbeCache, probe_key

    monkeypatch.setenv("LLAMARL_CACHE_DIR", str(tmp_path))  # no probe of this machine yet
    vllm_python = sys.executable  # an interpreter is all the rule looks at (the engine never starts)
    flags = ["--model", str(tiny_chat_model_dir), "--generator.vllm-python", vllm_python, "--steps", "3"]
    flags += ["--output-dir", str(tmp_path / "out")]
    config = parse_run_config(flags, task="arith", prog="arith_rl", description="")
    assert config.generator.backend == "auto"
    said: list[str] = []
    chosen = choose_generator(config, say=said.append)
    # A tiny model decodes a 3-step run in well under a second with the hf generator: nothing to gain.
    assert chosen.generator.backend == "hf" and len(said) == 1 and said[0].startswith("generator: hf (")
    (tmp_path / "out").mkdir()
    write_resolved_config(chosen)
    recorded = tomllib.loads((tmp_path / "out" / "config.toml").read_text())
    assert recorded["generator"]["backend"] == "hf"

    # This machine measured vLLM 3x as fast on this model: a long run takes it, without a probe.
    long_run = replace_in(config, **{"schedule.steps": 100_000})
    hardware = this_hardware(cuda=False)
    key = probe_key(hardware, long_run.model, run_workload(long_run), vllm_python)
    ProbeCache().put(key, Rates(1000.0, 3000.0, measured="probed here"))
    said.clear()
    assert choose_generator(long_run, say=said.append).generator.backend == "vllm"
    assert said == [said[0]] and "3.0x the hf generator here (probed here)" in said[0]

    # Named, it is never changed; LoRA adapters rule vLLM out.
    named = replace_in(long_run, **{"generator.backend": "hf"})
    assert choose_generator(named, say=said.append) is named
    lora = replace_in(long_run, **{"trainer.lora.rank": 8})
    assert choose_generator(lora, say=print).generator.backend == "hf"
    # So does a mixture of experts (vLLM takes neither its weight syncs nor its routes yet).
    from llamarl.exec.models import tiny_moe_model

    tiny_moe_model("olmoe", 64).save_pretrained(tmp_path / "moe")
    said.clear()
    moe = replace_in(long_run, model=str(tmp_path / "moe"))
    assert choose_generator(moe, say=said.append).generator.backend == "hf"
    assert "mixture of experts" in said[-1], said
