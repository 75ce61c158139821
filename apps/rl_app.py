"""The command line shared by the RL apps (`uv run apps/gsm8k_rl`, `uv run apps/math_rl`).

Parses flags into a `RunConfig`, resolves the model and data, launches the run and prints its summary.
Every user error (a bad flag, a missing model or data file, a malformed row) ends in one line that
says what to fix; a failure inside a rank prints that rank's original error once.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from llamarl.algo import (
    ADVANTAGE_NAMES,
    MISMATCH_MODES,
    POLICY_LOSS_NAMES,
    get_advantage_estimator,
    get_policy_loss,
)
from llamarl.control import TASKS, ConfigError, DataError, RunConfig, RunFailed, launch, load_examples
from llamarl.control.config import KL_ESTIMATOR_NAMES
from llamarl.control.tasks import Task, hub_unavailable_reason
from llamarl.exec.schedules import LR_SCHEDULES

CUDA_DEFAULT_MODEL = "Qwen/Qwen2.5-0.5B-Instruct"
EMBEDDED_DATA = Path(__file__).resolve().parent / "data"  # compressed copies shipped with the apps


class UsageError(Exception):
    """A problem with the command line or its inputs, reported in one line."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line instead of usage + error
        raise UsageError(f"{message} (see --help)")

    def convert_arg_line_to_args(self, arg_line: str) -> list[str]:
        # Recipe files: "--flag value" per line, blank lines and "#" comments allowed.
        line = arg_line.split("#", 1)[0].strip()
        return line.split() if line else []


