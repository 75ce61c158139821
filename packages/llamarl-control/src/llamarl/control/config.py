"""The run configuration: one typed tree, each setting declared once.

`RunConfig` nests one section per part of the architecture. The executors' sections (sampling,
algorithm, trainer, generator, reward) are declared in `llamarl.exec.config`, next to the executors that
take them; the sections below are the controller's. The command line (`--section.field`, plus the short
flags in `llamarl.control.cli.SHORT_FLAGS`), TOML/YAML config files and `--help` are all derived from
this tree by pydantic-settings (`llamarl.control.cli`), never restated.

Every section validates its own fields (types, ranges, unknown keys); `RunConfig` checks the settings
that constrain each other. Sections are immutable: derive a changed config with `replace_in`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from llamarl.comm import DEAD_AFTER_S
from llamarl.exec.config import (
    AlgorithmConfig,
    ConfigSection,
    GeneratorConfig,
    RewardConfig,
    RewardModelConfig,
    SamplingConfig,
    TrainerConfig,
)
from llamarl.exec.train.compiled_modules import refuse_compile_under_fsdp2

__all__ = [
    "CheckpointConfig",
    "ConfigError",
    "EvalConfig",
    "LaunchConfig",
    "OutputConfig",
    "RanksConfig",
    "RunConfig",
    "ScheduleConfig",
    "TaskConfig",
    "WeightSyncConfig",
    "replace_in",
]


Role = Literal["trainer", "generator", "reward"]
"""What a rank runs: the trainer, a generator, or a reward model of its own."""


class ConfigError(ValueError):
    """A configuration that cannot run; the message says which setting to change, in one line."""


class TaskConfig(ConfigSection):
    """What to learn: the task (its rows, prompt and rewards) and where its rows come from."""

    name: str | None = None
    """the task: gsm8k, math or arith (built in; each app sets its own), or reasoning_gym:DATASET (a
    reasoning-gym generator); with module set, the name of the module's task"""
    module: str | None = None
    """a task of your own: 'package.module:NAME' or 'path/to/file.py:NAME', NAME a llamarl Task (or a
    function returning one); imported and checked before any rank starts"""
    data: str | None = None
    """folder with train.jsonl and test.jsonl (or .jsonl.gz), or a hub dataset id (unset: the task's
    default: its hub dataset, the copy shipped in apps/data when the hub is unreachable, or rows made in
    code)"""

    @model_validator(mode="before")
    @classmethod
    def _known_task(cls, data: Any) -> Any:
        # The task is resolved here, so a module that does not import or defines no Task is one line
        # before any rank starts; a module's task gives the run its name.
        if not isinstance(data, dict):
            return data
        from llamarl.control.tasks.registry import load_task

        task = load_task(data.get("name"), data.get("module"))
        return {**data, "name": task.name} if data.get("module") else data


class ScheduleConfig(ConfigSection):
    """When generation and training run, and how far apart they may drift."""

    mode: Literal["async", "sync", "stream"] = "async"
    """async: generation and training overlap in lock step, one policy version apart (the paper's);
    sync: one after the other; stream: generators never wait, the trainer takes the oldest groups within
    max_policy_lag from a bounded buffer"""
    steps: int = Field(4, ge=1)
    """optimizer steps (each makes one policy_version)"""
    prompts_per_step: int = Field(4, ge=1)
    """prompts per training batch, split evenly across generators and trainer ranks"""
    max_policy_lag: int = Field(1, ge=1)
    """samples whose oldest token is more policy versions old are never trained on (stream mode drops
    and counts them)"""
    buffer_groups: int = Field(0, ge=0)
    """stream mode: groups the trainer's rollout buffer holds (0: two steps' worth)"""
    dynamic_sampling: bool = False
    """drop groups whose samples all got the same reward and sample more prompts instead"""
    max_sampling_rounds: int = Field(4, ge=1)
    """with dynamic_sampling: generate calls per batch at most before flat groups are used after all"""


