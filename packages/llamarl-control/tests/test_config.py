"""The run configuration: one tree, its command line and config files, and one-line errors."""

from __future__ import annotations

import pydantic
import pytest

from llamarl.control.cli import RESOLVED_CONFIG, SHORT_FLAGS, load_config_file, parse_run_config, write_config
from llamarl.control.config import ConfigError, RunConfig, replace_in


def parse(*argv: str, task: str = "gsm8k") -> RunConfig:
    return parse_run_config(list(argv), task=task, prog=f"{task}_rl", description="")


def leaf_paths(model: type[pydantic.BaseModel], prefix: str = "") -> list[str]:
    """Every setting of the tree as a dotted path."""
    paths = []
    for name, info in model.model_fields.items():
        if isinstance(info.annotation, type) and issubclass(info.annotation, pydantic.BaseModel):
            paths += leaf_paths(info.annotation, f"{prefix}{name}.")
        else:
            paths.append(prefix + name)
    return paths


def test_every_setting_has_a_doc_and_every_short_flag_names_a_setting():
    paths = leaf_paths(RunConfig)
    assert len(paths) > 50
    for path in paths:
        section, _, name = path.rpartition(".")
        model = RunConfig
        for key in filter(None, section.split(".")):
            model = model.model_fields[key].annotation
        assert model.model_fields[name].description, f"{path} has no one-line doc"
    assert set(SHORT_FLAGS) <= set(paths), set(SHORT_FLAGS) - set(paths)
    assert len(set(SHORT_FLAGS.values())) == len(SHORT_FLAGS)  # no flag names two settings


def test_help_lists_every_setting_with_its_doc_and_default(capsys):
    with pytest.raises(SystemExit) as exit_:
        parse("--help")
    assert exit_.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for path in leaf_paths(RunConfig):
        assert "--" + path.replace("_", "-") in text, path
    assert "--lr float AdamW peak learning rate" in text and "(default: 3e-06)" in text
    assert "--config FILE" in text


def test_short_flags_of_before_set_the_nested_settings():
    config = parse(
        "--steps", "7", "--lr", "2e-5", "--no-wandb", "--resume", "--loss-arg", "rho=3",
        "--generator", "vllm", "--stream-buffer", "8", "--timeout", "90", "--weight-sync-timeout", "30",
        "--no-save-model", "--mismatch-is", "token_mask", "--eval-size", "3", "--output-dir", "out/x",
    )  # fmt: skip
    assert config.schedule.steps == 7 and config.trainer.lr == 2e-5
    assert config.output.wandb is False and config.output.save_model is False
    assert config.checkpoint.resume is True and config.algorithm.loss_hparams == {"rho": 3.0}
    assert config.generator.backend == "vllm" and config.schedule.buffer_groups == 8
    assert config.launch.timeout_s == 90 and config.weight_sync.timeout_s == 30
    assert config.sync_deadline_s == 30 and config.algorithm.mismatch_is == "token_mask"
    assert config.eval.size == 3 and str(config.output_dir) == "out/x"
    # The nested spelling sets the same settings.
    assert (
        parse("--schedule.steps", "7", "--trainer.lr", "2e-5").model_dump()
        == parse("--steps", "7", "--lr", "2e-5").model_dump()
    )


def test_defaults_are_the_fast_settings():
    config = RunConfig(task="gsm8k")
    assert config.trainer.pack_tokens > 0 and config.trainer.share_prompts  # same gradients, faster
    assert config.schedule.mode == "async"
    assert str(config.output_dir) == "runs/gsm8k_rl"