def build_parser(task: str) -> argparse.ArgumentParser:
    defaults = RunConfig(task=task, model="", output_dir="")
    p = _Parser(
        prog=f"{task}_rl",
        description=f"Asynchronous RL on {task.upper()} with llamarl. Flags may come from a file: "
        "@recipes/NAME.args (one flag or value per line; later flags override it).",
        fromfile_prefix_chars="@",
    )
    p.add_argument(
        "--model",
        help="hub id or local folder (default: SmolLM2-135M-Instruct on the CPU, "
        f"{CUDA_DEFAULT_MODEL} on CUDA)",
    )
    p.add_argument("--data", help=_data_help(TASKS[task]))
    p.add_argument("--output-dir", default=f"runs/{task}_rl", help="where summary.json, metrics, samples go")
    p.add_argument(
        "--mode",
        choices=["async", "sync", "stream"],
        default=defaults.mode,
        help="async: generation and training overlap in lock step, one policy version apart (the "
        "paper's); sync: one after the other; stream: generators never wait, the trainer takes the "
        "oldest groups within --max-policy-lag from a bounded buffer (default: %(default)s)",
    )
    p.add_argument(
        "--max-policy-lag",
        type=int,
        default=defaults.max_policy_lag,
        help="samples whose oldest token is more policy versions old are never trained on (stream "
        "mode drops and counts them; default: %(default)s)",
    )
    p.add_argument(
        "--stream-buffer",
        type=int,
        default=defaults.stream_buffer_groups,
        metavar="GROUPS",
        help="stream mode: groups the trainer's buffer holds (0: two steps' worth)",
    )
    p.add_argument(
        "--dynamic-sampling",
        action="store_true",
        help="drop groups whose samples all got the same reward and sample more prompts instead",
    )
    p.add_argument(
        "--max-engine-restarts",
        type=int,
        default=defaults.max_engine_restarts,
        help="stream mode with --generator vllm: dead engines a generator replaces while the trainer "
        "keeps going (default: %(default)s)",
    )
    p.add_argument(
        "--max-sampling-rounds",
        type=int,
        default=defaults.max_sampling_rounds,
        help="lock step with --dynamic-sampling: generate calls per batch at most (default: %(default)s)",
    )
    p.add_argument("--steps", type=int, default=defaults.steps, help="optimizer steps")
    p.add_argument("--prompts-per-step", type=int, default=defaults.prompts_per_step)
    p.add_argument("--samples-per-prompt", type=int, default=defaults.samples_per_prompt)
    p.add_argument("--max-new-tokens", type=int, default=defaults.max_new_tokens)
    p.add_argument("--temperature", type=float, default=defaults.temperature)
    p.add_argument("--eval-size", type=int, default=defaults.eval_size, help="held-out questions (0: skip)")
    p.add_argument(
        "--eval-samples",
        type=int,
        default=defaults.eval_samples,
        help="also score this many answers per held-out question sampled at --temperature (0: greedy only)",
    )
    p.add_argument(
        "--eval-every",
        type=int,
        default=defaults.eval_every,
        help="evaluate every K steps too (0: start, end)",
    )
    p.add_argument("--seed", type=int, default=defaults.seed)
    p.add_argument("--loss", choices=sorted(POLICY_LOSS_NAMES), default=defaults.loss)
    p.add_argument("--advantage", choices=sorted(ADVANTAGE_NAMES), default=defaults.advantage)
    p.add_argument(
        "--loss-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a hyperparameter of the loss, e.g. rho=4 (repeatable)",
    )
    p.add_argument(
        "--mismatch-is",
        choices=sorted(MISMATCH_MODES),
        help="correct the generator/trainer log-prob mismatch by importance sampling (off by default)",
    )
    p.add_argument("--mismatch-cap", type=float, default=2.0, help="cap of the --mismatch-is weights")
    p.add_argument("--lr", type=float, default=defaults.lr, help="peak learning rate")
    p.add_argument("--lr-schedule", choices=list(LR_SCHEDULES), default=defaults.lr_schedule)
    p.add_argument("--warmup-steps", type=int, default=defaults.warmup_steps, help="linear lr warmup")
    p.add_argument("--micro-batch-size", type=int, default=defaults.micro_batch_size)
    p.add_argument(
        "--pack-tokens",
        type=int,
        default=defaults.pack_tokens,
        help="pack trainer micro-batches up to this many tokens, no padding (0: padded rows)",
    )
    p.add_argument("--max-grad-norm", type=float, default=defaults.max_grad_norm)
    p.add_argument(
        "--kl-coef", type=float, default=defaults.kl_coef, help="KL penalty to a frozen reference (0: none)"
    )
    p.add_argument("--kl-estimator", choices=list(KL_ESTIMATOR_NAMES), default=defaults.kl_estimator)
    p.add_argument(
        "--activation-checkpointing", action="store_true", help="recompute activations in backward"
    )
    p.add_argument(
        "--num-trainers", type=int, default=defaults.num_trainers, help="trainer ranks (FSDP2 over them)"
    )
    p.add_argument(
        "--generator",
        choices=["hf", "vllm"],
        default=defaults.generator,
        help="hf: transformers' generate in the rank; vllm: a vLLM engine per generator rank "
        "(build its environment once with tools/setup_vllm_env.sh)",
    )
    p.add_argument("--vllm-python", help="interpreter of the vLLM environment (default: the cached one)")
    p.add_argument("--num-generators", type=int, default=defaults.num_generators, help="generator ranks")
    p.add_argument(
        "--nnodes", type=int, default=defaults.nnodes, help="machines (run the same command on each)"
    )
    p.add_argument("--rdzv-endpoint", help="host:port of the first machine, for --nnodes > 1")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default=defaults.device)
    p.add_argument("--threads-per-rank", type=int, help="CPU threads per rank")
    p.add_argument(
        "--timeout", type=float, default=defaults.timeout_s, help="deadline (s) of any wait on a peer"
    )
    p.add_argument(
        "--weight-sync-timeout",
        type=float,
        default=defaults.weight_sync_timeout_s,
        help="deadline (s) of each step of a weight sync (capped by --timeout; default: %(default)s)",
    )
    p.add_argument("--wandb-project", default=defaults.wandb_project)
    p.add_argument("--no-wandb", action="store_true", help="do not log to Weights & Biases")
    p.add_argument("--no-save-model", action="store_true", help="do not write OUTPUT_DIR/final_model")
    p.add_argument(
        "--checkpoint-every",
        type=int,
        default=defaults.checkpoint_every,
        help="checkpoint the whole run every K steps into OUTPUT_DIR/checkpoints (0: never)",
    )
    p.add_argument(
        "--keep-checkpoints", type=int, default=defaults.keep_checkpoints, help="complete checkpoints kept"
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from the latest complete checkpoint in --output-dir (from the start if none)",
    )
    p.add_argument(
        "--max-restarts",
        type=int,
        default=defaults.max_restarts,
        help="after a failure restart all ranks up to R times, each resuming from the latest checkpoint",
    )
    return p


