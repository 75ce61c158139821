"""The executors' sections of the run configuration: each setting declared once, here, with its default,
type, one-line doc and range.

`llamarl.control.config.RunConfig` nests these sections (beside its own: task, schedule, ranks, ...);
the command line, config files and `--help` are derived from that tree. An executor takes its section
(and plain runtime arguments such as the device or the model folder), never a copy of its fields.

Every section is an immutable pydantic model that validates itself: a wrong type, an out-of-range value
or an unknown key raises `pydantic.ValidationError` naming the field.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from llamarl.algo import ADVANTAGE_NAMES, KL_ESTIMATORS, MISMATCH_MODES, POLICY_LOSS_NAMES, get_policy_loss
from llamarl.exec.train.lr_schedules import LR_SCHEDULES

# Literal types built from the registries, so `--help` lists the choices and a file's typo fails at load.
PolicyLossName = Literal[POLICY_LOSS_NAMES]  # type: ignore[valid-type]
AdvantageName = Literal[ADVANTAGE_NAMES]  # type: ignore[valid-type]
KLEstimatorName = Literal[tuple(sorted(KL_ESTIMATORS))]  # type: ignore[valid-type]
MismatchMode = Literal[MISMATCH_MODES]  # type: ignore[valid-type]
LRScheduleName = Literal[LR_SCHEDULES]  # type: ignore[valid-type]
Precision = Literal["auto", "bf16", "fp32"]
CompileMode = Literal["auto", "on", "off"]
RoutingReplay = Literal["auto", "off", "r3"]


class ConfigSection(BaseModel):
    """A section of the run configuration: immutable, unknown keys refused, each field documented by
    the docstring under it (what `--help` prints)."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class SamplingConfig(ConfigSection):
    """How completions are sampled (the trainer scores tokens at the same temperature)."""

    samples_per_prompt: int = Field(4, ge=1)
    """completions per prompt: the group whose mean reward is each sample's baseline"""
    max_new_tokens: int = Field(128, ge=1)
    """completion length limit, in training and evaluation"""
    temperature: float = Field(1.0, gt=0)
    """sampling temperature; the behaviour log-probs and the trainer's log-probs use the same one"""
    max_turns: int = Field(4, ge=1)
    """multi-turn tasks (tools, environments): model turns per episode at most (max_new_tokens each)"""
    max_episode_tokens: int = Field(1024, ge=1)
    """multi-turn tasks: model and environment tokens of an episode's completion at most"""


class AlgorithmConfig(ConfigSection):
    """The RL objective: policy loss, advantage estimator, KL penalty, mismatch correction."""

    loss: PolicyLossName = "aipo"
    """policy loss (llamarl.algo's registry; see docs/algorithms.md)"""
    loss_hparams: dict[str, float] = Field(default_factory=dict)
    """hyper-parameters of the loss by name, e.g. rho=4 (AIPO's truncation); the loss's defaults otherwise"""
    advantage: AdvantageName = "group_mean"
    """advantage estimator (the group-mean baseline is AIPO's)"""
    mismatch_is: MismatchMode | None = None
    """correct the generator/trainer log-prob mismatch by importance sampling (off when unset)"""
    mismatch_cap: float = Field(2.0, gt=0)
    """truncation / masking threshold of mismatch_is"""
    kl_coef: float = Field(0.0, ge=0)
    """> 0: KL penalty to a frozen reference policy held by the trainer ranks"""
    kl_estimator: KLEstimatorName = "k3"
    """KL estimator of the penalty (k1, k2 or k3)"""
    router_aux_coef: float = Field(0.0, ge=0)
    """mixture-of-experts policies: weight of the routers' load-balancing loss (E x sum_e f_e P_e, as
    transformers' `load_balancing_loss_func`, over the experts used) added to the policy loss; its
    value is logged (router_aux_loss) at any weight"""
    routing_replay: RoutingReplay = "auto"
    """mixture-of-experts policies: r3 scores each sampled token through the experts the generator
    routed it to (the router still learns); off lets the trainer route itself; auto is r3 for a MoE
    (without it trainer and generator disagree on a share of routes and RL on MoEs collapses) and
    nothing for a dense model"""

    @model_validator(mode="after")
    def _loss_takes_its_hparams(self) -> AlgorithmConfig:
        # Binding by name checks the hyper-parameter names now, not at the first training step.
        get_policy_loss(self.loss, **self.loss_hparams)
        return self


