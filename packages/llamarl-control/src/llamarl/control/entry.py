"""Running a task: from Python (`train`) or as a command line (`main`), the built-in tasks and a user's
own alike.

    from llamarl.control import Task, main, train

    summary = train(TASK, schedule={"steps": 4}, sampling={"max_new_tokens": 64})   # from code
    raise SystemExit(main(TASK))       # a script whose flags are the run's settings (--steps 4, --help)

Everything a run needs is checked here, before any rank starts: the settings, the task (its functions
must reach the ranks and reward workers), the model, the generator (chosen here when the settings name
none: `llamarl.control.launch.generator_choice`) and its environment, and the rows; each
problem is one line (`ConfigError`, `TaskError`, `DataError`), which `main` prints and exits 2 with.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llamarl.control.cli import parse_run_config
from llamarl.control.config import ConfigError, RunConfig, replace_in
from llamarl.control.tasks import DataError, Task, TaskError, load_rows
from llamarl.control.tasks.registry import load_task, register_task

if TYPE_CHECKING:
    from llamarl.control.launch.launcher import Launched

CUDA_DEFAULT_MODEL = "Qwen/Qwen2.5-0.5B-Instruct"

SUMMARY_SHOWN = (
    "mode",
    "steps",
    "wall_s",
    "step_time_s",
    "gen_tokens_per_s",
    "weight_sync_s",
    "eval_accuracy_start",
    "eval_accuracy_end",
    "eval_reward_start",
    "eval_reward_end",
    "final_policy_version",
    "peak_rss_mb_total",
    "peak_pss_mb_total",
)

DataResolver = Callable[[RunConfig, Task], str | None]
"""`(config, task) -> task.data`: where an app finds the rows when the task's default is unreachable."""


def train(task: Task | str | None = None, argv: list[str] | None = None, **settings: Any) -> dict[str, Any]:
    """Trains `task` and returns the run's summary (also in OUTPUT_DIR/summary.json).

    Args:
        task: a `Task` (given in code), a task's name, or None (then `task.module` or `task.name` must be
            among the settings).
        argv: command-line flags over the settings (`["--steps", "4"]`); `--config FILE` too.
        settings: the run config's sections and top-level fields as keyword arguments, e.g.
            `model="HuggingFaceTB/SmolLM2-135M-Instruct", schedule={"steps": 4}`.

    Raises:
        ConfigError, TaskError, DataError: one line saying what to fix, before any rank starts.
        RunFailed: a rank failed; its original error.
    """
    config, task_object = configure(task, argv or [], settings)
    launched = run(config, task_object)
    if launched is None or launched.summary is None:
        raise RuntimeError(
            "train() returns the summary on the machine of the first trainer rank; use main() on the others"
        )
    return launched.summary


def configure(
    task: Task | str | None, argv: list[str], settings: dict[str, Any] | None = None, *, prog: str = "llamarl"
) -> tuple[RunConfig, Task]:
    """The validated run config of a task, settings and flags (flags win), and the task itself."""
    if isinstance(task, Task):
        register_task(task)  # known by its name from here on (config validation, the ranks)
        name: str | None = task.name
    else:
        name = task
    description = f"Asynchronous RL on {name or 'a task'} with llamarl."
    config = parse_run_config(argv, task=name, prog=prog, description=description, defaults=settings or {})
    return config, load_task(config.task.name, config.task.module)


def run(config: RunConfig, task: Task, resolve_data: DataResolver | None = None) -> Launched | None:
    """Resolves the model and the rows of a validated config, then launches this machine's ranks, or,
    under torchrun, runs this process's rank. Returns what the job left here (None on a torchrun rank
    other than the first trainer rank)."""
    from llamarl.control.launch.generator_choice import choose_generator
    from llamarl.control.launch.launcher import launch, run_this_rank, under_torchrun
    from llamarl.control.launch.output_dir import refuse_if_in_use

    if not under_torchrun() and config.launch.nnodes == 1:  # (machines of one job share the folder)
        refuse_if_in_use(config.output_dir)  # a folder that cannot serve is said first
    eval_size_given = "size" in config.eval.model_fields_set  # before replace_in sets every field
    changes: dict[str, Any] = {"model": resolve_model(config.model, config.ranks.device)}
    if resolve_data is not None:
        changes["task.data"] = resolve_data(config, task)
    config = replace_in(config, **changes)
    check_model(config)
    train_rows = load_rows(task, config.task.data, "train")
    test_rows = load_rows(task, config.task.data, "test") if config.eval.size else []
    config = fit_eval_size(config, len(test_rows), given=eval_size_given)
    # generator.backend auto: the backend chosen here (and said) is the one config.toml records.
    config = choose_generator(config)
    check_generator(config)
    if under_torchrun():  # this process is one rank
        return run_this_rank(config, train_rows, test_rows, task)
    return launch(config, train_rows, test_rows, task)


