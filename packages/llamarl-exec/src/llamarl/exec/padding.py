"""Token sequences as padded tensors: prompts left-padded for batched generation, completions right-padded
and cut at their first EOS.

Shape legend: B sequences, P prompt length, C completion length.
"""

from __future__ import annotations

import torch


def left_pad(sequences: list[list[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pads token lists to the longest; returns (ids_BP, mask_BP), both int64."""
    length = max(len(s) for s in sequences)
    ids_BP = torch.full((len(sequences), length), pad_token_id, dtype=torch.int64)
    mask_BP = torch.zeros((len(sequences), length), dtype=torch.int64)
    for i, s in enumerate(sequences):
        if s:
            ids_BP[i, length - len(s) :] = torch.tensor(s, dtype=torch.int64)
            mask_BP[i, length - len(s) :] = 1
    return ids_BP, mask_BP


def right_pad(rows: list[list], fill: float, dtype: torch.dtype) -> torch.Tensor:
    """Right-pads lists (token ids, log-probs, versions, masks) to the longest with `fill`: `dtype` [B, C]
    (C = 0 when every row is empty)."""
    length = max((len(r) for r in rows), default=0)
    out_BC = torch.full((len(rows), length), fill, dtype=dtype)
    for i, r in enumerate(rows):
        if r:
            out_BC[i, : len(r)] = torch.tensor(r, dtype=dtype)
    return out_BC


def completion_mask(completion_ids_BC: torch.Tensor, eos_token_ids: list[int]) -> torch.Tensor:
    """1 up to and including the first EOS of each row (all ones when there is none), int64 [B, C].

    The mask comes from the EOS position, not from `!= pad`: many models (SmolLM2 among them) pad with
    their EOS token.
    """
    is_eos_BC = torch.isin(completion_ids_BC, torch.tensor(eos_token_ids, device=completion_ids_BC.device))
    # Number of EOS tokens strictly before each position: 0 means the position is still in the completion.
    eos_before_BC = torch.cumsum(is_eos_BC.long(), dim=1) - is_eos_BC.long()
    return (eos_before_BC == 0).long()
