"""Decoding attention by matrix products (`llamarl.exec.decode_attention`) against torch's SDPA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llamarl.exec import HFGenerator, SamplingConfig
from llamarl.exec.decode_attention import DECODE_ATTENTION, decode_attention_forward, decode_products

ROWS, HEADS, KV_HEADS, KEYS, DIM = 3, 6, 2, 11, 8


def _inputs(dtype: torch.dtype, queries: int = 1):
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(ROWS, HEADS, queries, DIM, generator=generator, dtype=torch.float64).to(dtype)
    k = torch.randn(ROWS, KV_HEADS, KEYS, DIM, generator=generator, dtype=torch.float64).to(dtype)
    v = torch.randn(ROWS, KV_HEADS, KEYS, DIM, generator=generator, dtype=torch.float64).to(dtype)
    # Left padding of different lengths per row, as the generator's batches have: True = attend.
    mask = torch.ones(ROWS, 1, queries, KEYS, dtype=torch.bool)
    mask[1, ..., :3] = False
    mask[2, ..., :7] = False
    return q, k, v, mask


class _Attention(torch.nn.Module):
    """What transformers' SDPA function reads of an attention module."""

    num_key_value_groups = HEADS // KV_HEADS
    is_causal = True


def _sdpa(q, k, v, mask, scale=None):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True).transpose(
        1, 2
    )


@pytest.mark.parametrize("queries", [1, 2])
def test_the_products_equal_sdpa_with_grouped_heads_and_padding(queries):
    """float64, so only the arithmetic can differ: 6 query heads on 2 key/value heads, rows padded
    differently, a bool mask and the same mask as an additive float one, a custom scale."""
    q, k, v, mask = _inputs(torch.float64, queries)
    expected = _sdpa(q, k, v, mask, scale=0.3)
    torch.testing.assert_close(decode_products(q, k, v, mask, scale=0.3), expected, rtol=1e-12, atol=1e-12)
    additive = torch.zeros(mask.shape, dtype=torch.float64).masked_fill(~mask, float("-inf"))
    torch.testing.assert_close(
        decode_products(q, k, v, additive, scale=0.3), expected, rtol=1e-12, atol=1e-12
    )
    unmasked = decode_products(q, k, v, None, scale=None)
    torch.testing.assert_close(unmasked, _sdpa(q, k, v, None), rtol=1e-12, atol=1e-12)
    assert not torch.allclose(unmasked, expected)  # the mask mattered


def test_bf16_decoding_takes_the_products_and_the_rest_goes_to_sdpa(monkeypatch):
    """One bf16 query per row on the CPU: the products, within bf16 rounding of float64 SDPA; a prefill
    (several queries) and float32 go to transformers' SDPA function."""
    import llamarl.exec.decode_attention as module

    calls = []
    real = module.decode_products
    monkeypatch.setattr(module, "decode_products", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    q, k, v, mask = _inputs(torch.bfloat16)
    out, _ = decode_attention_forward(_Attention(), q, k, v, mask, scaling=DIM**-0.5)
    assert calls == [1] and out.dtype == torch.bfloat16
    expected = _sdpa(q.double(), k.double(), v.double(), mask)
    torch.testing.assert_close(out.double(), expected, rtol=0.02, atol=0.02)
    for args in (_inputs(torch.bfloat16, queries=2), _inputs(torch.float32)):
        decode_attention_forward(_Attention(), *args, scaling=DIM**-0.5)
    assert calls == [1]


def test_a_bf16_generator_decodes_with_it_and_its_logprobs_match_a_forward_pass(tiny_model_dir):
    """The hf generator in bf16 uses the products for every decoding step; its behaviour log-probs stay
    within bf16 rounding of a plain SDPA forward pass over each finished sequence."""
    gen = HFGenerator(str(tiny_model_dir), SamplingConfig(temperature=0.7), seed=0, dtype="bfloat16")
    gen.setup()
    try:
        assert gen.model.config._attn_implementation == DECODE_ATTENTION
        batch = gen.generate([[1, 5, 9, 13, 17], [1, 7]], samples_per_prompt=2, max_new_tokens=10)
        gen.model.set_attn_implementation("sdpa")
        mask = batch.completion_mask_BC.bool()
        for row in range(batch.num_sequences):
            prompt = batch.prompt_ids_BP[row][batch.prompt_mask_BP[row].bool()]
            completion = batch.completion_ids_BC[row][mask[row]]
            with torch.no_grad():
                logits = gen.model(torch.cat([prompt, completion])[None]).logits[0].float()
            expected = torch.log_softmax(logits[len(prompt) - 1 : -1] / 0.7, dim=-1)
            expected = expected.gather(-1, completion[:, None]).squeeze(-1)
            torch.testing.assert_close(
                batch.behavior_logprobs_BC[row][mask[row]], expected, atol=0.05, rtol=0.02
            )
    finally:
        gen.close()