class LoraConfig(ConfigSection):
    """LoRA adapters (peft): the base weights stay frozen and only the adapters train."""

    rank: int = Field(0, ge=0)
    """> 0: train LoRA adapters of this rank on the `targets` layers (the base weights frozen); the
    generators receive only the adapters' tensors at each weight sync; 0: train every weight"""
    alpha: float | None = Field(None, gt=0)
    """LoRA scaling numerator: the update is (alpha / rank) B A (unset: 2 x rank)"""
    targets: list[str] = Field(default_factory=lambda: ["all-linear"])
    """module names that get adapters (e.g. q_proj v_proj), or all-linear: every linear layer but the
    output head"""

    @property
    def scale_alpha(self) -> float:
        """alpha, with its default resolved."""
        return self.alpha if self.alpha is not None else 2.0 * self.rank


class TrainerConfig(ConfigSection):
    """The trainer: optimizer, learning-rate schedule, precision, micro-batching, memory, LoRA."""

    lr: float = Field(3e-6, ge=0)
    """AdamW peak learning rate (0 leaves the weights as they are: for checks and timings)"""
    max_refused_steps: int = Field(3, ge=1)
    """updates in a row refused for a non-finite advantage, loss or gradient (each skipped: the weights
    stay as they were) after which the run stops, naming the checkpoint to resume from"""
    lr_schedule: LRScheduleName = "constant"
    """after warmup: constant, or linear / cosine decay to 0 at the last step"""
    warmup_steps: int = Field(0, ge=0)
    """optimizer steps of linear learning-rate warmup"""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW decoupled weight decay"""
    max_grad_norm: float = Field(1.0, gt=0)
    """gradient clipping threshold on the global L2 norm over the trainer ranks"""
    pack_tokens: int = Field(2048, ge=0)
    """pack micro-batches up to this many tokens, no padding (same gradients as padded rows); 0: padded
    rows of micro_batch_size"""
    micro_batch_size: int = Field(4, ge=1)
    """sequences per forward/backward pass when pack_tokens is 0"""
    share_prompts: bool = True
    """forward each prompt once per group and let its samples attend to it (same gradients; padded rows
    only without activation_checkpointing)"""
    activation_checkpointing: bool = True
    """recompute each decoder layer's activations in backward: the trainer's peak memory 5.4 -> 3.8 GB
    for the GSM8K benchmark's step on the CPU at 8% more step time; off where the trainer bounds the step
    and memory is plentiful"""
    compile: CompileMode = "auto"
    """torch.compile the model's RMSNorm and MLP modules, fusing their elementwise steps (the GSM8K
    benchmark's bf16 step 8.9 -> 7.7 s on one CPU thread; a one-time compile of 3-12 s); auto: on for CPU
    models of 50M+ parameters on one trainer rank, off elsewhere; on: also small models and CUDA"""
    precision: Precision = "auto"
    """bf16: forward and backward in bf16 with float32 master weights, gradients and AdamW state; fp32:
    float32 throughout; auto: bf16 where the device computes it fast (CUDA with bf16, CPUs with
    AVX512-BF16 or AMX), else fp32"""
    expert_parallel: bool = False
    """a mixture of experts on several trainer ranks: each rank holds E / ranks of every layer's experts
    and tokens travel to them (all-to-all) instead of FSDP2 gathering every expert on every rank
    (`llamarl.exec.train.expert_parallel`)"""
    lora: LoraConfig = Field(default_factory=LoraConfig)


class GeneratorConfig(ConfigSection):
    """The generator backend and its engine."""

    backend: Literal["auto", "hf", "vllm"] = "auto"
    """hf: transformers' generate in the rank; vllm: a vLLM engine per generator rank, in its own process
    (on CUDA this environment with llamarl-exec[vllm]; on the CPU the one tools/setup_vllm_env.sh builds);
    auto: vllm where it is installed and, on the CPU, decodes this model faster here by enough to pay for
    its engine's start (and its environment's build, when not built yet) within the run; hf otherwise.
    The run prints what it chose and why, and records it in its config.toml
    (`llamarl.exec.generate.choice`)"""
    precision: Precision = "auto"
    """weights and compute of the generators: bf16, fp32, or auto: bf16 where the device computes it fast
    (as trainer.precision); weights travel to them in it"""
    vllm_python: str | None = None
    """interpreter of the vLLM environment (unset: $LLAMARL_VLLM_PYTHON, else this one on CUDA, the
    cached CPU one on the CPU)"""
    max_model_len: int | None = Field(None, ge=1)
    """vLLM: prompt + completion token limit of each engine (unset: the model's own)"""
    max_num_seqs: int | None = Field(None, ge=1)
    """vLLM: sequences an engine schedules at once (unset: one request's, prompts_per_step /
    num_generators x samples_per_prompt)"""
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    """CUDA: share of its GPU's memory a generator may take (vLLM: weights, activations and KV cache;
    hf: the rank's allocator cap)"""
    cuda_graphs: bool = True
    """vLLM on CUDA: compile and capture CUDA graphs for decoding (off: eager, starts faster)"""
    async_scheduling: bool = True
    """vLLM on CUDA: schedule the next engine step while one runs (never in stream mode, where weights
    load between two steps of the requests in flight)"""
    kv_cache_gib: float | None = Field(None, gt=0)
    """vLLM on the CPU: KV cache size of each engine, GiB (unset: room for one generate's max_num_seqs
    sequences of a prompt allowance + max_new_tokens,
    `llamarl.exec.generate.vllm.engine_args.kv_cache_bytes`)"""
    max_engine_restarts: int = Field(3, ge=0)
    """stream mode with vLLM: dead engines a generator replaces while the trainer keeps going"""


class RewardConfig(ConfigSection):
    """Rule rewards: the answer checker runs in worker processes beside each generator."""

    num_workers: int = Field(1, ge=1)
    """worker processes per generator rank (answer checking is cheap next to generation)"""
    timeout_s: float = Field(10.0, gt=0)
    """per-sample deadline of the answer checker; a sample past it scores 0 and its worker is replaced"""


class RewardModelConfig(ConfigSection):
    """A reward model beside the rule rewards: a sequence classifier or an LLM judge, on reward ranks of
    its own (ranks.num_reward_ranks) or, with none, colocated with each generator. Its weights never
    come from the trainer."""

    path: str | None = None
    """transformers folder of the reward model (unset: rule rewards only)"""
    kind: Literal["classifier", "judge"] = "classifier"
    """classifier: a sequence classifier's logit on prompt + completion; judge: a generative model asked
    whether the answer is correct, scored P(yes) / (P(yes) + P(no))"""
    weight: float = 1.0
    """reward = rule_weight x rule reward + weight x model score"""
    rule_weight: float = 1.0
    """weight of the task's rule reward in the combined reward (0: the reward model alone)"""
    with_reference: bool = False
    """classifier: show the task's reference answer to the reward model (after the question, as
    "Reference answer: ..."); a reference-guided reward model only has to compare answers"""
    squash: bool = False
    """classifier: a sigmoid on the logit (a probability in [0, 1], on the rule rewards' scale)"""
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    """the reward model's compute dtype (auto: bf16 on CUDA, fp32 on the CPU)"""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """the reward model's device (auto: the rank's)"""
    batch_size: int = Field(16, ge=1)
    """texts per forward pass"""
    max_length: int = Field(1024, ge=8)
    """tokens of prompt + completion kept (the end of longer texts: where the answer is)"""
