"""A run's command line and config files, derived from `RunConfig` by pydantic-settings.

Why pydantic-settings (prime-rl's choice) and not tyro (torchtitan's): the same pydantic models give
validation (types, ranges, unknown keys), config files (TOML, YAML) and the command line, and a bad
value is raised as an exception that names the setting, which becomes one line here instead of a
formatted block; tyro would need a config-file layer written by hand and prints its own errors.

Layers, lowest first: the defaults declared in the tree, the app's own (its task), `--config FILE`
(TOML or YAML, the same tree as sections), then the flags after it. Every setting is
`--section.field` (`--trainer.lr`); the flags users know from before the tree existed stay as short
aliases (`SHORT_FLAGS`: `--lr`, `--steps`, `--no-wandb`, ...). A run writes its resolved config as
OUTPUT_DIR/config.toml, which `--config` reads back to rerun it.
"""

from __future__ import annotations

import argparse
import tomllib
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from llamarl.control.config import ConfigError, RunConfig, describe

# Dotted path -> the short flag for it: the flags of the apps' command line before the config tree, kept
# working (a path here must exist in RunConfig; tests/test_config.py checks it).
SHORT_FLAGS: dict[str, str] = {
    "task.data": "--data",
    "output.dir": "--output-dir",
    "schedule.mode": "--mode",
    "schedule.steps": "--steps",
    "schedule.prompts_per_step": "--prompts-per-step",
    "schedule.max_policy_lag": "--max-policy-lag",
    "schedule.buffer_groups": "--stream-buffer",
    "schedule.dynamic_sampling": "--dynamic-sampling",
    "schedule.max_sampling_rounds": "--max-sampling-rounds",
    "sampling.samples_per_prompt": "--samples-per-prompt",
    "sampling.max_new_tokens": "--max-new-tokens",
    "sampling.temperature": "--temperature",
    "eval.size": "--eval-size",
    "eval.samples": "--eval-samples",
    "eval.every": "--eval-every",
    "algorithm.loss": "--loss",
    "algorithm.advantage": "--advantage",
    "algorithm.loss_hparams": "--loss-arg",
    "algorithm.mismatch_is": "--mismatch-is",
    "algorithm.mismatch_cap": "--mismatch-cap",
    "algorithm.kl_coef": "--kl-coef",
    "algorithm.kl_estimator": "--kl-estimator",
    "trainer.lr": "--lr",
    "trainer.lr_schedule": "--lr-schedule",
    "trainer.warmup_steps": "--warmup-steps",
    "trainer.micro_batch_size": "--micro-batch-size",
    "trainer.pack_tokens": "--pack-tokens",
    "trainer.max_grad_norm": "--max-grad-norm",
    "trainer.activation_checkpointing": "--activation-checkpointing",  # (and --no-activation-checkpointing)
    "generator.backend": "--generator",
    "generator.vllm_python": "--vllm-python",
    "generator.max_engine_restarts": "--max-engine-restarts",
    "ranks.num_trainers": "--num-trainers",
    "ranks.num_generators": "--num-generators",
    "ranks.num_reward_ranks": "--num-reward-ranks",
    "reward_model.path": "--reward-model-path",
    "reward_model.kind": "--reward-model-kind",
    "reward_model.weight": "--reward-model-weight",
    "reward_model.rule_weight": "--rule-reward-weight",
    "ranks.device": "--device",
    "ranks.threads_per_rank": "--threads-per-rank",
    "launch.nnodes": "--nnodes",
    "launch.rdzv_endpoint": "--rdzv-endpoint",
    "launch.max_restarts": "--max-restarts",
    "launch.timeout_s": "--timeout",
    "weight_sync.timeout_s": "--weight-sync-timeout",
    "output.wandb": "--wandb",  # (and --no-wandb)
    "output.wandb_project": "--wandb-project",
    "output.save_model": "--save-model",  # (and --no-save-model)
    "checkpoint.every": "--checkpoint-every",
    "checkpoint.keep": "--keep-checkpoints",
    "checkpoint.resume": "--resume",
}
CONFIG_SUFFIXES = (".toml", ".yaml", ".yml")
RESOLVED_CONFIG = "config.toml"  # written into the output folder by every run


def parse_run_config(
    argv: list[str],
    *,
    task: str | None,
    prog: str,
    description: str,
    defaults: dict[str, Any] | None = None,
) -> RunConfig:
    """The run configuration of a command line: `--config FILE` (if any) under the flags.

    `task`: the app's task name (None: the settings name it, `--task.module` or `--task.name`);
    `defaults`: settings in code (sections as dicts), under the config file and the flags.

    Raises:
        ConfigError: one line naming the setting (or file, or flag) to fix.
    """
    for arg in argv:
        if arg.startswith("@"):
            recipe = Path(arg[1:])
            raise ConfigError(
                f"{arg}: flag files are gone; recipes are config files now: "
                f"--config {recipe.with_suffix('.toml')}"
            )
    config_path, flags = _split_config_flag(argv)
    flags = [_spell_out(flag) for flag in flags]
    layers: dict[str, Any] = {"task": {"name": task}} if task else {}
    layers = _deep_merge(layers, defaults or {})
    if config_path is not None:
        from_file = load_config_file(config_path)
        file_task = from_file.get("task", {}).get("name") if isinstance(from_file.get("task"), dict) else None
        if task and file_task and file_task != task:
            raise ConfigError(
                f"{config_path} is a config for task {file_task!r}; run apps/{file_task}_rl with it"
            )
        layers = _deep_merge(layers, from_file)
    return _parse(flags, layers, prog=prog, description=description)


