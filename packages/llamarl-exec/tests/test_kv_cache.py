"""The reserved KV cache: the logits of transformers' own cache, each step written in place."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from llamarl.exec.generate.kv_cache import ReservedLayer, reserve

PROMPT_BP = torch.tensor([[1, 5, 9, 4, 7], [3, 3, 8, 2, 6]])


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()


@torch.no_grad()
def _decode(model, steps: int, *, repeat: int = 1, capacity: int | None = None):
    """As the generator decodes: the prompts' tokens but the last prefilled once, the cache repeated for
    `repeat` samples each (and reserved with `capacity`, when given), then the last prompt token and
    `steps` greedy tokens. Returns each step's logits [B, V] and the cache."""
    cache = model(input_ids=PROMPT_BP[:, :-1], use_cache=True).past_key_values
    if repeat > 1:
        cache.batch_repeat_interleave(repeat)
    if capacity is not None:
        reserve(cache, capacity)
    token_B1 = PROMPT_BP[:, -1:].repeat_interleave(repeat, dim=0)
    out = []
    for _ in range(steps + 1):
        logits = model(input_ids=token_B1, past_key_values=cache, use_cache=True).logits[:, -1]
        out.append(logits)
        token_B1 = logits.argmax(-1, keepdim=True)
    return out, cache


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated")
@pytest.mark.parametrize("capacity", [5, 64])  # 5: the steps past the room move to larger buffers
@pytest.mark.parametrize("repeat", [1, 3])
def test_decoding_into_a_reserved_cache_gives_the_logits_of_a_dynamic_one(model, capacity, repeat):
    expected, _ = _decode(model, 12, repeat=repeat)
    got, cache = _decode(model, 12, repeat=repeat, capacity=capacity)
    assert all(isinstance(layer, ReservedLayer) for layer in cache.layers)
    for step, (a, b) in enumerate(zip(got, expected, strict=True)):
        torch.testing.assert_close(a, b, msg=f"step {step}")
    assert cache.get_seq_length() == PROMPT_BP.shape[1] + 12


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated")
@torch.no_grad()
def test_within_its_room_every_step_writes_into_the_same_buffers(model):
    """No copy of the cache per step: the keys stay views of one buffer from the first step to the last."""
    cache = model(input_ids=PROMPT_BP[:, :-1], use_cache=True).past_key_values
    reserve(cache, PROMPT_BP.shape[1] + 6)
    token_B1, addresses = PROMPT_BP[:, -1:], set()
    for _ in range(7):
        logits = model(input_ids=token_B1, past_key_values=cache, use_cache=True).logits
        token_B1 = logits[:, -1].argmax(-1, keepdim=True)
        addresses.add(cache.layers[0].keys.data_ptr())
    assert len(addresses) == 1 and cache.get_seq_length() == PROMPT_BP.shape[1] + 6
