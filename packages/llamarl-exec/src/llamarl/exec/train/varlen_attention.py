"""Per-segment ("varlen") attention for packed rows, as a transformers attention implementation.

Shape legend:
    B  rows, H  query heads, Hkv  key/value heads, T  tokens per row, D  head dim
    S  segments (packed sequences) in a row; their lengths sum to T

A packed row (`llamarl.exec.train.packing`) lays several sequences end to end, with position ids that restart
at each one. Left to itself, transformers turns those restarts into a dense block-diagonal [T, T] mask,
and SDPA with an arbitrary mask takes its slow math path: quadratic in the packed length, and mostly
spent on the blocks that are masked out. This implementation instead cuts the row at the segment
boundaries and runs causal SDPA (`is_causal=True`, the fast kernels) on each segment, so no [T, T] mask
is ever built and no work is spent across segments. Short bf16 pieces on the CPU are attended by plain
matrix products instead (`_eager_attention`), where torch's CPU flash kernel is slower.

Segments may also share a prefix (`Segment`): a group's prompt laid once, followed by its samples'
completions, each attending to the prompt and to itself only, so the prompt's tokens are computed once
per group instead of once per sample (position ids then restart at the prompt's length in each branch).

Use: `register()` once, then `model.set_attn_implementation(VARLEN_ATTENTION)`. Pass the segments of
the micro-batch to the model's forward as `segments=` (computed once per micro-batch, reused by every
layer); without them each layer derives plain segments from the position ids.
With a padding mask (2D attention mask) or a KV cache the implementation is plain SDPA, so the same
model still serves padded rows correctly; one-token decoding on the CPU calls SDPA with its grouped heads
(`_decode_attention`), which is how the hf generator uses it.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

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


@dataclass(frozen=True)
class Segment:
    """One piece of a packed row: a causal `prefix`, then optional `branches` that each attend to the
    whole prefix and causally to themselves, but not to one another.

    A plain packed sequence is `Segment(length)`. A prompt shared by a group of samples is
    `Segment(prompt_length, (completion lengths...))`: the prompt's tokens are laid once, each completion
    after it sees the prompt and its own earlier tokens, as it would in its own padded row.
    """

    prefix: int
    branches: tuple[int, ...] = ()

    @property
    def length(self) -> int:
        """Tokens of the row this segment covers."""
        return self.prefix + sum(self.branches)


def _prefix_causal_mask(branch: int, prefix: int, device: torch.device) -> torch.Tensor:
    """bool [branch, prefix + branch]: query j of a branch sees the prefix and branch tokens 0..j (the
    bottom-right-aligned causal mask; SDPA's `is_causal` aligns top-left)."""
    keys = torch.arange(prefix + branch, device=device)
    return keys[None, :] <= torch.arange(branch, device=device)[:, None] + prefix


EAGER_MAX_SCORES = 512 * 512
"""Largest query x key piece (per head) that `_eager_attention` takes: it keeps its [H, L, K]
probabilities for backward (4.7 MB per piece and layer at 9 heads in bf16), the flash kernel O(L)."""


def _eager_is_faster(query_HLD: torch.Tensor, key_HKD: torch.Tensor, dropout: float) -> bool:
    """Whether a piece goes to `_eager_attention`: short bf16/fp16 pieces on the CPU, without dropout.

    Measured here (2 threads, SmolLM2's 9 query and 3 key/value heads of 64, forward and backward of the
    pieces of a packed GSM8K row): torch's CPU flash kernel 2.0 s for 30 layers, two matrix products
    and a softmax 0.9 s; the kernel's bf16 backward dominates (3.5 ms for a 150-token causal piece, whose
    products take well under 1 ms). In float32 the two tie (1.6 s), so float32 keeps the kernel and its
    smaller memory; on a GPU the fused kernels win.
    """
    return (
        query_HLD.device.type == "cpu"
        and query_HLD.dtype in (torch.bfloat16, torch.float16)
        and dropout == 0.0
        and query_HLD.shape[1] * key_HKD.shape[1] <= EAGER_MAX_SCORES
    )


def _eager_attention(
    query_HLD: torch.Tensor,
    key_HkvKD: torch.Tensor,
    value_HkvKD: torch.Tensor,
    *,
    scale: float | None,
) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v for one piece, as matrix products; returns [L, H, D].

    The keys are K - L keys every query sees (a shared prompt's, or none) followed by the piece's own L,
    seen causally: the mask of every piece of a packed row. Grouped-query heads are matched by folding
    each key/value head's r query heads into its rows (query head h reads key/value head h // r, as
    SDPA's `enable_gqa` and transformers' `repeat_kv` do), so no key or value is copied per head.
    """
    heads, length, dim = query_HLD.shape
    kv_heads, keys, _ = key_HkvKD.shape
    per_kv = heads // kv_heads
    # Scaled before the product: L x D multiplies instead of L x K.
    query_HLD = query_HLD * (dim**-0.5 if scale is None else scale)
    scores_GRLK = (query_HLD.reshape(kv_heads, per_kv * length, dim) @ key_HkvKD.transpose(1, 2)).view(
        kv_heads, per_kv, length, keys
    )
    # Only the piece's own keys need masking. A finite fill, in case a row had no key left (none here):
    # a uniform row rather than NaNs.
    causal_LL = _prefix_causal_mask(length, 0, query_HLD.device)
    scores_GRLK[..., keys - length :].masked_fill_(~causal_LL, torch.finfo(scores_GRLK.dtype).min)
    probs_GRLK = scores_GRLK.softmax(-1)
    out_HLD = (probs_GRLK.view(kv_heads, per_kv * length, keys) @ value_HkvKD).view(heads, length, dim)
    return out_HLD.transpose(0, 1)


def _row_attention(
    query_HTD: torch.Tensor,
    key_HTD: torch.Tensor,
    value_HTD: torch.Tensor,
    segments: Sequence[Segment],
    *,
    scale: float | None,
    dropout: float,
    enable_gqa: bool,
) -> torch.Tensor:
    """Attention within each segment of one row; returns [T, H, D] (token-major, as the model's output
    projection reads it)."""

    def attend(q, k, v):  # [H, L, D] -> [L, H, D]; keys: a visible prefix, then the piece's own
        if _eager_is_faster(q, k, dropout):
            return _eager_attention(q, k, v, scale=scale)
        length, keys = q.shape[1], k.shape[1]
        mask = None if keys == length else _prefix_causal_mask(length, keys - length, q.device)
        return F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            dropout_p=dropout,
            scale=scale,
            is_causal=mask is None,
            enable_gqa=enable_gqa,
        ).transpose(0, 1)

    if len(segments) == 1 and not segments[0].branches:  # an unpacked row: one call, no split or copy
        return attend(query_HTD, key_HTD, value_HTD).contiguous()
    # One split per tensor, not a slice per piece: the backward of a slice writes its gradient into a
    # zero tensor of the whole row (one per piece, per layer: most of a packed backward's memory traffic
    # here), the backward of a split is one concatenation.
    pieces = [n for segment in segments for n in (segment.prefix, *segment.branches)]
    query_parts = query_HTD.split(pieces, dim=1)
    key_parts = key_HTD.split(pieces, dim=1)
    value_parts = value_HTD.split(pieces, dim=1)
    outs_LHD = []
    index = 0
    for segment in segments:
        prefix = index
        outs_LHD.append(attend(query_parts[prefix], key_parts[prefix], value_parts[prefix]))
        index += 1
        for _ in segment.branches:
            # The branch's keys/values are the prefix's then its own (a copy of the prefix's per branch,
            # small next to the branch's own compute; the prefix's gradient sums over its branches).
            outs_LHD.append(
                attend(
                    query_parts[index],
                    torch.cat([key_parts[prefix], key_parts[index]], dim=1),
                    torch.cat([value_parts[prefix], value_parts[index]], dim=1),
                )
            )
            index += 1
    return torch.cat(outs_LHD, dim=0)


def _decode_attention(
    query_BH1D: torch.Tensor,
    key_BHkvKD: torch.Tensor,
    value_BHkvKD: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float,
    scale: float | None,
) -> torch.Tensor:
    """One query per row over a KV cache (decoding, on the CPU); returns [B, 1, H, D].

    SDPA matches grouped-query heads itself (`enable_gqa`), also under a padding mask, where
    transformers instead folds each key/value head's query heads into query positions (its CUDA kernels
    take no mask with `enable_gqa`). On the CPU the folded call is the slower one: SmolLM2's 16 rows of 9
    query and 3 key/value heads over 100-200 cached positions, 146 -> 114 us a layer at 100 keys (one
    thread), the hf generator's 16 x 128-token generate 9.5 -> 9.2 s.
    """
    out_BH1D = F.scaled_dot_product_attention(
        query_BH1D,
        key_BHkvKD,
        value_BHkvKD,
        attn_mask=attention_mask,
        dropout_p=dropout,
        scale=scale,
        enable_gqa=query_BH1D.shape[1] != key_BHkvKD.shape[1],
    )
    return out_BH1D.transpose(1, 2).contiguous()


def varlen_attention_forward(
    module: torch.nn.Module,
    query_BHTD: torch.Tensor,
    key_BHkvTD: torch.Tensor,
    value_BHkvTD: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    *,
    segments: Sequence[Segment | int] | None = None,
    position_ids: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The transformers attention-interface function (see `register`).

    Args:
        query_BHTD, key_BHkvTD, value_BHkvTD: after rotary embedding; keys/values may have fewer heads
            (grouped-query attention), which SDPA broadcasts itself (`enable_gqa`, no copy).
        attention_mask: None for packed or unpadded rows (see `varlen_mask`); a mask means padded rows,
            handed to transformers' own SDPA path.
        segments: the packed row's segments, in order (their lengths sum to T), for a single row; an int
            is a plain sequence of that length. Shared-prefix segments can only come this way.
        position_ids: int [B, T]; plain segments come from their restarts when `segments` is None.

    Returns:
        (output [B, T, H, D], None): the layout transformers' attention functions return.
    """
    # Features this path does not implement must not be silently dropped.
    if kwargs.get("sliding_window") is not None or kwargs.get("softcap") is not None:
        raise NotImplementedError("varlen attention supports neither sliding windows nor softcapping")
    num_rows, _, num_tokens, _ = query_BHTD.shape
    if num_tokens == 1 and query_BHTD.device.type == "cpu" and kwargs.get("position_bias") is None:
        return _decode_attention(query_BHTD, key_BHkvTD, value_BHkvTD, attention_mask, dropout, scaling), None
    causal = kwargs.get("is_causal", getattr(module, "is_causal", True))
    if attention_mask is not None or key_BHkvTD.shape[2] != num_tokens or num_tokens == 1 or not causal:
        # Padded rows, a KV cache, one-token decoding off the CPU or bidirectional attention: not a
        # packed causal row; transformers' own SDPA path is right there.
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query_BHTD, key_BHkvTD, value_BHkvTD, attention_mask, dropout, scaling, **kwargs
        )
    enable_gqa = query_BHTD.shape[1] != key_BHkvTD.shape[1]
    outs_THD = [
        _row_attention(
            query_BHTD[b],
            key_BHkvTD[b],
            value_BHkvTD[b],
            _row_segments(b, num_rows, num_tokens, segments, position_ids),
            scale=scaling,
            dropout=dropout,
            enable_gqa=enable_gqa,
        )
        for b in range(num_rows)
    ]
    return torch.stack(outs_THD) if num_rows > 1 else outs_THD[0].unsqueeze(0), None


def _row_segments(
    row: int,
    num_rows: int,
    num_tokens: int,
    segments: Sequence[Segment | int] | None,
    position_ids_BT: torch.Tensor | None,
) -> list[Segment]:
    """The segments of row `row` of a batch of `num_rows` rows of `num_tokens` tokens: `segments` as
    given (one row only; an int is a plain sequence), else from the restarts of its position ids (int
    [B, T] or [1, T]), else the whole row as one sequence."""
    if segments is not None:
        if num_rows != 1:
            raise ValueError("segments describe one packed row; got a batch of rows")
        row_segments = [Segment(s) if isinstance(s, int) else s for s in segments]
        covered = sum(s.length for s in row_segments)
        if covered != num_tokens:
            raise ValueError(f"segments cover {covered} tokens, the row has {num_tokens}")
        return row_segments
    if position_ids_BT is not None:
        row_positions_T = position_ids_BT[row if position_ids_BT.shape[0] > 1 else 0]
        return [Segment(n) for n in lengths_from_positions(row_positions_T)]
    return [Segment(num_tokens)]


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