def _data_help(task: Task) -> str:
    if task.hub_id is None:
        return "folder with train.jsonl and test.jsonl (default: the task's questions, made in code)"
    return (
        f"folder with train.jsonl and test.jsonl, or a hub dataset id (default: {task.hub_id}, or the "
        "copy shipped in apps/data when the hub cannot be reached)"
    )


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


def config_from_args(task: str, args: argparse.Namespace, model: str) -> RunConfig:
    return RunConfig(
        task=task,
        model=model,
        output_dir=args.output_dir,
        mode=args.mode,
        max_policy_lag=args.max_policy_lag,
        stream_buffer_groups=args.stream_buffer,
        dynamic_sampling=args.dynamic_sampling,
        max_sampling_rounds=args.max_sampling_rounds,
        max_engine_restarts=args.max_engine_restarts,
        steps=args.steps,
        prompts_per_step=args.prompts_per_step,
        samples_per_prompt=args.samples_per_prompt,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        eval_size=args.eval_size,
        eval_samples=args.eval_samples,
        eval_every=args.eval_every,
        seed=args.seed,
        loss=args.loss,
        advantage=args.advantage,
        loss_hparams=_loss_hparams(args.loss_arg)
        | ({"mismatch_is": args.mismatch_is, "mismatch_cap": args.mismatch_cap} if args.mismatch_is else {}),
        lr=args.lr,
        lr_schedule=args.lr_schedule,
        warmup_steps=args.warmup_steps,
        micro_batch_size=args.micro_batch_size,
        pack_tokens=args.pack_tokens,
        max_grad_norm=args.max_grad_norm,
        kl_coef=args.kl_coef,
        kl_estimator=args.kl_estimator,
        activation_checkpointing=args.activation_checkpointing,
        num_trainers=args.num_trainers,
        generator=args.generator,
        vllm_python=args.vllm_python,
        num_generators=args.num_generators,
        nnodes=args.nnodes,
        rdzv_endpoint=args.rdzv_endpoint,
        device=args.device,
        threads_per_rank=args.threads_per_rank,
        timeout_s=args.timeout,
        weight_sync_timeout_s=args.weight_sync_timeout,
        wandb_project=args.wandb_project,
        wandb=not args.no_wandb,
        save_model=not args.no_save_model,
        checkpoint_every=args.checkpoint_every,
        keep_checkpoints=args.keep_checkpoints,
        resume=args.resume,
        max_restarts=args.max_restarts,
    )


def _loss_hparams(pairs: list[str]) -> dict[str, float]:
    hparams = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        try:
            hparams[key.strip().replace("-", "_")] = float(value)
        except ValueError:
            sep = ""
        if not sep or not key.strip():
            raise UsageError(f"--loss-arg expects KEY=NUMBER, got {pair!r}")
    return hparams


def _check_algorithm(config: RunConfig) -> None:
    """Binds the loss and advantage by name once here, so a bad hyperparameter fails before launch."""
    try:
        get_policy_loss(config.loss, **config.loss_hparams)
        get_advantage_estimator(config.advantage)
    except ValueError as e:
        raise UsageError(str(e)) from None


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
    if config.generator != "vllm":
        return
    from llamarl.exec.vllm_env import VLLMEnvironmentError, find_vllm_python

    try:
        find_vllm_python(config.vllm_python)
    except VLLMEnvironmentError as e:
        raise UsageError(f"--generator vllm: {e}") from None
    if not Path(config.model, "config.json").is_file():
        raise UsageError(f"--generator vllm serves a local model folder; --model {config.model} is not one")


def main(task: str, argv: list[str] | None = None) -> int:
    prog = f"{task}_rl"
    logging.basicConfig(level=logging.WARNING, format=f"{prog}: warning: %(message)s")
    try:
        args = build_parser(task).parse_args(argv)
        model = resolve_model(args.model, args.device)
        config = config_from_args(task, args, model)
        config.validate()
        _check_algorithm(config)
        _check_generator(config)
        data = resolve_data(task, args.data, prog)
        train = load_examples(TASKS[task], data, "train")
        test = load_examples(TASKS[task], data, "test") if config.eval_size else []
        if config.eval_size > len(test):
            raise UsageError(
                f"--eval-size {config.eval_size} is larger than the test split ({len(test)} rows)"
            )
        summary = launch(config, train, test)
    except (UsageError, ConfigError, DataError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except RunFailed as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
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
    print(f"summary: {Path(config.output_dir) / 'summary.json'}")
    return 0
