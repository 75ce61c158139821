"""Decoding attention for the hf generator: one new token per row against its KV cache, as two batched
matrix products on the CPU in bf16 instead of torch's CPU flash kernel.

Shapes: B rows, H query heads, Hkv key/value heads (H = Hkv x G, grouped-query attention), Q new tokens
(1 when decoding), K cached keys, D head size.

Measured here (SmolLM2-135M bf16, 16 rows, one thread, 64 decoding steps): torch's flash kernel took
0.49 ms a call, 13% of the generation (0.93 s), for products of a few thousand multiply-adds per head;
its fixed cost per call dominates at one query. Everything else (a prompt's prefill, float32, a GPU,
dropout) goes to transformers' own SDPA function.
"""

from __future__ import annotations

import torch

DECODE_ATTENTION = "llamarl_decode"
"""The name `register` gives the implementation in transformers' attention registries."""


def _products_are_faster(query_BHQD: torch.Tensor, dropout: float, kwargs: dict) -> bool:
    """One query per row, bf16/fp16 on the CPU, no dropout, nothing the products do not implement."""
    return (
        query_BHQD.device.type == "cpu"
        and query_BHQD.dtype in (torch.bfloat16, torch.float16)
        and query_BHQD.shape[2] == 1
        and dropout == 0.0
        and kwargs.get("sliding_window") is None
        and kwargs.get("softcap") is None
    )


def decode_products(
    query_BHQD: torch.Tensor,
    key_BHkvKD: torch.Tensor,
    value_BHkvKD: torch.Tensor,
    mask: torch.Tensor | None,
    *,
    scale: float | None,
) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v, each query seeing every key the mask allows; returns [B, Q, H, D].

    `mask`: None (every key), bool [B or 1, 1, Q, K] (True: attend, as transformers' SDPA masks) or an
    additive float mask of that shape. Grouped-query heads are folded into the rows of their key/value
    head (query head h reads key/value head h // G, as SDPA's `enable_gqa` does): no key or value is
    copied per head.
    """
    rows, heads, queries, dim = query_BHQD.shape
    kv_heads, keys = key_BHkvKD.shape[1], key_BHkvKD.shape[2]
    per_kv = heads // kv_heads
    # Scaled before the product: Q x D multiplies instead of Q x K.
    query_BHQD = query_BHQD * (dim**-0.5 if scale is None else scale)
    scores_BGRK = query_BHQD.reshape(rows, kv_heads, per_kv * queries, dim) @ key_BHkvKD.transpose(2, 3)
    if mask is not None:
        mask_B1RK = mask[..., :keys].reshape(mask.shape[0], 1, 1, queries, keys)
        scores_BGRK = scores_BGRK.view(rows, kv_heads, per_kv, queries, keys)
        if mask.dtype == torch.bool:
            scores_BGRK = scores_BGRK.masked_fill(~mask_B1RK, torch.finfo(scores_BGRK.dtype).min)
        else:
            scores_BGRK = scores_BGRK + mask_B1RK
        scores_BGRK = scores_BGRK.view(rows, kv_heads, per_kv * queries, keys)
    out_BGRD = scores_BGRK.softmax(-1) @ value_BHkvKD
    return out_BGRD.view(rows, heads, queries, dim).transpose(1, 2)


def decode_attention_forward(
    module: torch.nn.Module,
    query_BHQD: torch.Tensor,
    key_BHkvKD: torch.Tensor,
    value_BHkvKD: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The transformers attention-interface function (see `register`): `decode_products` where they are
    faster, transformers' SDPA function otherwise. Returns (output [B, Q, H, D], None)."""
    if _products_are_faster(query_BHQD, dropout, kwargs):
        return decode_products(query_BHQD, key_BHkvKD, value_BHkvKD, attention_mask, scale=scaling), None
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(
        module, query_BHQD, key_BHkvKD, value_BHkvKD, attention_mask, dropout, scaling, **kwargs
    )


def register() -> None:
    """Registers the implementation under `DECODE_ATTENTION` with transformers (idempotent), with
    transformers' SDPA masks (the fallback takes them as they are)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(DECODE_ATTENTION, decode_attention_forward)
    AttentionMaskInterface.register(DECODE_ATTENTION, sdpa_mask)
