"""The policy trainer: log-probs of the sampled tokens, a policy loss from `llamarl.algo`, one AdamW step.

Shape legend:
    B  sequences in the batch, M  sequences in a micro-batch
    P  prompt length (left-padded), C  completion length (right-padded), V  vocabulary size

The forward pass must see each sequence exactly as the generator did, so that with unchanged weights
the trainer's log-probs equal the behaviour log-probs: the input is prompt + completion with the
prompt's left padding masked out, and position ids restart at 0 on the first real token (what
transformers' `generate` uses with left padding), not at column 0.

Memory: logits are produced only at the C completion positions of one micro-batch (`logits_to_keep`),
never for the prompt or the whole batch, and `token_logprobs` upcasts them to float32 a chunk at a time.

Micro-batches are either padded rows (`micro_batch_size` sequences, optionally forwarding each prompt
once per group: `share_prompts`) or packed rows (`pack_tokens`: consecutive sequences up to a token
budget laid end to end in one row, see `llamarl.exec.packing`). Both honour `share_prompts`: padded
rows share only within micro-batches of whole groups and still pad every completion to the longest,
while packed rows lay each run of same-prompt sequences as one prompt and its completions, with no
padding at all (tools/bench_train_step.py compares the layouts).

Several ranks: given a trainer process group of N ranks, the model is sharded with FSDP2 over it, each
rank trains on its own part of the batch, and the token and sequence counts that divide the loss are
all-reduced first, so the gradients summed by FSDP2 are those of the whole batch's loss; clipping uses
the global norm. An optional frozen reference model (sharded the same way) adds a KL penalty.
"""

from __future__ import annotations

import inspect
import math
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from llamarl.algo import (
    KL_ESTIMATORS,
    get_advantage_estimator,
    get_policy_loss,
    kl_penalty_loss,
    token_logprobs,
)
from llamarl.exec import packing, varlen_attention
from llamarl.exec.models import load_model_and_tokenizer, resolve_dtype
from llamarl.exec.parallel import all_reduce_max, all_reduce_min, all_reduce_sum, full_tensor, shard_model
from llamarl.exec.schedules import LR_SCHEDULES, lr_factor
from llamarl.exec.types import RolloutBatch

# Loss metrics named `*_max` are maxima over the batch (llamarl.algo's convention); every other metric
# is averaged over micro-batches weighted by their valid tokens.
_MAX_SUFFIX = "_max"


@dataclass(kw_only=True)
class TrainerConfig:
    """Configuration of `PolicyTrainer`."""

    model: str  # hub id or local transformers folder of the initial policy
    dtype: str = "float32"  # parameter dtype, and so the optimizer state's (fp32 master weights)
    param_dtype: str | None = None  # compute dtype under FSDP2 mixed precision ("bfloat16" on CUDA);
    # None computes in `dtype`. Needs a trainer group (FSDP2's MixedPrecisionPolicy does the casts).
    device: str = "cpu"  # torch device string
    lr: float = 1e-6  # AdamW peak learning rate
    lr_schedule: str = "constant"  # after warmup: "constant", "linear" or "cosine" decay to 0
    warmup_steps: int = 0  # optimizer steps of linear warmup from lr / (warmup_steps + 1) to lr
    total_steps: int = 1  # the step where "linear" and "cosine" reach 0 (the run's steps)
    betas: tuple[float, float] = (0.9, 0.999)  # AdamW betas
    eps: float = 1e-8  # AdamW epsilon
    weight_decay: float = 0.0  # AdamW decoupled weight decay
    micro_batch_size: int = 8  # sequences per forward/backward pass; gradients accumulate over them
    max_grad_norm: float = 1.0  # gradient clipping threshold on the global L2 norm; inf disables it
    temperature: float = 1.0  # the generator's sampling temperature (log-probs use logits / temperature)
    loss: str = "aipo"  # policy loss name in llamarl.algo.get_policy_loss
    loss_hparams: dict = field(default_factory=dict)  # its hyper-parameters, e.g. {"rho": 4.0}
    advantage: str = "group_mean"  # advantage estimator name in llamarl.algo.get_advantage_estimator
    advantage_hparams: dict = field(default_factory=dict)  # its hyper-parameters
    logprob_chunk_size: int = 512  # tokens upcast to float32 at a time when computing log-probs
    gradient_checkpointing: bool = False  # recompute activations in backward to save memory
    share_prompts: bool = True  # forward each prompt once per group and reuse its keys/values (with
    # gradient) for the group's samples; padded rows need micro-batches of whole groups, else fall back
    pack_tokens: int = 0  # > 0: packed micro-batches of at most this many real tokens (no padding),
    # a shared prompt counted once; replaces micro_batch_size. 0: padded rows of micro_batch_size
    kl_coef: float = 0.0  # > 0: penalty kl_coef * KL(policy || reference) with a frozen reference model
    kl_estimator: str = "k3"  # "k1", "k2" or "k3" (llamarl.algo.kl)
    seed: int | None = None  # seeds torch's RNG in setup(); None leaves it


