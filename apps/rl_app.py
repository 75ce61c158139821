"""The command line shared by the RL apps (`uv run apps/gsm8k_rl`, `uv run apps/math_rl`, ...).

Reads the run configuration (`llamarl.control.cli`: flags, `--config FILE`), resolves the model and the
data, launches the run and prints its summary. Every user error (a bad flag or config file, a missing
model or data file, a malformed row, an output folder that cannot be written) ends in one line that says
what to fix (exit code 2); a failure inside a rank prints that rank's original error once (exit code 1);
Ctrl-C or SIGTERM stops every process and says where the last checkpoint is (exit code 128 + signal).
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

from llamarl.control import (
    TASKS,
    ConfigError,
    DataError,
    RunConfig,
    RunFailed,
    RunInterrupted,
    launch,
    load_examples,
)
from llamarl.control.cli import parse_run_config
from llamarl.control.config import replace_in
from llamarl.control.tasks import hub_unavailable_reason

CUDA_DEFAULT_MODEL = "Qwen/Qwen2.5-0.5B-Instruct"
EMBEDDED_DATA = Path(__file__).resolve().parent / "data"  # compressed copies shipped with the apps


class UsageError(Exception):
    """A problem with the command line or its inputs, reported in one line."""


def resolve_data(task: str, data: str | None, prog: str) -> str | None:
    """The dataset to load: the flag, else the hub default, else the embedded copy when offline.

    Says in one line when it falls back, instead of letting the hub client retry with warnings.
    """
    embedded = EMBEDDED_DATA / task
    if data is not None or TASKS[task].hub_id is None or not embedded.is_dir():
        return data
    reason = hub_unavailable_reason()
    if reason is None:
        return None
    print(f"{prog}: {reason}: using the {task} copy shipped in {embedded}", file=sys.stderr)
    return str(embedded)


def resolve_model(model: str | None, device: str) -> str:
    """The model to train: the flag, else the default for the device; checked before any rank starts."""
    import torch

    if model is None:
        if device == "cuda" or (device == "auto" and torch.cuda.is_available()):
            model = CUDA_DEFAULT_MODEL
        else:
            from llamarl.exec.models import smollm2_path

            return str(smollm2_path())
    path = Path(model).expanduser()
    if path.exists() or model.startswith((".", "/", "~")):
        if not (path / "config.json").is_file():
            raise UsageError(f"--model {model}: no transformers model folder there (config.json not found)")
        return str(path.resolve())
    try:
        from transformers import AutoConfig

        AutoConfig.from_pretrained(model)
    except Exception as e:
        raise UsageError(
            f"--model {model}: cannot load it from the hub or its cache ({type(e).__name__})"
        ) from None
    return model


def _check_generator(config: RunConfig) -> None:
    """`--generator vllm` needs the vLLM environment and a local model folder: say so before ranks start."""
    if config.generator.backend != "vllm":
        return
    from llamarl.exec.vllm_env import VLLMEnvironmentError, find_vllm_python

    try:
        find_vllm_python(config.generator.vllm_python)
    except VLLMEnvironmentError as e:
        raise UsageError(f"--generator vllm: {e}") from None
    if not Path(config.model, "config.json").is_file():
        raise UsageError(f"--generator vllm serves a local model folder; --model {config.model} is not one")


def main(task: str, argv: list[str] | None = None) -> int:
    prog = f"{task}_rl"
    logging.basicConfig(level=logging.WARNING, format=f"{prog}: warning: %(message)s")
    try:
        config = parse_run_config(
            sys.argv[1:] if argv is None else argv,
            task=task,
            prog=prog,
            description=f"Asynchronous RL on {task.upper()} with llamarl.",
        )
        config = replace_in(
            config,
            model=resolve_model(config.model, config.ranks.device),
            **{"task.data": resolve_data(task, config.task.data, prog)},
        )
        _check_generator(config)
        train = load_examples(TASKS[task], config.task.data, "train")
        test = load_examples(TASKS[task], config.task.data, "test") if config.eval.size else []
        if config.eval.size > len(test):
            raise UsageError(
                f"--eval-size {config.eval.size} is larger than the test split ({len(test)} rows)"
            )
        summary = launch(config, train, test)
    except (UsageError, ConfigError, DataError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except RunFailed as e:
        # On a line of its own: the first trainer rank's progress bar may have been cut mid-line.
        print(f"\n{prog}: {e}", file=sys.stderr)
        return 1
    except RunInterrupted as e:
        print(f"\n{prog}: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:  # before any rank started
        print(f"{prog}: interrupted before the run started", file=sys.stderr)
        return 130
    shown = {
        k: summary[k]
        for k in (
            "mode",
            "steps",
            "wall_s",
            "step_time_s",
            "gen_tokens_per_s",
            "weight_sync_s",
            "eval_accuracy_start",
            "eval_accuracy_end",
            "final_policy_version",
            "peak_rss_mb_total",
        )
    }
    print(json.dumps(shown, indent=2))
    print(f"summary: {config.output_dir / 'summary.json'}")
    return 0
