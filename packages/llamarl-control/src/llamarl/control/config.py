"""Run configuration: one dataclass for the whole job, validated before any process starts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from llamarl.exec.schedules import LR_SCHEDULES

KL_ESTIMATOR_NAMES = ("k1", "k2", "k3")  # llamarl.algo.kl's estimators (control does not import algo)


class ConfigError(ValueError):
    """A configuration that cannot run; the message says which setting to change."""


@dataclass(kw_only=True)
class RunConfig:
    """Everything one RL run needs. Apps build it from the command line; tests build it directly."""

    # What to learn.
    task: str  # a name in llamarl.control.tasks.TASKS (gsm8k, math, arith): schema, prompt and reward
    model: str  # hub id or local folder of a transformers causal LM (the starting policy)
    output_dir: str  # summary.json, metrics.jsonl, samples, W&B run, logs, final model

    # The schedule.
    # async: generate and train at once in lock step (lag 1); sync: in sequence (lag 0); stream:
    # generators never wait for the trainer, which trains on the oldest groups of a bounded buffer that
    # are within max_policy_lag
    mode: Literal["async", "sync", "stream"] = "async"
    steps: int = 4  # optimizer steps (each one policy_version)
    prompts_per_step: int = 4  # prompts per training batch, split evenly across generators
    samples_per_prompt: int = 4  # completions per prompt (the group of the group-mean baseline)
    max_new_tokens: int = 128  # completion length limit while training and evaluating
    temperature: float = 1.0  # sampling temperature; the trainer scores tokens at the same temperature
    eval_size: int = 16  # held-out test questions scored greedily before and after training (0: none)
    eval_samples: int = 0  # also sample this many answers per question at `temperature` (0: greedy only)
    eval_every: int = 0  # evaluate also every this many ticks inside the loop, for curves (0: never)
    seed: int = 0  # prompt order, sampling and model initialisation
    max_policy_lag: int = 1  # the trainer refuses rollouts older than this many policy versions; stream
    # mode drops (and counts) groups whose oldest token is older
    stream_buffer_groups: int = 0  # stream: groups the trainer's buffer holds (0: two steps' worth)
    dynamic_sampling: bool = False  # drop groups whose rewards are all equal and sample more prompts
    max_sampling_rounds: int = 4  # lock step with dynamic sampling: generate calls per batch at most

    # The algorithm (names resolved by llamarl.algo's registry).
    loss: str = "aipo"  # policy loss
    advantage: str = "group_mean"  # advantage estimator
    loss_hparams: dict[str, float | str] = field(default_factory=dict)  # e.g. {"rho": 4.0}
    lr: float = 3e-6  # AdamW peak learning rate
    lr_schedule: str = "constant"  # after warmup: "constant", "linear" or "cosine" decay to 0 at `steps`
    warmup_steps: int = 0  # optimizer steps of linear learning-rate warmup
    weight_decay: float = 0.0  # AdamW weight decay
    micro_batch_size: int = 4  # sequences per forward/backward pass on the trainer (padded rows)
    pack_tokens: int = 0  # > 0: packed trainer micro-batches of at most this many tokens, no padding
    max_grad_norm: float = 1.0  # gradient clipping threshold (on the global norm over trainer ranks)
    kl_coef: float = 0.0  # > 0: KL penalty to a frozen reference policy held by the trainer ranks
    kl_estimator: str = "k3"  # "k1", "k2" or "k3"
    activation_checkpointing: bool = False  # recompute activations in backward: less memory, more compute

    # The generator backend.
    generator: Literal["hf", "vllm"] = "hf"  # hf: transformers' generate in the rank; vllm: a vLLM engine
    # per generator rank, in its own process and environment (tools/setup_vllm_env.sh builds it)
    vllm_python: str | None = None  # interpreter of the vLLM environment; None: $LLAMARL_VLLM_PYTHON,
    # else the one tools/setup_vllm_env.sh builds in ~/.cache/llamarl
    vllm_max_model_len: int | None = None  # prompt + completion limit of each engine; None: the model's
    max_engine_restarts: int = 3  # stream mode: dead vLLM engines a generator replaces before failing

    # Ranks and devices.
    num_trainers: int = 1  # trainer ranks 0..N-1 (FSDP2 over them when N > 1, or on CUDA); rank 0 logs
    num_generators: int = 1  # generator ranks N..N+G-1 (data-parallel replicas)
    nnodes: int = 1  # machines; ranks are spread evenly over them by torch elastic
    rdzv_endpoint: str | None = None  # host:port of the rendezvous for nnodes > 1
    device: str = "auto"  # "auto" (CUDA when present), "cpu" or "cuda"
    threads_per_rank: int | None = None  # CPU threads per rank; default splits the cores across ranks
    weight_bucket_mb: int = 64  # bucket size of the trainer -> generator weight transfer
    timeout_s: float = 600.0  # deadline for any wait on another process
    # Deadline of each step of a weight sync (forming the group, every bucket; capped by timeout_s).
    # Lower it where engines may die (stream mode with vLLM): a sync caught in an engine's death then
    # fails within this long instead of timeout_s. Not lower by default: on a loaded machine a relaying
    # generator can take minutes to reach its next decoding step.
    weight_sync_timeout_s: float = 600.0

    # Outputs.
    wandb_project: str = "llamarl"  # W&B project; offline unless WANDB_API_KEY is set
    wandb: bool = True  # log to W&B at all
    save_model: bool = True  # write the final policy to OUTPUT_DIR/final_model
    reward_timeout_s: float = 10.0  # per-sample deadline of the answer checker

    # Fault tolerance (llamarl.control.checkpoint).
    checkpoint_every: int = 0  # checkpoint every this many policy versions (OUTPUT_DIR/checkpoints; 0: never)
    keep_checkpoints: int = 2  # complete checkpoints kept (older ones are deleted)
    resume: bool = False  # continue from the latest complete checkpoint in output_dir (fresh start if none)
    max_restarts: int = 0  # torch elastic restarts of all ranks after a failure; each resumes by itself

    @property
    def sync_deadline_s(self) -> float:
        return min(self.weight_sync_timeout_s, self.timeout_s)

    @property
    def buffer_groups(self) -> int:
        """The stream buffer's capacity in groups."""
        return self.stream_buffer_groups or 2 * self.prompts_per_step

    @property
    def world_size(self) -> int:
        return self.num_trainers + self.num_generators

    def validate(self) -> None:
        """Raises ConfigError with the setting to fix."""
        positive = {
            "steps": self.steps,
            "prompts_per_step": self.prompts_per_step,
            "samples_per_prompt": self.samples_per_prompt,
            "max_new_tokens": self.max_new_tokens,
            "micro_batch_size": self.micro_batch_size,
            "num_trainers": self.num_trainers,
            "num_generators": self.num_generators,
            "nnodes": self.nnodes,
            "max_policy_lag": self.max_policy_lag,
            "weight_bucket_mb": self.weight_bucket_mb,
            "max_sampling_rounds": self.max_sampling_rounds,
        }
        for name, value in positive.items():
            if value < 1:
                raise ConfigError(f"{name} must be at least 1, got {value}")
        if self.mode not in ("async", "sync", "stream"):
            raise ConfigError(f"mode must be 'async', 'sync' or 'stream', got {self.mode!r}")
        if self.stream_buffer_groups < 0:
            raise ConfigError(f"stream_buffer_groups must be 0 or more, got {self.stream_buffer_groups}")
        if self.mode == "stream":
            # Stream ranks never meet at a tick boundary, where checkpoints and in-loop evaluations are
            # taken; both are lock-step features for now.
            for name in ("checkpoint_every", "eval_every", "max_restarts"):
                if getattr(self, name):
                    raise ConfigError(f"{name} is not supported with mode 'stream' yet; use async or sync")
            if self.resume:
                raise ConfigError("resume is not supported with mode 'stream' yet; use async or sync")
            if 0 < self.stream_buffer_groups < self.prompts_per_step:
                raise ConfigError(
                    f"stream_buffer_groups ({self.stream_buffer_groups}) must hold at least one step's "
                    f"prompts ({self.prompts_per_step})"
                )
        if self.temperature <= 0:
            raise ConfigError(f"temperature must be positive, got {self.temperature}")
        if self.keep_checkpoints < 1:
            raise ConfigError(f"keep_checkpoints must be at least 1, got {self.keep_checkpoints}")
        for name in (
            "eval_size",
            "eval_samples",
            "eval_every",
            "checkpoint_every",
            "max_restarts",
            "max_engine_restarts",
        ):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be 0 or more, got {getattr(self, name)}")
        if min(self.lr, self.timeout_s, self.reward_timeout_s, self.weight_sync_timeout_s) <= 0:
            raise ConfigError("lr, timeout_s, weight_sync_timeout_s and reward_timeout_s must be positive")
        if self.prompts_per_step % self.num_generators:
            raise ConfigError(
                f"prompts_per_step ({self.prompts_per_step}) must be a multiple of num_generators "
                f"({self.num_generators})"
            )
        if self.prompts_per_step % self.num_trainers:
            raise ConfigError(
                f"prompts_per_step ({self.prompts_per_step}) must be a multiple of num_trainers "
                f"({self.num_trainers}): each trainer rank takes whole groups of samples"
            )
        if self.pack_tokens < 0 or self.warmup_steps < 0 or self.kl_coef < 0:
            raise ConfigError("pack_tokens, warmup_steps and kl_coef must be 0 or more")
        if self.kl_estimator not in KL_ESTIMATOR_NAMES:
            raise ConfigError(
                f"kl_estimator must be one of {', '.join(KL_ESTIMATOR_NAMES)}, got {self.kl_estimator!r}"
            )
        if self.lr_schedule not in LR_SCHEDULES:
            raise ConfigError(
                f"lr_schedule must be one of {', '.join(LR_SCHEDULES)}, got {self.lr_schedule!r}"
            )
        if self.world_size % self.nnodes:
            raise ConfigError(f"{self.world_size} ranks cannot be spread evenly over {self.nnodes} nodes")
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise ConfigError("several nodes need a rendezvous endpoint (host:port of the first node)")
        if self.generator not in ("hf", "vllm"):
            raise ConfigError(f"generator must be 'hf' or 'vllm', got {self.generator!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"device must be auto, cpu or cuda, got {self.device!r}")