def test_a_config_file_under_the_flags(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[schedule]\nsteps = 9\nmode = "sync"\n[trainer]\nlr = 1e-5\n')
    config = parse("--config", str(path), "--lr", "4e-5")
    assert config.schedule.steps == 9 and config.schedule.mode == "sync"  # from the file
    assert config.trainer.lr == 4e-5  # the flag after it wins
    yaml = tmp_path / "run.yaml"
    yaml.write_text("schedule:\n  steps: 5\n")
    assert parse("--config", str(yaml)).schedule.steps == 5


def test_a_run_rewrites_its_resolved_config_to_the_same_config(tmp_path):
    config = parse("--steps", "5", "--loss-arg", "rho=2", "--mismatch-is", "token_truncate", "--data", "d")
    path = tmp_path / RESOLVED_CONFIG
    write_config(config, path)
    assert parse("--config", str(path)) == config
    assert load_config_file(path)["task"] == {"name": "gsm8k", "data": "d"}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[trainer]\nlrr = 1\n", "trainer.lrr: Extra inputs are not permitted"),
        ("[schedule]\nsteps = 'many'\n", "schedule.steps (--steps): Input should be a valid integer"),
        (
            "[eval]\nsize = -1\n",
            "eval.size (--eval-size): Input should be greater than or equal to 0, got -1",
        ),
        ("[task]\nname = 'math'\n", "is a config for task 'math'; run apps/math_rl with it"),
        ("[schedule\n", "not valid TOML"),
        ("seed = [1]\n", "seed: Input should be a valid integer"),
    ],
)
def test_a_bad_config_file_is_one_line_naming_the_key(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as error:
        parse("--config", str(path))
    assert message in str(error.value) and "\n" not in str(error.value), str(error.value)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--config"], "--config needs a file"),
        (["--config", "a.toml", "--config", "b.toml"], "--config given twice"),
        (["--config", "x.json"], "expected a .toml or .yaml file"),
        (["--config", "missing.toml"], "--config missing.toml: cannot read it"),
        (["@recipes/arith_cpu.args"], "--config recipes/arith_cpu.toml"),
        (
            ["--mode", "stream", "--prompts-per-step", "4", "--stream-buffer", "2"],
            "must hold at least one step",
        ),
        (["--nnodes", "2"], "launch.nnodes > 1 needs launch.rdzv_endpoint"),
        (["--num-generators", "2", "--nnodes", "2", "--rdzv-endpoint", "h:1"], "cannot be spread evenly"),
        (["--ranks.colocate", "--num-generators", "2"], "ranks.num_generators (2) must equal"),
        (["--ranks.colocate"], "trainer_memory_fraction (1.0) + generator.gpu_memory_utilization (0.9) must"),
        (
            [
                "--ranks.colocate",
                "--ranks.trainer-memory-fraction",
                "0.5",
                "--nnodes",
                "2",
                "--rdzv-endpoint",
                "h:1",
            ],
            "ranks.colocate shares the GPUs of one machine",
        ),
        (
            ["--generator.gpu-memory-utilization", "1.5"],
            "generator.gpu_memory_utilization: Input should be less",
        ),
        (["--temperature", "0"], "sampling.temperature (--temperature): Input should be greater than 0"),
        (["--task.name", "chess"], "unknown task 'chess'; known: gsm8k, math, arith"),
        (["--loss", "nope"], "algorithm.loss (--loss): Input should be 'aipo'"),
    ],
)
def test_bad_settings_are_one_line_naming_the_setting(argv, message):
    with pytest.raises(ConfigError) as error:
        parse(*argv)
    assert message in str(error.value) and "\n" not in str(error.value), str(error.value)


def test_stream_mode_takes_checkpoints_resumes_restarts_and_evaluates_like_the_others():
    config = parse(
        "--mode", "stream", "--checkpoint-every", "2", "--resume", "--max-restarts", "1", "--eval-every", "2"
    )
    assert (config.checkpoint.every, config.checkpoint.resume) == (2, True)
    assert (config.launch.max_restarts, config.eval.every) == (1, 2)


def test_replace_in_validates_and_sections_are_immutable():
    config = RunConfig(task="gsm8k")
    assert replace_in(config, **{"checkpoint.resume": True}).checkpoint.resume
    assert config.checkpoint.resume is False  # the original is unchanged
    with pytest.raises(ConfigError, match=r"schedule\.steps"):
        replace_in(config, **{"schedule.steps": 0})
    with pytest.raises(pydantic.ValidationError):
        config.schedule.steps = 3  # type: ignore[misc]


def test_every_machine_derives_the_same_rendezvous_id_from_the_endpoint():
    # The c10d rendezvous key is built from the run id: machines with different ones never meet.
    argv = ("--nnodes", "2", "--rdzv-endpoint", "node0:29500")
    assert parse(*argv).launch.run_id == parse(*argv, "--steps", "9").launch.run_id == "llamarl-node0-29500"
    assert parse(*argv, "--launch.rdzv-id", "job-17").launch.run_id == "job-17"
