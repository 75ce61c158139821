"""A KV cache for the hf generator that writes each decoded token in place instead of copying the cache.

transformers' `DynamicLayer` grows by `torch.cat` at every decoding step: each step copies every layer's
whole keys and values ([B, H, L, D], twice), so decoding moves O(L^2) bytes per layer. Its `StaticLayer`
writes in place but hands attention the full reserved length, masked. `ReservedLayer` does neither: it
reserves room for the whole generation once (prompt + max_new_tokens positions), writes each step's keys
and values into it, and hands attention a view of the positions filled so far.

Measured (SmolLM2-135M, bf16, 4 prompts x 4 samples x 128 new tokens, one CPU thread): a generate call
11.9 -> 10.8 s on an idle machine, 12.6 -> 11.3 s in the async GSM8K run beside the trainer (decoding is
bound by memory bandwidth, which the copies took their share of).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer


class ReservedLayer(DynamicLayer):
    """A `DynamicLayer` whose keys and values live in buffers with room for `capacity` positions ([B, H,
    capacity, D]); `keys` / `values` are views of the positions filled so far. A write past the room
    moves them to buffers twice as large; whatever `DynamicLayer` does that replaces `keys` (reordering
    or repeating the batch) is copied into new buffers at the next `update`."""

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = capacity
        self._key_buffer: torch.Tensor | None = None
        self._value_buffer: torch.Tensor | None = None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Writes `key_states` / `value_states` ([B, H, T, D]) after the cached positions; returns the
        keys and values of every position so far ([B, H, L + T, D], views of the buffers)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        length = self.keys.shape[-2] if self.keys.numel() else 0
        end = length + key_states.shape[-2]
        if not self._has_room(end):
            self._move_to_new_buffers(length, end, key_states, value_states)
        self._key_buffer[:, :, length:end] = key_states
        self._value_buffer[:, :, length:end] = value_states
        self.keys = self._key_buffer[:, :, :end]
        self.values = self._value_buffer[:, :, :end]
        return self.keys, self.values

    def _has_room(self, end: int) -> bool:
        """Whether `keys` is still a view of this layer's buffers (same batch) and they reach `end`."""
        buffer = self._key_buffer
        return (
            buffer is not None
            and self.keys.numel() > 0
            and self.keys.data_ptr() == buffer.data_ptr()
            and self.keys.shape[0] == buffer.shape[0]
            and end <= buffer.shape[-2]
        )

    def _move_to_new_buffers(
        self, length: int, end: int, key_states: torch.Tensor, value_states: torch.Tensor
    ) -> None:
        size = max(self.capacity, end, 2 * length)
        batch, heads, _, key_dim = key_states.shape
        keys = key_states.new_empty(batch, heads, size, key_dim)
        values = value_states.new_empty(batch, heads, size, value_states.shape[-1])
        if length:
            keys[:, :, :length] = self.keys
            values[:, :, :length] = self.values
        self._key_buffer, self._value_buffer = keys, values


def reserve(cache: Cache, capacity: int) -> Cache:
    """Makes `cache`'s plain `DynamicLayer`s `ReservedLayer`s with room for `capacity` positions, keeping
    what they hold (sliding-window and other kinds of layer stay as they are); returns `cache`."""
    for index, layer in enumerate(cache.layers):
        if type(layer) is DynamicLayer:
            reserved = ReservedLayer(capacity)
            reserved.__dict__.update(layer.__dict__)  # what it holds (keys, values, device, ...)
            cache.layers[index] = reserved
    return cache


def shared_prompt_cache(
    model: torch.nn.Module,
    prompt_ids_BP: torch.Tensor,
    prompt_mask_BP: torch.Tensor,
    samples_per_prompt: int,
    max_new_tokens: int,
) -> Cache | None:
    """The KV cache the hf generator decodes into: every prompt's tokens but its last, computed once
    per prompt and repeated for its samples (rows are a prompt's samples, contiguous), with room
    reserved for the whole generation (`reserve`, each step written in place). `generate` then
    forwards only the last prompt token of each row before it decodes. None (generate builds its own)
    for one-token prompts.

    Without the sharing each prompt is forwarded once per sample: for GSM8K's 4 prompts x 4 samples
    x 128 new tokens, 1536 prompt positions (padded) beside 2048 decoded tokens, instead of 380.
    Positions follow the attention mask as `generate`'s own (cumulative sum of the mask minus one,
    padding at 1), so the cache is the one it would build.
    """
    if prompt_ids_BP.shape[1] < 2:
        return None
    device = model.device
    ids_GP = prompt_ids_BP[::samples_per_prompt, :-1].to(device)
    mask_GP = prompt_mask_BP[::samples_per_prompt, :-1].to(device)
    positions_GP = (mask_GP.long().cumsum(-1) - 1).masked_fill_(mask_GP == 0, 1)
    cache = model(
        input_ids=ids_GP, attention_mask=mask_GP, position_ids=positions_GP, use_cache=True
    ).past_key_values
    if samples_per_prompt > 1:
        cache.batch_repeat_interleave(samples_per_prompt)
    return reserve(cache, capacity=prompt_ids_BP.shape[1] + max_new_tokens)
