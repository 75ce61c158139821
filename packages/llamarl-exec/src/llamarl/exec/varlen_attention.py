"""Per-segment ("varlen") attention for packed rows, as a transformers attention implementation.

Shape legend:
    B  rows, H  query heads, Hkv  key/value heads, T  tokens per row, D  head dim
    S  segments (packed sequences) in a row; their lengths sum to T

A packed row (`llamarl.exec.packing`) lays several sequences end to end, with position ids that restart
at each one. Left to itself, transformers turns those restarts into a dense block-diagonal [T, T] mask,
and SDPA with an arbitrary mask takes its slow math path: quadratic in the packed length, and mostly
spent on the blocks that are masked out. This implementation instead cuts the row at the segment
boundaries and runs causal SDPA (`is_causal=True`, the fast kernels) on each segment, so no [T, T] mask
is ever built and no work is spent across segments.

Use: `register()` once, then `model.set_attn_implementation(VARLEN_ATTENTION)`. Pass the segment
lengths of the micro-batch to the model's forward as `segment_lengths=` (computed once per
micro-batch, reused by every layer); without them each layer derives them from the position ids.
With a padding mask (2D attention mask) or a KV cache the implementation is plain SDPA, so the same
model still serves padded rows correctly.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
import torch.nn.functional as F

VARLEN_ATTENTION = "llamarl_varlen"


def lengths_from_positions(position_ids_T: torch.Tensor) -> list[int]:
    """Lengths of the sequences packed in one row, from its position ids (int [T]).

    A segment starts wherever the position does not continue the previous one (+1), as transformers
    itself reads packed position ids; the first token always starts one.
    """
    position_ids_T = position_ids_T.reshape(-1)
    if position_ids_T.numel() == 0:
        return []
    starts = torch.ones_like(position_ids_T, dtype=torch.bool)
    starts[1:] = position_ids_T[1:] != position_ids_T[:-1] + 1
    bounds = [*starts.nonzero().flatten().tolist(), position_ids_T.numel()]
    return [b - a for a, b in itertools.pairwise(bounds)]


def _row_attention(
    query_HTD: torch.Tensor,
    key_HTD: torch.Tensor,
    value_HTD: torch.Tensor,
    lengths: Sequence[int],
    *,
    scale: float | None,
    dropout: float,
    enable_gqa: bool,
) -> torch.Tensor:
    """Causal attention within each segment of one row; returns [T, H, D] (token-major, as the model's
    output projection reads it)."""
    if len(lengths) == 1:  # an unpacked row: one call, no split or copy
        pieces = [(query_HTD, key_HTD, value_HTD)]
    else:
        pieces = zip(
            query_HTD.split(lengths, dim=1),
            key_HTD.split(lengths, dim=1),
            value_HTD.split(lengths, dim=1),
            strict=True,
        )
    outs_LHD = [
        F.scaled_dot_product_attention(
            q, k, v, dropout_p=dropout, scale=scale, is_causal=True, enable_gqa=enable_gqa
        ).transpose(0, 1)
        for q, k, v in pieces
    ]
    return torch.cat(outs_LHD, dim=0) if len(outs_LHD) > 1 else outs_LHD[0].contiguous()


def varlen_attention_forward(
    module: torch.nn.Module,
    query_BHTD: torch.Tensor,
    key_BHkvTD: torch.Tensor,
    value_BHkvTD: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    *,
    segment_lengths: Sequence[int] | None = None,
    position_ids: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The transformers attention-interface function (see `register`).

    Args:
        query_BHTD, key_BHkvTD, value_BHkvTD: after rotary embedding; keys/values may have fewer heads
            (grouped-query attention), which SDPA broadcasts itself (`enable_gqa`, no copy).
        attention_mask: None for packed or unpadded rows (see `varlen_mask`); a mask means padded rows,
            handed to transformers' own SDPA path.
        segment_lengths: the packed sequences' lengths (sum T), one list for a single row.
        position_ids: int [B, T]; segments come from their restarts when `segment_lengths` is None.

    Returns:
        (output [B, T, H, D], None): the layout transformers' attention functions return.
    """
    # Features this path does not implement must not be silently dropped.
    if kwargs.get("sliding_window") is not None or kwargs.get("softcap") is not None:
        raise NotImplementedError("varlen attention supports neither sliding windows nor softcapping")
    num_rows, _, num_tokens, _ = query_BHTD.shape
    causal = kwargs.get("is_causal", getattr(module, "is_causal", True))
    if attention_mask is not None or key_BHkvTD.shape[2] != num_tokens or num_tokens == 1 or not causal:
        # Padded rows, a KV cache, one-token decoding or bidirectional attention: not a packed causal
        # row; transformers' own SDPA path is right there.
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query_BHTD, key_BHkvTD, value_BHkvTD, attention_mask, dropout, scaling, **kwargs
        )
    enable_gqa = query_BHTD.shape[1] != key_BHkvTD.shape[1]
    outs_THD = []
    for b in range(num_rows):
        if segment_lengths is not None:
            if num_rows != 1:
                raise ValueError("segment_lengths describes one packed row; got a batch of rows")
            lengths = list(segment_lengths)
            if sum(lengths) != num_tokens:
                raise ValueError(f"segment_lengths sum to {sum(lengths)}, the row has {num_tokens} tokens")
        elif position_ids is not None:
            lengths = lengths_from_positions(position_ids[b if position_ids.shape[0] > 1 else 0])
        else:
            lengths = [num_tokens]
        outs_THD.append(
            _row_attention(
                query_BHTD[b],
                key_BHkvTD[b],
                value_BHkvTD[b],
                lengths,
                scale=scaling,
                dropout=dropout,
                enable_gqa=enable_gqa,
            )
        )
    return torch.stack(outs_THD) if num_rows > 1 else outs_THD[0].unsqueeze(0), None


def varlen_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    *args,
    attention_mask: torch.Tensor | None = None,
    **kwargs,
) -> torch.Tensor | None:
    """The mask-interface function paired with `varlen_attention_forward`.

    No 2D padding mask and as many keys as queries (a packed or unpadded row, no cache): returns None,
    so the model builds no [T, T] mask at all and the attention reads the segments itself. Otherwise
    (padded rows, a cache) transformers' SDPA mask, for the SDPA fallback in the attention function.
    """
    from transformers.masking_utils import sdpa_mask

    if attention_mask is None and q_length == kv_length:
        return None
    return sdpa_mask(batch_size, q_length, kv_length, *args, attention_mask=attention_mask, **kwargs)


def register() -> None:
    """Registers the implementation under `VARLEN_ATTENTION` with transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(VARLEN_ATTENTION, varlen_attention_forward)
    AttentionMaskInterface.register(VARLEN_ATTENTION, varlen_mask)
