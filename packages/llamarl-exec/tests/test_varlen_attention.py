"""Per-segment attention of packed rows (llamarl.exec.train.varlen_attention) against padded rows, on a tiny
real transformers Llama (grouped-query attention: 4 query heads, 2 key/value heads)."""

from __future__ import annotations

import pytest
import torch
from transformers import AttentionInterface

from llamarl.exec.models import tiny_model
from llamarl.exec.train import varlen_attention
from llamarl.exec.train.varlen_attention import VARLEN_ATTENTION, Segment, lengths_from_positions

LENGTHS = [7, 19, 3, 12]  # four sequences of different lengths in one packed row (T = 41)


@pytest.fixture
def model():
    varlen_attention.register()
    return tiny_model(vocab_size=96, num_hidden_layers=3, seed=1)


@pytest.fixture
def sequences() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 96, (n,), generator=g) for n in LENGTHS]


def _target_logprobs(logits_NV: torch.Tensor, ids_N: torch.Tensor) -> torch.Tensor:
    """log p(token t+1 | ..t) over one sequence: [N - 1]."""
    return logits_NV[:-1].log_softmax(-1).gather(-1, ids_N[1:, None]).squeeze(-1)


def _padded_logprobs(model, sequences: list[torch.Tensor]) -> list[torch.Tensor]:
    """The reference: one right-padded row per sequence, transformers' SDPA under a padding mask."""
    model.set_attn_implementation("sdpa")
    width = max(LENGTHS)
    ids = torch.zeros(len(sequences), width, dtype=torch.long)
    mask = torch.zeros(len(sequences), width, dtype=torch.long)
    for i, seq in enumerate(sequences):
        ids[i, : len(seq)] = seq
        mask[i, : len(seq)] = 1
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    return [_target_logprobs(logits[i, : len(s)], s) for i, s in enumerate(sequences)]


def _packed_logprobs(model, sequences: list[torch.Tensor], **forward_kwargs) -> list[torch.Tensor]:
    """The trainer's path: one packed row, position ids restarting per sequence, varlen attention."""
    model.set_attn_implementation(VARLEN_ATTENTION)
    ids = torch.cat(sequences)[None]
    positions = torch.cat([torch.arange(len(s)) for s in sequences])[None]
    logits = model(input_ids=ids, position_ids=positions, use_cache=False, **forward_kwargs).logits[0]
    return [_target_logprobs(chunk, s) for chunk, s in zip(logits.split(LENGTHS), sequences, strict=True)]