def main(
    task: Task | str | None = None,
    argv: list[str] | None = None,
    *,
    prog: str | None = None,
    resolve_data: DataResolver | None = None,
) -> int:
    """A command line for `task`: the flags (`--help` lists them) are the run's settings; prints the
    summary. Returns the exit status: 0, 2 for a problem with the input (one line), 1 when a rank failed,
    128 + the signal when Ctrl-C or SIGTERM stopped the run (it says where the last checkpoint is).
    """
    from llamarl.control.launch.failures import RunFailed, RunInterrupted

    name = task.name if isinstance(task, Task) else task
    prog = prog or (f"{name}_rl" if name else Path(sys.argv[0]).name)
    logging.basicConfig(level=logging.WARNING, format=f"{prog}: warning: %(message)s")
    try:
        config, task_object = configure(task, sys.argv[1:] if argv is None else argv, prog=prog)
        launched = run(config, task_object, resolve_data)
    except (ConfigError, TaskError, DataError) as e:
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
    if launched is None:  # a rank under torchrun other than the first trainer rank
        return 0
    if launched.summary is None:  # another machine of the job holds the first trainer rank
        where = f"{launched.summary_path} on {launched.summary_host}"
        print(f"summary: {where} (the machine of the first trainer rank)")
        return 0
    summary = launched.summary
    print(json.dumps({k: summary[k] for k in SUMMARY_SHOWN if k in summary}, indent=2))
    print(f"summary: {config.output_dir / 'summary.json'}")
    return 0


def resolve_model(model: str | None, device: str) -> str:
    """The model to train: the setting, else the default for the device; checked before any rank starts."""
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
            raise ConfigError(f"--model {model}: no transformers model folder there (config.json not found)")
        return str(path.resolve())
    try:
        from transformers import AutoConfig

        AutoConfig.from_pretrained(model)
    except Exception as e:
        raise ConfigError(
            f"--model {model}: cannot load it from the hub or its cache ({type(e).__name__})"
        ) from None
    return model


def fit_eval_size(config: RunConfig, test_rows: int, *, given: bool) -> RunConfig:
    """The evaluation's size within the test split: a default larger than the split shrinks to it with
    a one-line note; a size the user gave (`given`) that the split cannot hold is a ConfigError."""
    if config.eval.size <= test_rows:
        return config
    if given:
        raise ConfigError(f"--eval-size {config.eval.size} is larger than the test split ({test_rows} rows)")
    logging.getLogger(__name__).warning(
        "the test split has %d rows: evaluating on all of them (--eval-size %d by default)",
        test_rows,
        config.eval.size,
    )
    return replace_in(config, **{"eval.size": test_rows})


def check_model(config: RunConfig) -> None:
    """Refuses, in one line before any rank starts, what the model cannot do: a completion budget its
    context cannot hold, routing replay it cannot have (`llamarl.exec.moe.routes.check_routing`: replay
    of a dense model, a mixture of experts whose router has no recorder), a mixture of experts on a
    generator or with adapters that do not serve one yet."""
    from llamarl.exec.models import read_model_config
    from llamarl.exec.moe.routes import check_routing, num_experts
    from llamarl.exec.train.expert_parallel import check_expert_parallel

    try:
        model_config = read_model_config(config.model)
    except Exception:  # resolve_model checked it loads; a config that does not say is no reason to stop
        return
    context = next(
        (
            getattr(model_config, name)
            for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")
            if isinstance(getattr(model_config, name, None), int)
        ),
        None,
    )
    if context is not None and config.sampling.max_new_tokens >= context:
        raise ConfigError(
            f"--max-new-tokens {config.sampling.max_new_tokens} does not fit the model's context of "
            f"{context} tokens ({config.model}): give at most {context - 1}, less the prompt's length"
        )
    try:
        check_routing(model_config, config.algorithm.routing_replay, model=config.model)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    experts = num_experts(model_config)
    moe = bool(experts)
    if moe and config.generator.backend == "vllm":
        raise ConfigError(
            f"--generator vllm: {config.model} is a mixture of experts, whose weight syncs and routes the "
            "vLLM generator does not take yet; use --generator hf"
        )
    if config.trainer.expert_parallel:
        trainers = config.ranks.num_trainers
        if not moe:
            raise ConfigError(f"trainer.expert_parallel: {config.model} is not a mixture of experts")
        if trainers < 2:
            raise ConfigError(
                "trainer.expert_parallel shards experts over the trainer ranks: give --num-trainers 2 or more"
            )
        try:
            check_expert_parallel(experts, trainers)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    if moe and config.trainer.lora.rank:
        raise ConfigError("trainer.lora.rank > 0: LoRA on a mixture of experts' experts is not supported yet")


def check_generator(config: RunConfig) -> None:
    """`--generator vllm` needs the vLLM environment and a local model folder: say so before ranks start."""
    if config.generator.backend != "vllm":
        return
    from llamarl.control.launch.devices import uses_cuda
    from llamarl.exec.generate.vllm.env import VLLMEnvironmentError, find_vllm_python

    try:
        find_vllm_python(config.generator.vllm_python, cuda=uses_cuda(config))
    except VLLMEnvironmentError as e:
        raise ConfigError(f"--generator vllm: {e}") from None
    if not Path(config.model, "config.json").is_file():
        raise ConfigError(f"--generator vllm serves a local model folder; --model {config.model} is not one")
