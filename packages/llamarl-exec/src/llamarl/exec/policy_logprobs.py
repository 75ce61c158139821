"""Log-probs of a batch's completion tokens under a policy, one micro-batch at a time.

Shape legend:
    B  sequences in the batch, M  sequences in a micro-batch
    P  prompt length (left-padded), C  completion length (right-padded), V  vocabulary size

The forward pass must see each sequence exactly as the generator did, so that with unchanged weights
the log-probs equal the behaviour log-probs: the input is prompt + completion with the prompt's left
padding masked out, and position ids restart at 0 on the first real token (what transformers' `generate`
uses with left padding), not at column 0.

Memory: logits are produced only at the C completion positions of one micro-batch (`logits_to_keep`),
never for the prompt or the whole batch, and `token_logprobs` upcasts them to float32 a chunk at a time.

Micro-batches are either padded rows (`micro_batch_size` sequences, optionally forwarding each prompt
once per group: `share_prompts`) or packed rows (`pack_tokens`: consecutive sequences up to a token
budget laid end to end in one row, see `llamarl.exec.packing`). Both honour `share_prompts`: padded
rows share only within micro-batches of whole groups and still pad every completion to the longest,
while packed rows lay each run of same-prompt sequences as one prompt and its completions, with no
padding at all (tools/bench_train_step.py compares the layouts).

A completion may hold tokens the loss skips (the environment's replies inside a multi-turn episode):
they are fed as input like the sampled ones, up to each row's last masked-in token
(`packing.completion_span`), and only the loss mask returned with the log-probs leaves them out.

With a trainer group (FSDP2) every rank must run the same forward passes: the ranks agree on the number
of micro-batches and on whether to share prompts.
"""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist

from llamarl.algo import token_logprobs
from llamarl.exec import packing
from llamarl.exec.config import TrainerConfig
from llamarl.exec.parallel import all_reduce_max, all_reduce_min
from llamarl.exec.types import RolloutBatch


class PolicyLogprobs:
    """Splits batches into micro-batches and computes their completion log-probs under a model.

    `trainer`: the micro-batch layout (`pack_tokens`, `micro_batch_size`, `share_prompts`);
    `temperature`: the generators' sampling temperature (log-probs of logits / temperature); `group`: the
    trainer ranks' group under FSDP2, else None.
    """

    def __init__(
        self, trainer: TrainerConfig, *, temperature: float, group: dist.ProcessGroup | None
    ) -> None:
        self.trainer = trainer
        self.temperature = temperature
        self.group = group

    def micro_batches(self, batch: RolloutBatch) -> list[slice]:
        """Consecutive rows per micro-batch: `micro_batch_size` sequences, or a token budget when packing."""
        if self.trainer.pack_tokens:
            alone = packing.sequence_lengths(batch.prompt_mask_BP, batch.completion_mask_BC)
            lengths = alone
            if self.trainer.share_prompts:  # a sample after its group's first costs its completion only
                repeats = packing.repeats_previous_prompt(batch.prompt_ids_BP, batch.prompt_mask_BP)
                lengths = packing.sequence_lengths(
                    batch.prompt_mask_BP, batch.completion_mask_BC, repeats_prompt=repeats
                )
            rows = packing.token_budget_rows(lengths, self.trainer.pack_tokens, opening_lengths=alone)
            # FSDP2 ranks must run the same number of forward/backward passes (each one gathers and
            # reduces over the group): the ranks whose budget gave fewer micro-batches split evenly
            # into as many as the rank that needs the most.
            (most,) = all_reduce_max([len(rows)], self.group)
            if len(rows) < most:
                rows = packing.balanced_rows(lengths, int(most))
            return rows
        size = self.trainer.micro_batch_size
        return [slice(first, first + size) for first in range(0, batch.num_sequences, size)]

    def logprobs(
        self, model: torch.nn.Module, batch: RolloutBatch, rows: slice, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(logprobs_MC', mask_MC') of one micro-batch under `model`, cut to its longest completion C'."""
        mask_MC = batch.completion_mask_BC[rows].to(device)
        if self.trainer.pack_tokens:
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
        length = max(_span_length(completion_mask_MC), 1)
        completion_mask_MC = completion_mask_MC[:, :length]
        row = packing.pack(
            prompt_ids_MP,
            prompt_mask_MP,
            completion_ids_MC[:, :length],
            completion_mask_MC.cpu(),
            share_prompts=self.trainer.share_prompts,
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
            temperature=self.temperature,
        )
        return packing.unpack(logprobs_1K, completion_mask_MC), length

    def _completion_logprobs(
        self,
        prompt_ids_MP: torch.Tensor,
        prompt_mask_MP: torch.Tensor,
        completion_ids_MC: torch.Tensor,
        completion_mask_MC: torch.Tensor,
        *,
        group_size: int,
        model: torch.nn.Module,
    ) -> tuple[torch.Tensor, int]:
        """log softmax(logits / T) of the completion tokens of one micro-batch under `model`, with
        gradient when enabled.

        Columns that are padding in every row of the micro-batch are cut first (leading prompt columns,
        trailing completion columns), which changes nothing for the real tokens.

        Returns:
            (logprobs_MC', C'): float32 log-probs over the first C' completion columns.
        """
        device = completion_mask_MC.device
        real_prompt_columns = prompt_mask_MP.any(0).nonzero()
        first_prompt = int(real_prompt_columns[0]) if len(real_prompt_columns) else prompt_mask_MP.shape[1]
        length = _span_length(completion_mask_MC)
        length = max(length, 1)  # keep one column so shapes stay valid for an all-empty micro-batch
        prompt_ids_MP = prompt_ids_MP[:, first_prompt:].to(device)
        prompt_mask_MP = prompt_mask_MP[:, first_prompt:].to(device)
        completion_ids_MC = completion_ids_MC[:, :length].to(device)
        # Attention and positions cover every laid token (environment tokens of an episode included);
        # the loss mask is applied by the caller.
        completion_mask_MC = packing.completion_span(completion_mask_MC[:, :length])

        # Sharing runs two forward passes (one when every completion has a single token), the full path
        # one; under FSDP2 every rank must run the same passes, so all must agree to share.
        shareable = self._can_share_prompts(prompt_ids_MP, prompt_mask_MP, group_size) and length > 1
        if self.group is not None:
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
            temperature=self.temperature,
        )
        return logprobs_MC, length

    def _can_share_prompts(
        self, prompt_ids_MP: torch.Tensor, prompt_mask_MP: torch.Tensor, group_size: int
    ) -> bool:
        rows = prompt_ids_MP.shape[0]
        if not self.trainer.share_prompts or group_size < 2 or rows % group_size:
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


def _span_length(completion_mask_MC: torch.Tensor) -> int:
    """Columns up to the last masked-in token of any row (0 for an empty micro-batch)."""
    if completion_mask_MC.numel() == 0:
        return 0
    return int(packing.completion_span(completion_mask_MC).sum(1).max())
