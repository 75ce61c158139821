"""Log-probs of a batch's completion tokens under a policy, one micro-batch at a time.

Shape legend:
    B  sequences in the batch, M  sequences in a micro-batch
    P  prompt length (left-padded), C  completion length (right-padded), V  vocabulary size

The forward pass must see each sequence exactly as the generator did, so that with unchanged weights
the log-probs equal the behaviour log-probs: the input is prompt + completion with the prompt's left
padding masked out, and position ids restart at 0 on the first real token (what transformers' `generate`
uses with left padding), not at column 0.

Memory: the full [tokens, V] logits never exist. The model's output head is replaced, for the duration
of each forward pass, by `llamarl.algo.linear_token_logprobs`: it receives the last hidden states at the
completion positions of one micro-batch (`logits_to_keep`, never the prompt's) and turns them into the
sampled tokens' log-probs (and the entropy, a metric) a chunk of tokens at a time, recomputing each
chunk's logits in backward. The head runs inside the model's forward, so under FSDP2 it sees the
gathered (and, under mixed precision, bf16) head weight, as the plain head would.

Micro-batches are either padded rows (`micro_batch_size` sequences, optionally forwarding each prompt
once per group: `share_prompts`) or packed rows (`pack_tokens`: consecutive sequences up to a token
budget laid end to end in one row, see `llamarl.exec.train.packing`). Both honour `share_prompts`: padded
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

import contextlib
import inspect
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from llamarl.algo import linear_token_logprobs
from llamarl.exec.config import TrainerConfig
from llamarl.exec.moe.routes import RouteReplay, read_routes
from llamarl.exec.train import packing
from llamarl.exec.train.parallel import all_reduce_max, all_reduce_min
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
        # A mixture of experts: the recorded routes are laid out for each forward of a model that has
        # a RouteReplay here (the policy, and the reference: the KL then compares weights, not routes)
        # and replayed or compared there; `_replaying` is the one of the micro-batch under way.
        self.replays: dict[torch.nn.Module, RouteReplay] = {}
        self._replaying: RouteReplay | None = None

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
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(logprobs_MC', entropy_MC', mask_MC') of one micro-batch under `model`, cut to its longest
        completion C'. Log-probs carry gradient when enabled; the entropy (of softmax(logits / T) at each
        completion position, a metric) never does. Both are float32, 0 on padding."""
        mask_MC = batch.completion_mask_BC[rows].to(device)
        routes = self._routes(model, batch, rows)
        if self.trainer.pack_tokens:
            logprobs_MC, entropy_MC, length = self._packed_logprobs(
                model,
                batch.prompt_ids_BP[rows],
                batch.prompt_mask_BP[rows],
                batch.completion_ids_BC[rows],
                mask_MC,
                routes,
            )
        else:
            logprobs_MC, entropy_MC, length = self._completion_logprobs(
                batch.prompt_ids_BP[rows],
                batch.prompt_mask_BP[rows],
                batch.completion_ids_BC[rows],
                mask_MC,
                group_size=batch.group_size,
                model=model,
                routes=routes,
            )
        mask_MC = mask_MC[:, :length]
        return logprobs_MC, entropy_MC.masked_fill(mask_MC == 0, 0.0), mask_MC

    def _routes(
        self, model: torch.nn.Module, batch: RolloutBatch, rows: slice
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The micro-batch's recorded routes (prompt_MPLK, completion_MCLK; int64, NO_ROUTE where none)
        when `model` replays them, else None (and `model` routes itself)."""
        self._replaying = self.replays.get(model)
        if self._replaying is None:
            return None
        if not batch.has_routes:
            self._replaying.set(None)
            return None
        return read_routes(batch.prompt_routes_BPLK[rows]), read_routes(batch.completion_routes_BCLK[rows])

    def _replay(self, routes_NLK: torch.Tensor | None, counted_N: torch.Tensor | None = None) -> None:
        """Routes for the next forward of the replaying model (see `_routes`)."""
        if self._replaying is not None and routes_NLK is not None:
            self._replaying.set(routes_NLK, counted_N)

    def _packed_logprobs(
        self,
        model: torch.nn.Module,
        prompt_ids_MP: torch.Tensor,
        prompt_mask_MP: torch.Tensor,
        completion_ids_MC: torch.Tensor,
        completion_mask_MC: torch.Tensor,
        routes: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Like `_completion_logprobs`, from one packed row: no padding reaches the model.

        Returns:
            (logprobs_MC', entropy_MC', C'): float32, 0 on padding, over the first C' completion columns.
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
            routes=None if routes is None else (routes[0], routes[1][:, :length]),
        )
        self._replay(row.routes_TLK, row.completion_T)
        # No attention mask: the varlen attention (see setup) attends within each packed sequence (or
        # shared-prompt group), from segments computed here once for all layers (Python ints: no
        # device sync per layer).
        head = _TokenLogprobsHead(row.target_ids_1K.to(device), self.temperature)
        with head.replacing_output_head(model):
            model(
                input_ids=row.input_ids_1T.to(device),
                position_ids=row.position_ids_1T.to(device),
                use_cache=False,
                logits_to_keep=row.predict_index_K.to(device),
                segments=row.segments,
            )
        logprobs_1K, entropy_1K = head.result()
        return (
            packing.unpack(logprobs_1K, completion_mask_MC),
            packing.unpack(entropy_1K, completion_mask_MC),
            length,
        )

    def _completion_logprobs(
        self,
        prompt_ids_MP: torch.Tensor,
        prompt_mask_MP: torch.Tensor,
        completion_ids_MC: torch.Tensor,
        completion_mask_MC: torch.Tensor,
        *,
        group_size: int,
        model: torch.nn.Module,
        routes: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """log softmax(logits / T) of the completion tokens of one micro-batch under `model`, with
        gradient when enabled, and the entropy of softmax(logits / T) at each completion position.

        Columns that are padding in every row of the micro-batch are cut first (leading prompt columns,
        trailing completion columns), which changes nothing for the real tokens.

        Returns:
            (logprobs_MC', entropy_MC', C'): float32, over the first C' completion columns.
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
        if routes is not None:  # laid as the ids are (what `_shared_prompt_logprobs` cuts, it cuts too)
            routes = routes[0][:, first_prompt:], routes[1][:, :length]

        # Sharing runs two forward passes (one when every completion has a single token), the full path
        # one; under FSDP2 every rank must run the same passes, so all must agree to share.
        shareable = self._can_share_prompts(prompt_ids_MP, prompt_mask_MP, group_size) and length > 1
        if self.group is not None:
            shareable = all_reduce_min([float(shareable)], self.group)[0] > 0
        if shareable:
            logprobs_MC, entropy_MC = self._shared_prompt_logprobs(
                prompt_ids_MP,
                prompt_mask_MP,
                completion_ids_MC,
                completion_mask_MC,
                group_size,
                model,
                routes,
            )
        else:
            logprobs_MC, entropy_MC = self._full_logprobs(
                prompt_ids_MP, prompt_mask_MP, completion_ids_MC, completion_mask_MC, model, routes
            )
        return logprobs_MC, entropy_MC, length

    def _can_share_prompts(
        self, prompt_ids_MP: torch.Tensor, prompt_mask_MP: torch.Tensor, group_size: int
    ) -> bool:
        rows = prompt_ids_MP.shape[0]
        if not self.trainer.share_prompts or group_size < 2 or rows % group_size:
            return False
        if self.trainer.activation_checkpointing:
            # Padded rows share a prompt through a KV cache, which a checkpointed layer cannot fill:
            # transformers drops the cache under activation checkpointing (recomputing the layer in
            # backward would append its keys a second time). Packed rows share within one pass.
            return False
        # The batch contract puts a prompt's samples next to each other; check it rather than trust it.
        ids_GSP = prompt_ids_MP.view(rows // group_size, group_size, -1)
        mask_GSP = prompt_mask_MP.view(rows // group_size, group_size, -1)
        return bool((ids_GSP == ids_GSP[:, :1]).all() and (mask_GSP == mask_GSP[:, :1]).all())

    def _shared_prompt_logprobs(
        self,
        prompt_ids_MP: torch.Tensor,
        prompt_mask_MP: torch.Tensor,
        completion_ids_MC: torch.Tensor,
        completion_mask_MC: torch.Tensor,
        group_size: int,
        model: torch.nn.Module,
        routes: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probs and entropies of the completion tokens, [M, C] each, with each group's prompt run
        only once.

        The prompt's keys and values are computed once per group (G = M / group_size rows) with
        gradient, repeated for the group's samples, and the completions attend to them: the same
        function as the full forward, with the prompt's share of the work divided by the group size.
        """
        prompt_ids_GP = prompt_ids_MP[::group_size]
        prompt_mask_GP = prompt_mask_MP[::group_size]
        # The last prompt position predicts the first completion token of each of the group's samples.
        first = _TokenLogprobsHead(completion_ids_MC[:, :1], self.temperature, repeat_rows=group_size)
        if routes is not None:  # the group's first sample's prompt routes (its samples share them)
            self._replay(_flat(routes[0][::group_size]))
        with first.replacing_output_head(model):
            prompt_out = model(
                input_ids=prompt_ids_GP,
                attention_mask=prompt_mask_GP,
                position_ids=(prompt_mask_GP.cumsum(1) - 1).clamp(min=0),
                use_cache=True,
                logits_to_keep=1,
            )
        cache = prompt_out.past_key_values
        cache.batch_repeat_interleave(group_size)
        first_logprobs_M1, first_entropy_M1 = first.result()
        length = completion_ids_MC.shape[1]
        if length == 1:
            return first_logprobs_M1, first_entropy_M1
        # Completion tokens 0..C-2 are the inputs whose logits predict tokens 1..C-1.
        attention_mask_MT = torch.cat([prompt_mask_MP, completion_mask_MC.to(prompt_mask_MP.dtype)], dim=1)
        position_ids_MT = (attention_mask_MT.cumsum(1) - 1).clamp(min=0)
        rest = _TokenLogprobsHead(completion_ids_MC[:, 1:], self.temperature)
        if routes is not None:
            self._replay(_flat(routes[1][:, :-1]), completion_mask_MC[:, :-1].reshape(-1).bool())
        with rest.replacing_output_head(model):
            model(
                input_ids=completion_ids_MC[:, :-1],
                attention_mask=attention_mask_MT[:, :-1],
                position_ids=position_ids_MT[:, prompt_ids_MP.shape[1] : -1],
                **{self._cache_argument(model): cache},
                use_cache=True,
            )
        rest_logprobs_MC, rest_entropy_MC = rest.result()
        return (
            torch.cat([first_logprobs_M1, rest_logprobs_MC], dim=1),
            torch.cat([first_entropy_M1, rest_entropy_MC], dim=1),
        )

    @staticmethod
    def _cache_argument(model: torch.nn.Module) -> str:
        # Newer transformers name the forward's cache argument `cache` (`past_key_values` is deprecated).
        return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def _full_logprobs(
        self,
        prompt_ids_MP: torch.Tensor,
        prompt_mask_MP: torch.Tensor,
        completion_ids_MC: torch.Tensor,
        completion_mask_MC: torch.Tensor,
        model: torch.nn.Module,
        routes: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probs and entropies of the completion tokens, [M, C] each, from one forward over prompt +
        completion."""
        length = completion_ids_MC.shape[1]
        input_ids_MT = torch.cat([prompt_ids_MP, completion_ids_MC], dim=1)
        attention_mask_MT = torch.cat([prompt_mask_MP, completion_mask_MC.to(prompt_mask_MP.dtype)], dim=1)
        # Positions count real tokens only, as in generate() with left padding; padding gets position 0.
        position_ids_MT = (attention_mask_MT.cumsum(1) - 1).clamp(min=0)
        # The hidden states at positions P-1 .. P+C-2 predict the completion tokens; keeping the last
        # C+1 positions (the head drops the final one) runs the head only where it is needed.
        head = _TokenLogprobsHead(completion_ids_MC, self.temperature, drop_last_position=True)
        if routes is not None:
            counted_MT = torch.cat(
                [torch.zeros_like(prompt_mask_MP), completion_mask_MC.to(prompt_mask_MP.dtype)], 1
            )
            self._replay(_flat(torch.cat(routes, 1)), counted_MT.reshape(-1).bool())
        with head.replacing_output_head(model):
            model(
                input_ids=input_ids_MT,
                attention_mask=attention_mask_MT,
                position_ids=position_ids_MT,
                use_cache=False,
                logits_to_keep=length + 1,
            )
        return head.result()


class _TokenLogprobsHead:
    """Stands in for a causal LM's output head during one forward pass: instead of the logits of the
    kept positions it computes the log-probs of `target_ids` there (and the entropies), fused with the
    head's matrix product (`llamarl.algo.linear_token_logprobs`), so the [tokens, V] logits never exist.

    `repeat_rows`: each row of hidden states predicts the targets of that many consecutive rows (a
    shared prompt's last position, for each sample of its group). `drop_last_position`: the head gets
    one position more than there are targets (the last one predicts nothing).
    """

    def __init__(
        self,
        target_ids_BK: torch.Tensor,
        temperature: float,
        *,
        repeat_rows: int = 1,
        drop_last_position: bool = False,
    ) -> None:
        self.target_ids_BK = target_ids_BK
        self.temperature = temperature
        self.repeat_rows = repeat_rows
        self.drop_last_position = drop_last_position
        self._result: tuple[torch.Tensor, torch.Tensor] | None = None

    def __call__(self, hidden_BKH: torch.Tensor, weight_VH: torch.Tensor) -> torch.Tensor:
        if self.drop_last_position:
            hidden_BKH = hidden_BKH[:, :-1]
        if self.repeat_rows > 1:
            hidden_BKH = hidden_BKH.repeat_interleave(self.repeat_rows, dim=0)
        self._result = linear_token_logprobs(
            hidden_BKH, weight_VH, self.target_ids_BK, temperature=self.temperature
        )
        return self._result[0]  # what the model returns as its "logits"

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(logprobs_BK, entropy_BK) of the forward pass that ran with this head."""
        if self._result is None:
            raise RuntimeError("the model's forward never called its output head")
        result, self._result = self._result, None
        return result

    @contextlib.contextmanager
    def replacing_output_head(self, model: torch.nn.Module) -> Iterator[None]:
        """Within the block, `model`'s output head computes this head's log-probs instead of logits."""
        head = output_head(model)
        compute: Callable[[torch.Tensor], torch.Tensor] = lambda hidden: self(hidden, head.weight)  # noqa: E731
        # An instance attribute shadows the class's forward for this module only; nn.Module.__call__
        # (and any FSDP2 hooks around it) runs as before. Read `head.weight` at call time: under FSDP2
        # it is the gathered (mixed-precision) weight only inside the forward pass.
        head.forward = compute
        try:
            yield
        finally:
            del head.forward


def output_head(model: torch.nn.Module) -> torch.nn.Linear:
    """The model's output head, checked to be what `linear_token_logprobs` fuses: a bias-free linear layer
    whose output the model returns as is (no logit soft-capping or scaling after it)."""
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear) or head.bias is not None:
        raise ValueError(
            f"{type(model).__name__}: the fused log-prob head needs a bias-free nn.Linear output head, "
            f"found {type(head).__name__}"
        )
    config = getattr(model, "config", None)
    for name in ("final_logit_softcapping", "logit_scale", "output_multiplier_scale"):
        if getattr(config, name, None) not in (None, 1, 1.0):
            raise ValueError(
                f"{type(model).__name__} transforms its logits after the head ({name}); the fused "
                "log-prob head does not support it"
            )
    return head


def _flat(routes_MTLK: torch.Tensor) -> torch.Tensor:
    """Routes [M, T, L, K] as a forward's routers see its tokens: [M * T, L, K], row-major."""
    return routes_MTLK.reshape(-1, *routes_MTLK.shape[2:])


def _span_length(completion_mask_MC: torch.Tensor) -> int:
    """Columns up to the last masked-in token of any row (0 for an empty micro-batch)."""
    if completion_mask_MC.numel() == 0:
        return 0
    return int(packing.completion_span(completion_mask_MC).sum(1).max())
