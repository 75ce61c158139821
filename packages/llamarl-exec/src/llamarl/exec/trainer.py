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

One rank for now. The seam for several data-parallel ranks (FSDP2) is `_wrap_model` (shard the model)
and `_global_counts` (all-reduce the token and sequence counts that divide the loss).
"""

from __future__ import annotations

import inspect
import math
import time
from dataclasses import dataclass, field

import torch

from llamarl.algo import get_advantage_estimator, get_policy_loss, token_logprobs
from llamarl.exec.models import load_model_and_tokenizer
from llamarl.exec.types import RolloutBatch

# Loss metrics named `*_max` are maxima over the batch (llamarl.algo's convention); every other metric
# is averaged over micro-batches weighted by their valid tokens.
_MAX_SUFFIX = "_max"


@dataclass(kw_only=True)
class TrainerConfig:
    """Configuration of `PolicyTrainer`."""

    model: str  # hub id or local transformers folder of the initial policy
    dtype: str = "float32"  # parameter dtype ("bfloat16" on GPUs; the optimizer state follows it)
    device: str = "cpu"  # torch device string
    lr: float = 1e-6  # AdamW learning rate (constant)
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
    # gradient) for the group's samples; needs micro-batches of whole groups, else falls back
    seed: int | None = None  # seeds torch's RNG in setup(); None leaves it


class PolicyTrainer:
    """Trains the policy on RolloutBatches; implements `llamarl.exec.types.Trainer`.

    Attributes:
        model: the policy module; weight sync reads its parameters.
        policy_version: number of optimizer steps taken; the weights in `model` are this version.
    """

    def __init__(self, config: TrainerConfig) -> None:
        if config.micro_batch_size <= 0:
            raise ValueError(f"micro_batch_size must be positive, got {config.micro_batch_size}")
        if config.temperature <= 0:
            raise ValueError(f"temperature must be positive, got {config.temperature}")
        self.config = config
        self.policy_version = 0
        self.model = None
        self.optimizer: torch.optim.Optimizer | None = None
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
        if cfg.gradient_checkpointing:
            model.gradient_checkpointing_enable()
        model.config.use_cache = False  # no KV cache in training forward passes
        model.train()
        self.model = self._wrap_model(model)
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=cfg.lr,
            betas=tuple(cfg.betas),
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
        )

    def close(self) -> None:
        """Drops the model and optimizer state."""
        self.model = None
        self.optimizer = None

    def _wrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """Single rank: the model as is. With several ranks this is where FSDP2 (`fully_shard`) goes."""
        return model

    def _global_counts(self, num_valid_tokens: int, num_sequences: int) -> tuple[int, int]:
        """Single rank: the local counts. With several ranks, all-reduce them so losses sum correctly."""
        return num_valid_tokens, num_sequences

    def train_step(self, batch: RolloutBatch) -> dict[str, float]:
        """One optimizer step on `batch`: micro-batched loss and backward, gradient clipping, AdamW.

        Returns:
            Metrics: loss, grad_norm, the loss's own metrics (ratio_mean, ratio_max, truncated_fraction,
            mismatch_kl, ...), logprob_mean, reward_mean, advantage_abs_mean, num_valid_tokens,
            tokens_per_s, train_s, policy_version (after the step).
        """
        if self.model is None or self.optimizer is None:
            raise RuntimeError("PolicyTrainer.train_step called before setup()")
        start = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        metrics = self.accumulate_gradients(batch)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.policy_version += 1
        elapsed = time.perf_counter() - start
        metrics["grad_norm"] = float(grad_norm)
        metrics["train_s"] = elapsed
        metrics["tokens_per_s"] = metrics["num_valid_tokens"] / elapsed if elapsed > 0 else float("nan")
        metrics["policy_version"] = float(self.policy_version)
        return metrics

    def accumulate_gradients(self, batch: RolloutBatch) -> dict[str, float]:
        """Adds the gradient of the full-batch loss to the parameters' `.grad`, one micro-batch at a time.

        The loss of each micro-batch is divided by the token (and sequence) counts of the whole batch,
        so the accumulated gradient is that of the full-batch loss whatever `micro_batch_size` is.

        Returns:
            loss, the loss's metrics, logprob_mean, reward_mean, advantage_abs_mean, num_valid_tokens.
        """
        if self.model is None:
            raise RuntimeError("PolicyTrainer.accumulate_gradients called before setup()")
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
        for rows, logprobs_MC, mask_MC in self._micro_batches(batch, device):
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
            loss.backward()
            loss_total += float(loss.detach())
            logprob_sum += float(logprobs_MC.detach().masked_fill(mask_MC == 0, 0.0).sum())
            for name, value in loss_metrics.items():
                value = float(value)
                if name.endswith(_MAX_SUFFIX):
                    maxima[name] = max(maxima.get(name, -math.inf), value)
                elif micro_tokens > 0:  # local means: weight by the tokens they averaged over
                    weighted[name] = weighted.get(name, 0.0) + value * micro_tokens
            del logprobs_MC, loss, loss_metrics  # free this micro-batch's graph before the next forward

        metrics = {
            "loss": loss_total,
            "logprob_mean": logprob_sum / denominator_tokens,
            "reward_mean": float(batch.rewards_B.float().mean()),
            "advantage_abs_mean": float(advantages_B.abs().mean()),
            "num_valid_tokens": float(num_valid_tokens),
        }
        metrics.update({name: total / denominator_tokens for name, total in weighted.items()})
        metrics.update(maxima)
        return metrics

    def _completion_logprobs(
        self,
        prompt_ids_MP: torch.Tensor,
        prompt_mask_MP: torch.Tensor,
        completion_ids_MC: torch.Tensor,
        completion_mask_MC: torch.Tensor,
        *,
        group_size: int = 1,
    ) -> tuple[torch.Tensor, int]:
        """log softmax(logits / T) of the completion tokens of one micro-batch, with gradient.

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

        if self._can_share_prompts(prompt_ids_MP, prompt_mask_MP, group_size):
            logits_MCV = self._shared_prompt_logits(
                prompt_ids_MP, prompt_mask_MP, completion_ids_MC, completion_mask_MC, group_size
            )
        else:
            logits_MCV = self._full_logits(
                prompt_ids_MP, prompt_mask_MP, completion_ids_MC, completion_mask_MC
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
    ) -> torch.Tensor:
        """Logits predicting the completion tokens, [M, C, V], with each group's prompt run only once.

        The prompt's keys and values are computed once per group (G = M / group_size rows) with
        gradient, repeated for the group's samples, and the completions attend to them: the same
        function as the full forward, with the prompt's share of the work divided by the group size.
        """
        prompt_ids_GP = prompt_ids_MP[::group_size]
        prompt_mask_GP = prompt_mask_MP[::group_size]
        prompt_out = self.model(
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
        completion_out = self.model(
            input_ids=completion_ids_MC[:, :-1],
            attention_mask=attention_mask_MT[:, :-1],
            position_ids=position_ids_MT[:, prompt_ids_MP.shape[1] : -1],
            **{self._cache_argument(): cache},
            use_cache=True,
        )
        return torch.cat([first_logits_M1V, completion_out.logits], dim=1)

    def _cache_argument(self) -> str:
        # Newer transformers name the forward's cache argument `cache` (`past_key_values` is deprecated).
        return "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"

    def _full_logits(
        self,
        prompt_ids_MP: torch.Tensor,
        prompt_mask_MP: torch.Tensor,
        completion_ids_MC: torch.Tensor,
        completion_mask_MC: torch.Tensor,
    ) -> torch.Tensor:
        """Logits predicting the completion tokens, [M, C, V], from one forward over prompt + completion."""
        length = completion_ids_MC.shape[1]
        input_ids_MT = torch.cat([prompt_ids_MP, completion_ids_MC], dim=1)
        attention_mask_MT = torch.cat([prompt_mask_MP, completion_mask_MC.to(prompt_mask_MP.dtype)], dim=1)
        # Positions count real tokens only, as in generate() with left padding; padding gets position 0.
        position_ids_MT = (attention_mask_MT.cumsum(1) - 1).clamp(min=0)
        # The logits at positions P-1 .. P+C-2 predict the completion tokens; keeping the last C+1
        # positions (and dropping the final one) computes the LM head only where it is needed.
        logits_MCV = self.model(
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
        for rows, logprobs_MC, mask_MC in self._micro_batches(batch, device):
            out_BC[rows, : mask_MC.shape[1]] = logprobs_MC.masked_fill(mask_MC == 0, 0.0).float().cpu()
        return out_BC

    def _micro_batches(self, batch: RolloutBatch, device: torch.device):
        """Yields (rows, logprobs_MC', mask_MC') per micro-batch, cut to its longest completion C'."""
        for first in range(0, batch.num_sequences, self.config.micro_batch_size):
            rows = slice(first, first + self.config.micro_batch_size)
            mask_MC = batch.completion_mask_BC[rows].to(device)
            logprobs_MC, length = self._completion_logprobs(
                batch.prompt_ids_BP[rows],
                batch.prompt_mask_BP[rows],
                batch.completion_ids_BC[rows],
                mask_MC,
                group_size=batch.group_size,
            )
            yield rows, logprobs_MC, mask_MC[:, :length]