class PolicyTrainer:
    """Trains the policy on RolloutBatches; implements `llamarl.exec.types.Trainer`.

    `group`: the trainer ranks' process group. With one (of any size, or with `param_dtype` set) the
    model is sharded with FSDP2 over it and every rank must call `train_step` with its own part of the
    batch; without one the trainer is a plain single-rank module.

    Attributes:
        model: the policy module (FSDP2 DTensor parameters with a group); weight sync reads them.
        ref_model: the frozen reference policy when `kl_coef` > 0, else None.
        policy_version: number of optimizer steps taken; the weights in `model` are this version.
    """

    def __init__(self, config: TrainerConfig, *, group: dist.ProcessGroup | None = None) -> None:
        if config.micro_batch_size <= 0:
            raise ValueError(f"micro_batch_size must be positive, got {config.micro_batch_size}")
        if config.temperature <= 0:
            raise ValueError(f"temperature must be positive, got {config.temperature}")
        if config.pack_tokens < 0:
            raise ValueError(f"pack_tokens must be 0 (off) or positive, got {config.pack_tokens}")
        if config.kl_coef < 0 or config.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"need kl_coef >= 0 and kl_estimator in {sorted(KL_ESTIMATORS)}")
        if config.param_dtype is not None and group is None:
            raise ValueError("param_dtype (mixed precision) needs a trainer group: FSDP2 applies it")
        if config.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"unknown lr_schedule {config.lr_schedule!r}; known: {', '.join(LR_SCHEDULES)}")
        # Evaluated once here so that bad warmup/total steps fail before any heavy work.
        lr_factor(
            0, schedule=config.lr_schedule, warmup_steps=config.warmup_steps, total_steps=config.total_steps
        )
        self.config = config
        self.group = group
        self.policy_version = 0
        self.model = None
        self.ref_model = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
        # Bound here, not in setup(): an unknown name or hyper-parameter fails before any heavy work.
        self.loss_fn = get_policy_loss(config.loss, **config.loss_hparams)
        self.advantage_fn = get_advantage_estimator(config.advantage, **config.advantage_hparams)

    def setup(self) -> None:
        """Loads the model and builds the optimizer."""
        cfg = self.config
        if cfg.seed is not None:
            torch.manual_seed(cfg.seed)
        model, _ = load_model_and_tokenizer(
            cfg.model, dtype=cfg.dtype, device=cfg.device, with_tokenizer=False
        )
        if cfg.gradient_checkpointing and not self.is_sharded:  # (under FSDP2: see shard_model)
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False  # no KV cache in training forward passes
        self._use_varlen_attention(model)
        model.train()
        self.model = self._wrap_model(model)
        if cfg.kl_coef > 0:
            ref, _ = load_model_and_tokenizer(
                cfg.model, dtype=cfg.dtype, device=cfg.device, with_tokenizer=False
            )
            ref.requires_grad_(False)
            ref.config.use_cache = False
            self._use_varlen_attention(ref)
            ref.eval()
            # Sharded like the policy; it never trains and is never synced, so its root reshards
            # after every forward instead of holding its weights gathered for a backward pass.
            self.ref_model = self._wrap_model(ref, frozen=True)
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=cfg.lr,
            betas=tuple(cfg.betas),
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lambda step: lr_factor(
                step, schedule=cfg.lr_schedule, warmup_steps=cfg.warmup_steps, total_steps=cfg.total_steps
            ),
        )

    def _use_varlen_attention(self, model: torch.nn.Module) -> None:
        """Packed rows: attention per packed sequence (`llamarl.exec.varlen_attention`), never a dense
        block-diagonal [T, T] mask, which on the CPU is quadratic in the packed length and sends SDPA to
        its slow masked path. Set before FSDP2 wraps the model (the setting lives in its config)."""
        if self.config.pack_tokens:
            varlen_attention.register()
            model.set_attn_implementation(varlen_attention.VARLEN_ATTENTION)

    def close(self) -> None:
        """Drops the models and optimizer state."""
        self.model = None
        self.ref_model = None
        self.optimizer = None
        self.scheduler = None

    @property
    def is_sharded(self) -> bool:
        """Whether the model is under FSDP2 (a trainer group was given)."""
        return self.group is not None

    def _wrap_model(self, model: torch.nn.Module, *, frozen: bool = False) -> torch.nn.Module:
        """FSDP2 over the trainer group when there is one (any size, so mixed precision works on one
        rank too); the plain module otherwise. `frozen`: a model that is never trained (the reference)."""
        if self.group is None:
            return model
        param_dtype = resolve_dtype(self.config.param_dtype) if self.config.param_dtype else None
        return shard_model(
            model,
            self.group,
            device=torch.device(self.config.device),
            param_dtype=param_dtype,
            # A frozen model runs no backward: its root need not stay gathered, nothing to recompute.
            reshard_root_after_forward=frozen,
            activation_checkpointing=self.config.gradient_checkpointing and not frozen,
        )

    def _global_counts(self, num_valid_tokens: int, num_sequences: int) -> tuple[int, int]:
        """The token and sequence counts of the whole batch (summed over the trainer ranks)."""
        tokens, sequences = all_reduce_sum([num_valid_tokens, num_sequences], self.group)
        return int(tokens), int(sequences)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The policy's whole weights on CPU. With a group this is a collective (every trainer rank must
        call it) and only the group's first rank gets the tensors; the others get an empty dict."""
        if self.model is None:
            raise RuntimeError("PolicyTrainer.full_state_dict called before setup()")
        if not self.is_sharded:
            return {k: v.detach().cpu() for k, v in self.model.state_dict().items()}
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(self.model, options=options)

    def train_step(self, batch: RolloutBatch) -> dict[str, float]:
        """One optimizer step on `batch`: micro-batched loss and backward, gradient clipping, AdamW.

        Returns:
            Metrics of the whole batch (all trainer ranks): loss, grad_norm, lr, the loss's own metrics
            (ratio_mean, ratio_max, truncated_fraction, mismatch_kl, ...; kl_<estimator> with a
            reference), logprob_mean, reward_mean, advantage_abs_mean, num_valid_tokens, tokens_per_s
            (the whole batch's tokens over this rank's step time), train_s, policy_version.
        """
        if self.model is None or self.optimizer is None:
            raise RuntimeError("PolicyTrainer.train_step called before setup()")
        start = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        metrics = self.accumulate_gradients(batch)
        # With FSDP2 the gradients are DTensor shards: the norm is reduced over the group (the global
        # norm), and every rank scales its shards by the same factor.
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.max_grad_norm)
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.policy_version += 1
        elapsed = time.perf_counter() - start
        metrics["grad_norm"] = float(full_tensor(grad_norm))
        metrics["lr"] = lr
        metrics["train_s"] = elapsed
        metrics["tokens_per_s"] = metrics["num_valid_tokens"] / elapsed if elapsed > 0 else float("nan")
        metrics["policy_version"] = float(self.policy_version)
        return metrics

    def accumulate_gradients(self, batch: RolloutBatch) -> dict[str, float]:
        """Adds the gradient of the full-batch loss to the parameters' `.grad`, one micro-batch at a time.

        The loss of each micro-batch is divided by the token (and sequence) counts of the whole batch,
        over all trainer ranks, so the accumulated gradient (summed over ranks by FSDP2) is that of the
        full-batch loss whatever the micro-batching and the split across ranks.

        Returns:
            loss, the loss's metrics, logprob_mean, reward_mean, advantage_abs_mean, num_valid_tokens:
            all of the whole batch (reduced over the trainer ranks).
        """
        if self.model is None:
            raise RuntimeError("PolicyTrainer.accumulate_gradients called before setup()")
        cfg = self.config
        device = next(self.model.parameters()).device
        advantages_B = self.advantage_fn(batch.rewards_B.float(), batch.group_size)
        num_valid_tokens, num_sequences = self._global_counts(
            batch.num_completion_tokens, batch.num_sequences
        )
        denominator_tokens = max(num_valid_tokens, 1)  # an all-empty batch gives a zero loss, not nan

        loss_total = 0.0
        logprob_sum = 0.0
        weighted: dict[str, float] = {}
        maxima: dict[str, float] = {}
        for rows in self._micro_batch_rows(batch):
            logprobs_MC, mask_MC = self._logprobs(self.model, batch, rows, device)
            micro_tokens = int(mask_MC.sum())
            length = mask_MC.shape[1]
            loss, loss_metrics = self.loss_fn(
                logprobs_MC,
                batch.behavior_logprobs_BC[rows, :length].to(device),
                advantages_B[rows].to(device),
                mask_MC,
                num_valid_tokens=denominator_tokens,
                num_sequences=num_sequences,
            )
            if self.ref_model is not None:
                with torch.no_grad():
                    ref_logprobs_MC, _ = self._logprobs(self.ref_model, batch, rows, device)
                kl_loss, kl_metrics = kl_penalty_loss(
                    logprobs_MC,
                    ref_logprobs_MC,
                    mask_MC,
                    estimator=cfg.kl_estimator,
                    coef=cfg.kl_coef,
                    num_valid_tokens=denominator_tokens,
                )
                loss = loss + kl_loss
                loss_metrics = {**loss_metrics, **kl_metrics}
            loss.backward()
            loss_total += float(loss.detach())
            logprob_sum += float(logprobs_MC.detach().masked_fill(mask_MC == 0, 0.0).sum())
            for name, value in loss_metrics.items():
                value = float(value)
                if name.endswith(_MAX_SUFFIX):
                    maxima[name] = max(maxima.get(name, -math.inf), value)
                else:  # local means: weight by the tokens they averaged over (0 for an empty one)
                    weighted[name] = weighted.get(name, 0.0) + (value * micro_tokens if micro_tokens else 0.0)
            del logprobs_MC, loss, loss_metrics  # free this micro-batch's graph before the next forward

        # Every rank ran the same loss, so the metric names agree; sort them so the reductions line up.
        weighted_names, max_names = sorted(weighted), sorted(maxima)
        sums = all_reduce_sum(
            [
                loss_total,
                logprob_sum,
                float(batch.rewards_B.float().sum()),
                float(advantages_B.abs().sum()),
                *(weighted[n] for n in weighted_names),
            ],
            self.group,
        )
        highs = all_reduce_max([maxima[n] for n in max_names], self.group)
        num_rows = max(num_sequences, 1)
        metrics = {
            "loss": sums[0],
            "logprob_mean": sums[1] / denominator_tokens,
            "reward_mean": sums[2] / num_rows,
            "advantage_abs_mean": sums[3] / num_rows,
            "num_valid_tokens": float(num_valid_tokens),
        }
        metrics.update(
            {n: total / denominator_tokens for n, total in zip(weighted_names, sums[4:], strict=True)}
        )
        metrics.update(dict(zip(max_names, highs, strict=True)))
        return metrics

    def _micro_batch_rows(self, batch: RolloutBatch) -> list[slice]:
        """Consecutive rows per micro-batch: `micro_batch_size` sequences, or a token budget when packing."""
        if self.config.pack_tokens:
            alone = packing.sequence_lengths(batch.prompt_mask_BP, batch.completion_mask_BC)
            lengths = alone
            if self.config.share_prompts:  # a sample after its group's first costs its completion only
                repeats = packing.repeats_previous_prompt(batch.prompt_ids_BP, batch.prompt_mask_BP)
                lengths = packing.sequence_lengths(
                    batch.prompt_mask_BP, batch.completion_mask_BC, repeats_prompt=repeats
                )
            rows = packing.token_budget_rows(lengths, self.config.pack_tokens, opening_lengths=alone)
            # FSDP2 ranks must run the same number of forward/backward passes (each one gathers and
            # reduces over the group): the ranks whose budget gave fewer micro-batches split evenly
            # into as many as the rank that needs the most.
            (most,) = all_reduce_max([len(rows)], self.group)
            if len(rows) < most:
                rows = packing.balanced_rows(lengths, int(most))
            return rows
        size = self.config.micro_batch_size
        return [slice(first, first + size) for first in range(0, batch.num_sequences, size)]

    def _logprobs(
        self, model: torch.nn.Module, batch: RolloutBatch, rows: slice, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(logprobs_MC', mask_MC') of one micro-batch under `model`, cut to its longest completion C'."""
        mask_MC = batch.completion_mask_BC[rows].to(device)
        if self.config.pack_tokens:
            logprobs_MC, length = self._packed_logprobs(
                model,
                batch.prompt_ids_BP[rows],
                batch.prompt_mask_BP[rows],
                batch.completion_ids_BC[rows],
                mask_MC,
            )
        else:
            logprobs_MC, length = self._completion_logprobs(
                batch.prompt_ids_BP[rows],
                batch.prompt_mask_BP[rows],
                batch.completion_ids_BC[rows],
                mask_MC,
                group_size=batch.group_size,
                model=model,
            )
        return logprobs_MC, mask_MC[:, :length]

    def _packed_logprobs(
        self,
        model: torch.nn.Module,
        prompt_ids_MP: torch.Tensor,
        prompt_mask_MP: torch.Tensor,
        completion_ids_MC: torch.Tensor,
        completion_mask_MC: torch.Tensor,
    ) -> tuple[torch.Tensor, int]:
        """Like `_completion_logprobs`, from one packed row: no padding reaches the model.

        Returns:
            (logprobs_MC', C'): float32 log-probs (0 on padding) over the first C' completion columns.
        """
        device = completion_mask_MC.device
        length = max(int(completion_mask_MC.sum(1).max()) if completion_mask_MC.numel() else 0, 1)
        completion_mask_MC = completion_mask_MC[:, :length]
        row = packing.pack(
            prompt_ids_MP,
            prompt_mask_MP,
            completion_ids_MC[:, :length],
            completion_mask_MC.cpu(),
            share_prompts=self.config.share_prompts,
        )
        # No attention mask: the varlen attention (see setup) attends within each packed sequence (or
        # shared-prompt group), from segments computed here once for all layers (Python ints: no
        # device sync per layer).
        logits_1KV = model(
            input_ids=row.input_ids_1T.to(device),
            position_ids=row.position_ids_1T.to(device),
            use_cache=False,
            logits_to_keep=row.predict_index_K.to(device),
            segments=row.segments,
        ).logits
        logprobs_1K = token_logprobs(
            logits_1KV,
            row.target_ids_1K.to(device),
            temperature=self.config.temperature,
            chunk_size=self.config.logprob_chunk_size,
        )
        return packing.unpack(logprobs_1K, completion_mask_MC), length

    def _completion_logprobs(
        self,
        prompt_ids_MP: torch.Tensor,
        prompt_mask_MP: torch.Tensor,
        completion_ids_MC: torch.Tensor,
        completion_mask_MC: torch.Tensor,
        *,
        group_size: int = 1,
        model: torch.nn.Module | None = None,
    ) -> tuple[torch.Tensor, int]:
        """log softmax(logits / T) of the completion tokens of one micro-batch under `model` (default:
        the policy), with gradient when enabled.

        Columns that are padding in every row of the micro-batch are cut first (leading prompt columns,
        trailing completion columns), which changes nothing for the real tokens.

        Returns:
            (logprobs_MC', C'): float32 log-probs over the first C' completion columns.
        """
        device = completion_mask_MC.device
        real_prompt_columns = prompt_mask_MP.any(0).nonzero()
        first_prompt = int(real_prompt_columns[0]) if len(real_prompt_columns) else prompt_mask_MP.shape[1]
        length = int(completion_mask_MC.sum(1).max()) if completion_mask_MC.numel() else 0
        length = max(length, 1)  # keep one column so shapes stay valid for an all-empty micro-batch
        prompt_ids_MP = prompt_ids_MP[:, first_prompt:].to(device)
        prompt_mask_MP = prompt_mask_MP[:, first_prompt:].to(device)
        completion_ids_MC = completion_ids_MC[:, :length].to(device)
        completion_mask_MC = completion_mask_MC[:, :length]
        model = self.model if model is None else model

        # Sharing runs two forward passes (one when every completion has a single token), the full path
        # one; under FSDP2 every rank must run the same passes, so all must agree to share.
        shareable = self._can_share_prompts(prompt_ids_MP, prompt_mask_MP, group_size) and length > 1
        if self.is_sharded:
            shareable = all_reduce_min([float(shareable)], self.group)[0] > 0
        if shareable:
            logits_MCV = self._shared_prompt_logits(
                prompt_ids_MP, prompt_mask_MP, completion_ids_MC, completion_mask_MC, group_size, model
            )
        else:
            logits_MCV = self._full_logits(
                prompt_ids_MP, prompt_mask_MP, completion_ids_MC, completion_mask_MC, model
            )
        logprobs_MC = token_logprobs(
            logits_MCV,
            completion_ids_MC,
            temperature=self.config.temperature,
            chunk_size=self.config.logprob_chunk_size,
        )
        return logprobs_MC, length

    def _can_share_prompts(
        self, prompt_ids_MP: torch.Tensor, prompt_mask_MP: torch.Tensor, group_size: int
    ) -> bool:
        rows = prompt_ids_MP.shape[0]
        if not self.config.share_prompts or group_size < 2 or rows % group_size:
            return False
        # The batch contract puts a prompt's samples next to each other; check it rather than trust it.
        ids_GSP = prompt_ids_MP.view(rows // group_size, group_size, -1)
        mask_GSP = prompt_mask_MP.view(rows // group_size, group_size, -1)
        return bool((ids_GSP == ids_GSP[:, :1]).all() and (mask_GSP == mask_GSP[:, :1]).all())

    def _shared_prompt_logits(
        self,
        prompt_ids_MP: torch.Tensor,
        prompt_mask_MP: torch.Tensor,
        completion_ids_MC: torch.Tensor,
        completion_mask_MC: torch.Tensor,
        group_size: int,
        model: torch.nn.Module,
    ) -> torch.Tensor:
        """Logits predicting the completion tokens, [M, C, V], with each group's prompt run only once.

        The prompt's keys and values are computed once per group (G = M / group_size rows) with
        gradient, repeated for the group's samples, and the completions attend to them: the same
        function as the full forward, with the prompt's share of the work divided by the group size.
        """
        prompt_ids_GP = prompt_ids_MP[::group_size]
        prompt_mask_GP = prompt_mask_MP[::group_size]
        prompt_out = model(
            input_ids=prompt_ids_GP,
            attention_mask=prompt_mask_GP,
            position_ids=(prompt_mask_GP.cumsum(1) - 1).clamp(min=0),
            use_cache=True,
            logits_to_keep=1,  # the last prompt position predicts the first completion token
        )
        cache = prompt_out.past_key_values
        cache.batch_repeat_interleave(group_size)
        first_logits_M1V = prompt_out.logits.repeat_interleave(group_size, dim=0)
        length = completion_ids_MC.shape[1]
        if length == 1:
            return first_logits_M1V
        # Completion tokens 0..C-2 are the inputs whose logits predict tokens 1..C-1.
        attention_mask_MT = torch.cat([prompt_mask_MP, completion_mask_MC.to(prompt_mask_MP.dtype)], dim=1)
        position_ids_MT = (attention_mask_MT.cumsum(1) - 1).clamp(min=0)
        completion_out = model(
            input_ids=completion_ids_MC[:, :-1],
            attention_mask=attention_mask_MT[:, :-1],
            position_ids=position_ids_MT[:, prompt_ids_MP.shape[1] : -1],
            **{self._cache_argument(model): cache},
            use_cache=True,
        )
        return torch.cat([first_logits_M1V, completion_out.logits], dim=1)

    @staticmethod
    def _cache_argument(model: torch.nn.Module) -> str:
        # Newer transformers name the forward's cache argument `cache` (`past_key_values` is deprecated).
        return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def _full_logits(
        self,
        prompt_ids_MP: torch.Tensor,
        prompt_mask_MP: torch.Tensor,
        completion_ids_MC: torch.Tensor,
        completion_mask_MC: torch.Tensor,
        model: torch.nn.Module,
    ) -> torch.Tensor:
        """Logits predicting the completion tokens, [M, C, V], from one forward over prompt + completion."""
        length = completion_ids_MC.shape[1]
        input_ids_MT = torch.cat([prompt_ids_MP, completion_ids_MC], dim=1)
        attention_mask_MT = torch.cat([prompt_mask_MP, completion_mask_MC.to(prompt_mask_MP.dtype)], dim=1)
        # Positions count real tokens only, as in generate() with left padding; padding gets position 0.
        position_ids_MT = (attention_mask_MT.cumsum(1) - 1).clamp(min=0)
        # The logits at positions P-1 .. P+C-2 predict the completion tokens; keeping the last C+1
        # positions (and dropping the final one) computes the LM head only where it is needed.
        logits_MCV = model(
            input_ids=input_ids_MT,
            attention_mask=attention_mask_MT,
            position_ids=position_ids_MT,
            use_cache=False,
            logits_to_keep=length + 1,
        ).logits[:, :-1]
        return logits_MCV

    @torch.no_grad()
    def compute_logprobs(self, batch: RolloutBatch) -> torch.Tensor:
        """The current policy's log-probs of the batch's completion tokens (no gradient), float32 [B, C].

        For checks and for losses that need the trainer's own "old" log-probs; 0 on padding.
        """
        if self.model is None:
            raise RuntimeError("PolicyTrainer.compute_logprobs called before setup()")
        device = next(self.model.parameters()).device
        out_BC = torch.zeros(batch.completion_ids_BC.shape, dtype=torch.float32)
        for rows in self._micro_batch_rows(batch):
            logprobs_MC, mask_MC = self._logprobs(self.model, batch, rows, device)
            out_BC[rows, : mask_MC.shape[1]] = logprobs_MC.masked_fill(mask_MC == 0, 0.0).float().cpu()
        return out_BC
