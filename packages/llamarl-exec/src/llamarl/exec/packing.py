"""Packed sequences: the real tokens of several sequences in one row, no padding, for the trainer.

Shape legend:
    M  sequences in a micro-batch, P  prompt length (left-padded), C  completion length (right-padded)
    T  real tokens of the micro-batch (prompts + completions, no padding), K  completion tokens in it

Each sequence is its real prompt tokens followed by its real completion tokens; the sequences are laid
end to end in one row of T tokens and the position ids restart at 0 at each one. Attention must stay
within each sequence: the trainer runs the model with `llamarl.exec.varlen_attention`, which attends
per segment (`PackedRow.segment_lengths`) with causal SDPA. (Plain transformers, given no attention
mask and no cache, reads the restarts as boundaries too, but through a dense block-diagonal [T, T]
mask.) So every token is computed as in its own padded row, and no layer spends any work on padding
or across sequences. The LM head runs only at the K positions that predict a completion token.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch


@dataclass(frozen=True, kw_only=True)
class PackedRow:
    """One micro-batch packed into a single row."""

    input_ids_1T: torch.Tensor  # int64 [1, T]
    position_ids_1T: torch.Tensor  # int64 [1, T], 0.. per sequence
    predict_index_K: torch.Tensor  # int64 [K]: positions whose logits predict the completion tokens
    target_ids_1K: torch.Tensor  # int64 [1, K]: those completion tokens, in row-major (sequence) order
    segment_lengths: tuple[int, ...]  # real tokens of each packed sequence, in order (sum T)


def sequence_lengths(prompt_mask_BP: torch.Tensor, completion_mask_BC: torch.Tensor) -> list[int]:
    """Real tokens per sequence (prompt + completion): what a sequence costs in a packed row."""
    return (prompt_mask_BP.sum(1) + completion_mask_BC.sum(1)).tolist()


def token_budget_rows(lengths: list[int], budget: int) -> list[slice]:
    """Splits sequences, in order, into consecutive micro-batches of at most `budget` tokens each.

    Order is kept (a group's samples stay next to each other, and results map back by slice); a
    sequence longer than the budget gets a micro-batch of its own rather than being cut.
    """
    if budget < 1:
        raise ValueError(f"token budget must be positive, got {budget}")
    rows: list[slice] = []
    first, used = 0, 0
    for i, length in enumerate(lengths):
        if i > first and used + length > budget:
            rows.append(slice(first, i))
            first, used = i, 0
        used += length
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
) -> PackedRow:
    """Packs a micro-batch of left-padded prompts and right-padded completions into one row.

    Completion masks must be right-padded (ones then zeros), as generators produce them: the k-th real
    completion token of a sequence then sits at column k, so the packed log-probs map back to [M, C]
    with `completion_mask_MC` (see `unpack`).
    """
    prompt_mask = prompt_mask_MP.bool()
    completion_mask = completion_mask_MC.bool()
    ids, positions, predict, targets, lengths = [], [], [], [], []
    offset = 0
    for i in range(prompt_ids_MP.shape[0]):
        prompt = prompt_ids_MP[i][prompt_mask[i]]
        completion = completion_ids_MC[i][completion_mask[i]]
        num_prompt, num_completion = len(prompt), len(completion)
        ids += [prompt, completion]
        positions.append(torch.arange(num_prompt + num_completion))
        # Position p predicts token p + 1: positions P-1 .. P+C-2 predict the completion tokens.
        predict.append(torch.arange(num_completion) + offset + num_prompt - 1)
        targets.append(completion)
        lengths.append(num_prompt + num_completion)
        offset += num_prompt + num_completion
    return PackedRow(
        input_ids_1T=torch.cat(ids).unsqueeze(0),
        position_ids_1T=torch.cat(positions).unsqueeze(0),
        predict_index_K=torch.cat(predict),
        target_ids_1K=torch.cat(targets).unsqueeze(0),
        segment_lengths=tuple(lengths),
    )


def unpack(values_1K: torch.Tensor, completion_mask_MC: torch.Tensor) -> torch.Tensor:
    """Puts per-completion-token values [1, K] back into [M, C] (0 on padding); keeps the gradient."""
    out_MC = values_1K.new_zeros(completion_mask_MC.shape)
    return out_MC.masked_scatter(completion_mask_MC.bool(), values_1K[0])