class RanksConfig(ConfigSection):
    """How many ranks of each kind, on which devices, and how they share a GPU."""

    num_trainers: int = Field(1, ge=1)
    """trainer ranks 0..N-1 (FSDP2 over them when N > 1, or on CUDA); the first one logs"""
    num_generators: int = Field(1, ge=1)
    """generator ranks N..N+G-1 (data-parallel replicas, each scoring its own samples)"""
    num_reward_ranks: int = Field(0, ge=0)
    """reward-model ranks N+G..N+G+R-1, after the generators: each scores the batches of every R-th
    generator with reward_model.path and forwards them to the trainer (0: the reward model, if any,
    runs colocated in each generator rank)"""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto: CUDA when present; on CUDA every rank gets a GPU of its own (its local rank's), a vLLM
    generator rank's engine runs on it"""
    colocate: bool = False
    """CUDA, one machine: generator rank i shares the GPU of trainer rank i (as many generators as
    trainers); set trainer_memory_fraction and generator.gpu_memory_utilization to split it"""
    trainer_memory_fraction: float = Field(1.0, gt=0, le=1)
    """CUDA: share of its GPU's memory a trainer rank may allocate (torch's allocator cap)"""
    threads_per_rank: int | None = Field(None, ge=1)
    """CPU threads per rank (unset: the cores split across the ranks that run at once)"""


class LaunchConfig(ConfigSection):
    """Machines, restarts and the deadline of every wait, for the launch through torch elastic."""

    nnodes: int = Field(1, ge=1)
    """machines; ranks are spread evenly over them, in order (run the same command on each)"""
    rdzv_endpoint: str | None = None
    """host:port where the machines meet (a free port on one of them), for nnodes > 1"""
    rdzv_id: str | None = None
    """id of the job at the rendezvous, the same on every machine (unset: derived from rdzv_endpoint)"""
    max_restarts: int = Field(0, ge=0)
    """after a failure torch elastic restarts all ranks up to this many times (a lost machine once it
    is back); each resumes from the latest checkpoint"""
    timeout_s: float = Field(600.0, gt=0)
    """deadline (s) of any wait on another process (machines joining the job included)"""

    @property
    def run_id(self) -> str:
        """The rendezvous id: rdzv_id, else one every machine derives alike from the endpoint."""
        if self.rdzv_id:
            return self.rdzv_id
        endpoint = (self.rdzv_endpoint or "local").replace(":", "-").replace("/", "-")
        return f"llamarl-{endpoint}"


class WeightSyncConfig(ConfigSection):
    """Trainer -> generator weight transfers (llamarl.comm: shard to shard, no gather)."""

    bucket_mb: int = Field(64, ge=1)
    """bucket size of a transfer, MiB"""
    delta: Literal["auto", "on", "off"] = "auto"
    """changed-only syncs: only the weights whose value on the wire changed since the generators' last
    version travel (a full sync at the start, after a rejoin, on a version gap and every 64 syncs);
    auto: on where the weights cross machines or travel between GPUs in bf16 or fp8 (float32 weights
    change nearly everywhere), off on one CPU machine, where encoding costs more than the bytes saved"""
    timeout_s: float = Field(600.0, gt=0)
    """deadline (s) of each step of a sync (forming the group, every bucket), capped by launch.timeout_s;
    a receiver that died or hung, between syncs or mid-transfer, fails a sync sooner (dead_after_s)"""
    dead_after_s: float = Field(DEAD_AFTER_S, ge=2.0)
    """a member whose heartbeat (one beat a second) has stood still this long (s, at least two beats)
    is gone: a sync waiting for it fails then, whatever timeout_s (the trainer's on a generator, a
    generator's on the trainer)"""


class EvalConfig(ConfigSection):
    """Held-out evaluation, greedy and sampled, before and after training (and in between)."""

    size: int = Field(16, ge=0)
    """held-out test questions scored greedily before and after training (0: none)"""
    samples: int = Field(0, ge=0)
    """also sample this many answers per question at the training temperature (0: greedy only)"""
    every: int = Field(0, ge=0)
    """evaluate also every this many steps inside the loop, for learning curves (0: never)"""


class CheckpointConfig(ConfigSection):
    """Checkpoints of the whole run (OUTPUT_DIR/checkpoints), atomic and verified."""

    every: int = Field(0, ge=0)
    """checkpoint every this many policy versions (0: never)"""
    keep: int = Field(2, ge=1)
    """complete checkpoints kept (older ones are deleted)"""
    resume: bool = False
    """continue from the latest complete checkpoint in the output folder (from the start if none)"""


class OutputConfig(ConfigSection):
    """Where a run writes: summary, metrics, samples, trace, report, W&B run, logs, final model."""

    dir: str = "runs/{task}_rl"
    """output folder ({task} is replaced by the task's name)"""
    wandb: bool = True
    """log to Weights & Biases (offline unless WANDB_API_KEY is set)"""
    wandb_project: str = "llamarl"
    """W&B project"""
    save_model: bool = True
    """write the final policy to OUTPUT_DIR/final_model"""


class RunConfig(ConfigSection):
    """One RL run: every setting of every rank, validated before any rank starts."""

    model: str | None = None
    """hub id or local transformers folder of the starting policy (unset: SmolLM2-135M-Instruct on the
    CPU, Qwen2.5-0.5B-Instruct on CUDA)"""
    seed: int = 0
    """prompt order, sampling and model initialisation"""
    task: TaskConfig
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    generator: GeneratorConfig = Field(default_factory=GeneratorConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    reward_model: RewardModelConfig = Field(default_factory=RewardModelConfig)
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig)
    ranks: RanksConfig = Field(default_factory=RanksConfig)
    launch: LaunchConfig = Field(default_factory=LaunchConfig)
    weight_sync: WeightSyncConfig = Field(default_factory=WeightSyncConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    output: OutputConfig = Field(default_factory=OutputConfig)

    @field_validator("task", mode="before")
    @classmethod
    def _task_by_name(cls, value: Any) -> Any:
        # `task="gsm8k"` is shorthand for `task={"name": "gsm8k"}` (code and tests).
        return {"name": value} if isinstance(value, str) else value

    @model_validator(mode="after")
    def _settings_agree(self) -> RunConfig:
        schedule, ranks, launch = self.schedule, self.ranks, self.launch
        for name, count in (
            ("ranks.num_generators", ranks.num_generators),
            ("ranks.num_trainers", ranks.num_trainers),
        ):
            if schedule.prompts_per_step % count:
                whole = " (each trainer rank takes whole groups)" if "trainers" in name else ""
                raise ValueError(
                    f"schedule.prompts_per_step ({schedule.prompts_per_step}) must be a multiple of "
                    f"{name} ({count}){whole}"
                )
        if ranks.num_reward_ranks and self.reward_model.path is None:
            raise ValueError("ranks.num_reward_ranks > 0 needs a reward model: set reward_model.path")
        if ranks.num_reward_ranks > ranks.num_generators:
            raise ValueError(
                f"ranks.num_reward_ranks ({ranks.num_reward_ranks}) must not exceed ranks.num_generators "
                f"({ranks.num_generators}): each reward rank serves whole generators"
            )
        if self.world_size % launch.nnodes:
            raise ValueError(
                f"{self.world_size} ranks cannot be spread evenly over launch.nnodes={launch.nnodes}"
            )
        if self.trainer.lora.rank and self.generator.backend == "vllm":
            # Syncs carry only the adapters; the hf generator holds the same peft adapters, a vLLM engine
            # would need them loaded as a LoRA adapter of its own (not built yet).
            raise ValueError("trainer.lora.rank > 0 needs generator.backend hf for now")
        # The trainer's own rule, checked before any rank starts (several trainer ranks: FSDP2).
        refuse_compile_under_fsdp2(self.trainer.compile, sharded=ranks.num_trainers > 1)
        if launch.nnodes > 1 and not launch.rdzv_endpoint:
            raise ValueError("launch.nnodes > 1 needs launch.rdzv_endpoint (host:port of the first machine)")
        if ranks.colocate:
            if ranks.num_generators != ranks.num_trainers:
                raise ValueError(
                    f"ranks.colocate pairs generator i with trainer i: ranks.num_generators "
                    f"({ranks.num_generators}) must equal ranks.num_trainers ({ranks.num_trainers})"
                )
            if launch.nnodes > 1:
                raise ValueError("ranks.colocate shares the GPUs of one machine; use it with launch.nnodes 1")
            shares = ranks.trainer_memory_fraction + self.generator.gpu_memory_utilization
            if shares > 1:
                raise ValueError(
                    f"ranks.colocate: ranks.trainer_memory_fraction ({ranks.trainer_memory_fraction}) + "
                    f"generator.gpu_memory_utilization ({self.generator.gpu_memory_utilization}) must be at "
                    "most 1 on a shared GPU"
                )
        if schedule.mode == "stream" and 0 < schedule.buffer_groups < schedule.prompts_per_step:
            raise ValueError(
                f"schedule.buffer_groups ({schedule.buffer_groups}) must hold at least one step's "
                f"prompts (schedule.prompts_per_step={schedule.prompts_per_step})"
            )
        return self

    # Derived settings: computed from the tree, never declared twice.

    @property
    def world_size(self) -> int:
        return self.ranks.num_trainers + self.ranks.num_generators + self.ranks.num_reward_ranks

    @property
    def trainer_ranks(self) -> list[int]:
        """The trainer ranks: the first ones (rank 0 logs and writes the summary)."""
        return list(range(self.ranks.num_trainers))

    @property
    def generator_ranks(self) -> list[int]:
        """The generator ranks, after the trainers."""
        first = self.ranks.num_trainers
        return list(range(first, first + self.ranks.num_generators))

    @property
    def reward_ranks(self) -> list[int]:
        """The reward ranks, after the trainers and the generators."""
        first = self.ranks.num_trainers + self.ranks.num_generators
        return list(range(first, first + self.ranks.num_reward_ranks))

    def setting(self, path: str) -> Any:
        """The setting at a dotted path, e.g. `config.setting("schedule.mode")`."""
        value: Any = self
        for key in path.split("."):
            value = getattr(value, key)
        return value

    def role_of(self, rank: int) -> Role:
        """The executor on `rank`: the one rule every part of a run asks (sides, devices, memory, the
        trace, the launcher's messages)."""
        if rank in self.trainer_ranks:
            return "trainer"
        if rank in self.generator_ranks:
            return "generator"
        if rank in self.reward_ranks:
            return "reward"
        raise ValueError(f"rank {rank} is not a rank of this run (world size {self.world_size})")

    def rank_label(self, rank: int) -> str:
        """How outputs name `rank`'s lane: "trainer" (one trainer rank) or "trainer 0", "generator 1",
        "reward 3"."""
        role = self.role_of(rank)
        return role if role == "trainer" and self.ranks.num_trainers == 1 else f"{role} {rank}"

    def reward_rank_of(self, generator_rank: int) -> int | None:
        """The reward rank that scores `generator_rank`'s batches (generators dealt out in turn), or None
        without reward ranks."""
        if not self.ranks.num_reward_ranks:
            return None
        index = generator_rank - self.ranks.num_trainers
        return self.reward_ranks[index % self.ranks.num_reward_ranks]

    @property
    def output_dir(self) -> Path:
        return Path(self.output.dir.replace("{task}", self.task.name))

    @property
    def buffer_groups(self) -> int:
        """The stream buffer's capacity in groups."""
        return self.schedule.buffer_groups or 2 * self.schedule.prompts_per_step

    @property
    def replaces_engines(self) -> bool:
        """Whether a dead vLLM engine is replaced while the trainer keeps its state: in stream mode with
        one trainer rank (elsewhere the run fails and torch elastic restarts it from a checkpoint)."""
        return (
            self.schedule.mode == "stream"
            and self.generator.backend == "vllm"
            and self.ranks.num_trainers == 1
        )

    @property
    def request_sequences(self) -> int:
        """Sequences one generator asks for in a request: its share of a step's prompts x samples per
        prompt (what a vLLM engine's max_num_seqs is sized to when unset)."""
        return self.schedule.prompts_per_step // self.ranks.num_generators * self.sampling.samples_per_prompt

    @property
    def sync_deadline_s(self) -> float:
        """The deadline of each step of a weight sync."""
        return min(self.weight_sync.timeout_s, self.launch.timeout_s)


def replace_in(config: RunConfig, **changes: Any) -> RunConfig:
    """A validated copy of `config` with `changes` by dotted path, e.g.
    `replace_in(config, **{"checkpoint.resume": True, "model": path})`."""
    data = config.model_dump()
    for path, value in changes.items():
        *parents, leaf = path.split(".")
        node = data
        for key in parents:
            node = node[key]
        node[leaf] = value
    try:
        return RunConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(describe(e)) from None


def describe(error: ValidationError, flags: dict[str, str] | None = None) -> str:
    """One line for a validation error: the setting's dotted path (and its short flag, if any), what is
    wrong with it, and the value given."""
    parts = []
    for item in error.errors():
        path = ".".join(str(p) for p in item["loc"])
        flag = (flags or {}).get(path)
        where = f"{path} ({flag})" if path and flag else path
        message = item["msg"].removeprefix("Value error, ")
        given = item.get("input")
        shown = (
            ""
            if item["type"] in ("value_error", "missing") or isinstance(given, dict)
            else f", got {given!r}"
        )
        parts.append(f"{where}: {message}{shown}" if where else message)
    return "; ".join(parts)