def _grads(model, logprobs: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Gradients of a loss that weighs every token differently (so a wrong token shows up)."""
    model.zero_grad()
    flat = torch.cat(logprobs)
    (flat * torch.linspace(-1.0, 2.0, len(flat))).sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("pass_lengths", [True, False], ids=["segments", "from_position_ids"])
def test_packed_varlen_matches_padded_logprobs_and_gradients(model, sequences, pass_lengths):
    padded = _padded_logprobs(model, sequences)
    padded_grads = _grads(model, padded)
    kwargs = {"segments": LENGTHS} if pass_lengths else {}
    packed = _packed_logprobs(model, sequences, **kwargs)
    packed_grads = _grads(model, packed)
    for p, q in zip(packed, padded, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-5)
    for name, grad in padded_grads.items():
        torch.testing.assert_close(packed_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_packed_row_builds_no_mask_and_attends_per_segment(model, sequences, monkeypatch):
    """Every layer gets no attention mask (no [T, T] mask built) and splits the row at the segments."""
    seen = []
    row_attention = varlen_attention._row_attention

    def spy(query_HTD, key_HTD, value_HTD, segments, **kwargs):
        seen.append([s.length for s in segments if not s.branches])
        return row_attention(query_HTD, key_HTD, value_HTD, segments, **kwargs)

    forward = varlen_attention.varlen_attention_forward

    def no_mask(module, query, key, value, attention_mask, *args, **kwargs):
        assert attention_mask is None
        return forward(module, query, key, value, attention_mask, *args, **kwargs)

    monkeypatch.setattr(varlen_attention, "_row_attention", spy)
    monkeypatch.setitem(AttentionInterface._global_mapping, VARLEN_ATTENTION, no_mask)
    _packed_logprobs(model, sequences, segments=LENGTHS)
    assert seen == [LENGTHS] * model.config.num_hidden_layers


def test_a_segment_boundary_changes_the_result(model, sequences):
    """The comparison above can fail: one attention span over the whole row (no boundaries) gives other
    log-probs from the second sequence on."""
    right = _packed_logprobs(model, sequences, segments=LENGTHS)
    wrong = _packed_logprobs(model, sequences, segments=[sum(LENGTHS)])
    torch.testing.assert_close(wrong[0], right[0], rtol=1e-5, atol=1e-5)  # the first sees only itself
    assert all((w - r).abs().max() > 1e-3 for w, r in zip(wrong[1:], right[1:], strict=True))


def test_padded_rows_under_varlen_fall_back_to_sdpa(model, sequences):
    """The same model still computes padded rows (with a padding mask) exactly as SDPA does."""
    padded = _padded_logprobs(model, sequences)
    model.set_attn_implementation(VARLEN_ATTENTION)
    width = max(LENGTHS)
    ids = torch.zeros(len(sequences), width, dtype=torch.long)
    mask = torch.zeros(len(sequences), width, dtype=torch.long)
    for i, seq in enumerate(sequences):
        ids[i, : len(seq)] = seq
        mask[i, : len(seq)] = 1
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    for i, s in enumerate(sequences):
        torch.testing.assert_close(_target_logprobs(logits[i, : len(s)], s), padded[i], rtol=0, atol=0)


def test_lengths_from_positions():
    assert lengths_from_positions(torch.tensor([0, 1, 2, 0, 1, 0, 0, 1, 2, 3])) == [3, 2, 1, 4]
    assert lengths_from_positions(torch.tensor([[5, 6, 7]])) == [3]  # one row, not starting at 0
    assert lengths_from_positions(torch.tensor([], dtype=torch.long)) == []


def test_segments_must_cover_the_row(model, sequences):
    with pytest.raises(ValueError, match="segments cover 29 tokens, the row has 41"):
        _packed_logprobs(model, sequences, segments=LENGTHS[:-1])


PROMPT, BRANCHES = 9, (5, 1, 11)  # one prompt shared by three completions of different lengths


def _shared_prefix_case(model, *, as_segment: Segment):
    """(packed log-probs of each completion, their gradients, padded log-probs, their gradients) for one
    prompt followed by three completions laid once as a shared-prefix row with `as_segment`."""
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, 96, (PROMPT,), generator=g)
    completions = [torch.randint(3, 96, (n,), generator=g) for n in BRANCHES]
    sequences = [torch.cat([prompt, c]) for c in completions]
    model.set_attn_implementation("sdpa")
    padded = []
    for seq in sequences:  # one unpadded row each: the plain reference
        logits = model(input_ids=seq[None], use_cache=False).logits[0]
        padded.append(_target_logprobs(logits, seq)[PROMPT - 1 :])  # the completion tokens only
    padded_grads = _grads(model, padded)
    model.set_attn_implementation(VARLEN_ATTENTION)
    ids = torch.cat([prompt, *completions])[None]
    positions = torch.cat([torch.arange(PROMPT), *[torch.arange(n) + PROMPT for n in BRANCHES]])[None]
    logits = model(input_ids=ids, position_ids=positions, use_cache=False, segments=[as_segment]).logits[0]
    packed, start = [], PROMPT
    for c in completions:
        # The prompt's last position predicts every completion's first token.
        predictors = torch.cat([logits[PROMPT - 1 : PROMPT], logits[start : start + len(c) - 1]])
        packed.append(predictors.log_softmax(-1).gather(-1, c[:, None]).squeeze(-1))
        start += len(c)
    return packed, _grads(model, packed), padded, padded_grads


def test_shared_prefix_segment_matches_one_row_per_sequence(model):
    """A prompt laid once with its completions as branches gives each completion the log-probs and
    gradients it has in its own row (the prompt's gradient summed over its completions)."""
    packed, packed_grads, padded, padded_grads = _shared_prefix_case(
        model, as_segment=Segment(PROMPT, BRANCHES)
    )
    for p, q in zip(packed, padded, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-5)
    for name, grad in padded_grads.items():
        torch.testing.assert_close(packed_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_branches_that_saw_each_other_would_differ(model):
    """The comparison above can fail: the same row read as one causal sequence (each completion also
    seeing the completions before it) changes the third completion. The first sees nothing new, and the
    second's one token is predicted from the prompt's last position."""
    packed, _, padded, _ = _shared_prefix_case(model, as_segment=Segment(PROMPT + sum(BRANCHES)))
    torch.testing.assert_close(packed[:2], padded[:2], rtol=1e-5, atol=1e-5)
    assert (packed[2] - padded[2]).abs().max() > 1e-3


@pytest.mark.parametrize("keys", [11, 7], ids=["after_a_prefix", "causal"])
def test_eager_pieces_match_sdpa_with_grouped_heads(keys):
    """The matrix-product attention of short bf16 pieces on the CPU (`_eager_attention`) computes what
    SDPA does, forward and backward, with 6 query heads reading 2 key/value heads (float64, so only a
    wrong head mapping or mask shows)."""
    g = torch.Generator().manual_seed(4)
    query = torch.randn(6, 7, 8, generator=g, dtype=torch.float64, requires_grad=True)
    key = torch.randn(2, keys, 8, generator=g, dtype=torch.float64, requires_grad=True)
    value = torch.randn(2, keys, 8, generator=g, dtype=torch.float64, requires_grad=True)
    mask = varlen_attention._prefix_causal_mask(7, keys - 7, query.device) if keys != 7 else None
    weights = torch.randn(7, 6, 8, generator=g, dtype=torch.float64)
    eager = varlen_attention._eager_attention(query, key, value, scale=0.3)
    eager_grads = torch.autograd.grad((eager * weights).sum(), (query, key, value))
    reference = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, is_causal=mask is None, scale=0.3, enable_gqa=True
    ).transpose(0, 1)
    reference_grads = torch.autograd.grad((reference * weights).sum(), (query, key, value))
    torch.testing.assert_close(eager, reference)
    for got, want in zip(eager_grads, reference_grads, strict=True):
        torch.testing.assert_close(got, want)


def test_bf16_shared_prefix_rows_take_the_eager_path(model, monkeypatch):
    """In bf16 every piece of a shared-prefix row goes through `_eager_attention` (the prompt and each
    completion, in every layer), and the completions' log-probs stay within bf16's rounding of their
    own rows under SDPA."""
    calls = []
    eager = varlen_attention._eager_attention

    def count(*args, **kwargs):
        calls.append(args[0].shape[1])
        return eager(*args, **kwargs)

    monkeypatch.setattr(varlen_attention, "_eager_attention", count)
    packed, _, padded, _ = _shared_prefix_case(model.to(torch.bfloat16), as_segment=Segment(PROMPT, BRANCHES))
    assert calls == [PROMPT, *BRANCHES] * model.config.num_hidden_layers
    for p, q in zip(packed, padded, strict=True):
        torch.testing.assert_close(p.float(), q.float(), rtol=0, atol=3e-2)


def test_decoding_over_a_padded_cache_matches_sdpa(model, monkeypatch):
    """Left-padded rows decoded with a KV cache: every one-query step goes through `_decode_attention`
    (SDPA matching the grouped heads itself, under the padding mask) and gives transformers' SDPA logits."""
    ids = torch.randint(1, 96, (3, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    mask[1, :1] = 0

    def decode() -> tuple[torch.Tensor, torch.Tensor]:
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=5,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
        return out.sequences, torch.stack(out.logits)

    assert model.config._attn_implementation == "sdpa"
    expected_ids, expected_logits = decode()
    calls = []
    decode_attention = varlen_attention._decode_attention
    monkeypatch.setattr(
        varlen_attention, "_decode_attention", lambda *args: calls.append(1) or decode_attention(*args)
    )
    varlen_attention.register()
    model.set_attn_implementation(VARLEN_ATTENTION)
    ids_out, logits = decode()
    assert len(calls) == 4 * model.config.num_hidden_layers  # the 4 steps after the prefill, every layer
    assert torch.equal(ids_out, expected_ids)
    torch.testing.assert_close(logits, expected_logits, rtol=1e-5, atol=1e-5)