def load_config_file(path: str | Path) -> dict[str, Any]:
    """The settings of a TOML or YAML config file, as nested sections (not validated yet)."""
    path = Path(path)
    if path.suffix not in CONFIG_SUFFIXES:
        raise ConfigError(f"--config {path}: expected a .toml or .yaml file")
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"--config {path}: cannot read it ({e.strerror or e})") from None
    try:
        if path.suffix == ".toml":
            data = tomllib.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text) or {}
    except (tomllib.TOMLDecodeError, ValueError) as e:
        raise ConfigError(f"--config {path}: not valid {path.suffix[1:].upper()} ({e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: expected sections of settings, got a {type(data).__name__}")
    return data


def write_config(config: RunConfig, path: Path) -> None:
    """Writes `config` as TOML that `--config` reads back to the same config (unset settings left out)."""
    import tomli_w

    data = config.model_dump(mode="json", exclude_none=True)
    top = {k: v for k, v in data.items() if not isinstance(v, dict)}  # TOML: plain keys before tables
    tables = {k: v for k, v in data.items() if isinstance(v, dict)}
    path.write_text(tomli_w.dumps({**top, **tables}), encoding="utf-8")


def _parse(flags: list[str], layers: dict[str, Any], *, prog: str, description: str) -> RunConfig:
    from pydantic_settings import CliApp, CliSettingsSource, SettingsError

    parser = _OneLineErrors(
        prog=prog,
        description=f"{description} Settings may come from a config file first: --config FILE (TOML or "
        "YAML, sections as below, e.g. recipes/*.toml); flags after it override it.",
    )
    source = CliSettingsSource(
        RunConfig,
        root_parser=parser,
        cli_kebab_case=True,
        cli_implicit_flags=True,  # --resume, --no-wandb: booleans take no value
        cli_avoid_json=True,  # no --trainer JSON flag for a whole section
        cli_hide_none_type=True,
        cli_exit_on_error=False,
        cli_shortcuts={
            _kebab(path): flag.removeprefix("--")
            for path, flag in SHORT_FLAGS.items()
            if flag not in _SECTION_FLAGS
        },
    )
    try:
        return CliApp.run(RunConfig, cli_args=flags, cli_settings_source=source, **layers)
    except ValidationError as e:
        raise ConfigError(describe(e, SHORT_FLAGS)) from None
    except SettingsError as e:
        raise ConfigError(_describe_parse_error(str(e))) from None


def _describe_parse_error(message: str) -> str:
    """pydantic-settings' parse errors, said in terms of the setting (and its short flag)."""
    prefix = "Parsing error encountered for "
    if message.startswith(prefix):
        path = message[len(prefix) :].partition(":")[0]
        flag = SHORT_FLAGS.get(path)
        where = f"{path} ({flag})" if flag else path
        info = _field(path)
        if info is not None and "dict" in str(info.annotation):  # a mapping flag given a bare word
            return f"{where}: expects KEY=VALUE (e.g. {flag or '--' + _kebab(path)} rho=4)"
        return f"{where}: {message.partition(':')[2].strip()}"
    return f"{message.removeprefix('error parsing CLI: ')} (see --help)"


def _field(path: str):
    """The pydantic FieldInfo at a dotted path of RunConfig, or None."""
    model: Any = RunConfig
    info = None
    for key in path.split("."):
        fields = getattr(model, "model_fields", {})
        if key not in fields:
            return None
        info = fields[key]
        model = info.annotation
    return info


class _OneLineErrors(argparse.ArgumentParser):
    """argparse prints its usage block and exits on a bad flag; here that is one line, raised."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(f"{message} (see --help)")


def _split_config_flag(argv: list[str]) -> tuple[Path | None, list[str]]:
    """(the --config file, the other flags); only one --config."""
    path: Path | None = None
    rest: list[str] = []
    args = iter(argv)
    for arg in args:
        if arg == "--config" or arg.startswith("--config="):
            value = arg.partition("=")[2] if "=" in arg else next(args, None)
            if not value:
                raise ConfigError("--config needs a file (TOML or YAML)")
            if path is not None:
                raise ConfigError("--config given twice; put every setting in one file")
            path = Path(value)
        else:
            rest.append(arg)
    return path, rest


# Short flags named like a section (`--generator vllm`, the section being `generator`) cannot be parser
# aliases (the section's own name is taken); they are spelled out before parsing instead.
_SECTION_FLAGS = {
    flag: f"--{_path}"
    for _path, flag in SHORT_FLAGS.items()
    if flag.removeprefix("--") in RunConfig.model_fields
}


def _spell_out(flag: str) -> str:
    name, eq, value = flag.partition("=")
    return _SECTION_FLAGS[name].replace("_", "-") + eq + value if name in _SECTION_FLAGS else flag


def _deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _kebab(path: str) -> str:
    return path.replace("_", "-")
