"""Packed sequences: the real tokens of several sequences in one row, no padding, for the trainer.

Shape legend:
    M  sequences in a micro-batch, P  prompt length (left-padded), C  completion length (right-padded)
    T  real tokens of the micro-batch (prompts + completions, no padding), K  completion tokens in it

Each sequence is its real prompt tokens followed by its real completion tokens; the sequences are laid
end to end in one row of T tokens and the position ids restart at 0 at each one. Attention must stay
within each sequence: the trainer runs the model with `llamarl.exec.train.varlen_attention`, which attends
per segment (`PackedRow.segments`) with causal SDPA. (Plain transformers, given no attention mask and
no cache, reads the restarts as boundaries too, but through a dense block-diagonal [T, T] mask.)

With `share_prompts`, consecutive sequences with the same prompt (a group's samples) lay that prompt
once and their completions after it, each completion attending to the prompt and to itself only
(a shared-prefix `Segment`): GRPO-style groups then pay for each prompt once, not once per sample.

So every token is computed as in its own padded row, and no layer spends any work on padding or across
sequences. The LM head runs only at the K positions that predict a completion token.

A completion may hold tokens the loss skips inside it: a multi-turn episode
(`llamarl.exec.multiturn.episodes`)
lays the environment's replies between the model's turns with `completion_mask` 0. Such tokens are
still input (the model saw them when it sampled the next turn), so a completion's tokens are every
column up to its last masked-in one (`completion_span`); only the loss uses the mask itself.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from llamarl.exec.train.varlen_attention import Segment


@dataclass(frozen=True, kw_only=True)
class PackedRow:
    """One micro-batch packed into a single row."""

    input_ids_1T: torch.Tensor  # int64 [1, T]
    position_ids_1T: torch.Tensor  # int64 [1, T], 0.. per sequence
    predict_index_K: torch.Tensor  # int64 [K]: positions whose logits predict the completion tokens
    target_ids_1K: torch.Tensor  # int64 [1, K]: those completion tokens, in row-major (sequence) order
    segments: tuple[Segment, ...]  # the row's sequences (or shared-prompt groups), in order (cover T)
    # A mixture of experts' recorded routes of the laid tokens (L MoE layers, K experts), laid as the
    # ids are, and which of them are completion tokens; None when `pack` was given no routes.
    routes_TLK: torch.Tensor | None = None
    completion_T: torch.Tensor | None = None  # bool


def completion_span(completion_mask_BC: torch.Tensor) -> torch.Tensor:
    """int64 [B, C]: 1 on every column up to and including each row's last masked-in token.

    For a completion of sampled tokens only, the mask itself; for a multi-turn episode it also covers
    the environment's tokens between the model's turns (input to the model, not part of the loss).
    """
    mask_BC = completion_mask_BC.long()
    if mask_BC.numel() == 0:
        return mask_BC
    return mask_BC.flip(1).cummax(1).values.flip(1)


def repeats_previous_prompt(prompt_ids_BP: torch.Tensor, prompt_mask_BP: torch.Tensor) -> list[bool]:
    """Per sequence: whether its real prompt tokens equal the previous sequence's (False for the first)."""
    if prompt_ids_BP.shape[0] == 0:
        return []
    real_BP = torch.where(prompt_mask_BP.bool(), prompt_ids_BP, -1)  # padding ids may differ
    same_B = (real_BP[1:] == real_BP[:-1]).all(dim=1)
    return [False, *same_B.tolist()]


def sequence_lengths(
    prompt_mask_BP: torch.Tensor,
    completion_mask_BC: torch.Tensor,
    *,
    repeats_prompt: list[bool] | None = None,
) -> list[int]:
    """Real tokens per sequence (prompt + completion span): what a sequence costs in a packed row. With
    `repeats_prompt` (see `repeats_previous_prompt`), a sequence that shares its predecessor's prompt
    costs its completion only."""
    prompt_B = prompt_mask_BP.sum(1)
    if repeats_prompt is not None:
        prompt_B = prompt_B * ~torch.tensor(repeats_prompt, dtype=torch.bool)
    return (prompt_B + completion_span(completion_mask_BC).sum(1)).tolist()


def token_budget_rows(
    lengths: list[int], budget: int, *, opening_lengths: list[int] | None = None
) -> list[slice]:
    """Splits sequences, in order, into consecutive micro-batches of at most `budget` tokens each.

    Order is kept (a group's samples stay next to each other, and results map back by slice); a
    sequence longer than the budget gets a micro-batch of its own rather than being cut.
    `opening_lengths[i]` is what sequence i costs when it opens a micro-batch (default `lengths[i]`):
    with shared prompts a sample costs its completion only after its group's first, but a micro-batch
    that opens mid-group lays the prompt again.
    """
    if budget < 1:
        raise ValueError(f"token budget must be positive, got {budget}")
    opening = lengths if opening_lengths is None else opening_lengths
    rows: list[slice] = []
    first, used = 0, 0
    for i, length in enumerate(lengths):
        if i > first and used + length > budget:
            rows.append(slice(first, i))
            first, used = i, 0
        used += opening[i] if i == first else length
    if first < len(lengths):
        rows.append(slice(first, len(lengths)))
    return rows


def balanced_rows(lengths: list[int], num_parts: int) -> list[slice]:
    """Splits sequences, in order, into exactly `num_parts` non-empty consecutive micro-batches of about
    equal tokens (cut where the running token count crosses each 1/num_parts of the total).

    Used when FSDP2 ranks must run the same number of micro-batches (each runs the same collectives)
    and a rank's own token budget gave it fewer than another rank's.
    """
    if not 1 <= num_parts <= len(lengths):
        raise ValueError(f"cannot split {len(lengths)} sequences into {num_parts} non-empty parts")
    total = sum(lengths)
    cuts: list[int] = []
    running = 0
    for i, length in enumerate(lengths[:-1]):
        running += length
        part = len(cuts) + 1  # cutting after sequence i ends this part
        if part == num_parts:
            break
        crossed = running * num_parts >= total * part
        only_enough_left = len(lengths) - (i + 1) == num_parts - part  # one sequence per part left
        if crossed or only_enough_left:
            cuts.append(i + 1)
    bounds = [0, *cuts, len(lengths)]
    return [slice(a, b) for a, b in itertools.pairwise(bounds)]


def pack(
    prompt_ids_MP: torch.Tensor,
    prompt_mask_MP: torch.Tensor,
    completion_ids_MC: torch.Tensor,
    completion_mask_MC: torch.Tensor,
    *,
    share_prompts: bool = False,
    routes: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> PackedRow:
    """Packs a micro-batch of left-padded prompts and right-padded completions into one row.

    Completions are right-padded: every column up to a row's last masked-in token is laid (its
    `completion_span`, environment tokens of an episode included), so the k-th laid token of a
    sequence sits at column k and the packed log-probs map back to [M, C] (see `unpack`); the loss
    masks the ones that are not the model's. `share_prompts`: a run of sequences with the same prompt
    lays it once (see the module docstring); the log-probs are the same function of the same tokens.
    `routes`: a mixture of experts' recorded routes (prompt_MPLK, completion_MCLK), laid with the ids
    (a shared prompt's from its group's first sequence: its samples share the prompt's forward).
    """
    prompt_mask = prompt_mask_MP.bool()
    completion_mask = completion_span(completion_mask_MC).bool()
    repeats = repeats_previous_prompt(prompt_ids_MP, prompt_mask_MP) if share_prompts else None
    ids, positions, predict, targets = [], [], [], []
    laid: list[tuple[int, int]] = []  # (0: prompt, 1: completion; sequence) of each piece laid
    groups: list[tuple[int, list[int]]] = []  # (prompt length, completion lengths) per segment
    offset = 0  # tokens laid so far
    prompt_end = 0  # row position after the current group's prompt
    for i in range(prompt_ids_MP.shape[0]):
        completion = completion_ids_MC[i][completion_mask[i]]
        if not (repeats and repeats[i]):  # a new prompt: lay it
            prompt = prompt_ids_MP[i][prompt_mask[i]]
            ids.append(prompt)
            laid.append((0, i))
            positions.append(torch.arange(len(prompt)))
            offset += len(prompt)
            prompt_end = offset
            groups.append((len(prompt), []))
        num_prompt, num_completion = groups[-1][0], len(completion)
        ids.append(completion)
        laid.append((1, i))
        positions.append(torch.arange(num_completion) + num_prompt)
        # Position p predicts token p + 1: the prompt's last position predicts the first completion
        # token, each completion token but the last predicts the next.
        if num_completion:  # (an empty completion predicts nothing)
            predict.append(torch.tensor([prompt_end - 1]))
            predict.append(torch.arange(num_completion - 1) + offset)
            groups[-1][1].append(num_completion)
        targets.append(completion)
        offset += num_completion
    routes_TLK, completion_T = _lay_routes(routes, laid, (prompt_mask, completion_mask))
    return PackedRow(
        input_ids_1T=torch.cat(ids).unsqueeze(0),
        position_ids_1T=torch.cat(positions).unsqueeze(0),
        predict_index_K=torch.cat(predict) if predict else torch.zeros(0, dtype=torch.long),
        target_ids_1K=torch.cat(targets).unsqueeze(0),
        segments=tuple(_segment(prompt, branches) for prompt, branches in groups),
        routes_TLK=routes_TLK,
        completion_T=completion_T,
    )


def _lay_routes(
    routes: tuple[torch.Tensor, torch.Tensor] | None,
    laid: list[tuple[int, int]],
    masks: tuple[torch.Tensor, torch.Tensor],
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The routes of a packed row's pieces (`laid`: prompt (0) or completion (1) of which sequence, in
    order; `masks`: the laid columns of each), and which of its tokens are completion tokens."""
    if routes is None:
        return None, None
    pieces = [routes[part][i][masks[part][i]] for part, i in laid]
    flags = [torch.full((len(piece),), bool(part)) for piece, (part, _) in zip(pieces, laid, strict=True)]
    return torch.cat(pieces), torch.cat(flags)


def _segment(prompt: int, completions: list[int]) -> Segment:
    """A prompt and its completions (none empty): one plain sequence when it has a single completion."""
    if len(completions) <= 1:
        return Segment(prompt + sum(completions))
    return Segment(prompt, tuple(completions))


def unpack(values_1K: torch.Tensor, completion_mask_MC: torch.Tensor) -> torch.Tensor:
    """Puts per-completion-token values [1, K] back into [M, C] (0 on padding, values on every laid
    column of `completion_span`, the loss masks the rest); keeps the gradient."""
    out_MC = values_1K.new_zeros(completion_mask_MC.shape)
    return out_MC.masked_scatter(completion_span(completion_mask_MC).bool(), values_1K[0])
