"""Padding token lists into tensors: prompts on the left, completions on the right."""

from __future__ import annotations

import torch

from llamarl.exec.padding import completion_mask, left_pad, right_pad


def test_prompts_are_left_padded_and_completions_right_padded():
    ids_BP, mask_BP = left_pad([[5, 6, 7], [8]], pad_token_id=0)
    assert ids_BP.tolist() == [[5, 6, 7], [0, 0, 8]] and mask_BP.tolist() == [[1, 1, 1], [0, 0, 1]]
    ids_BC = right_pad([[1, 2], [], [3]], 9, torch.int64)
    assert ids_BC.dtype == torch.int64 and ids_BC.tolist() == [[1, 2], [9, 9], [3, 9]]
    logprobs_BC = right_pad([[-0.5], [-1.25, -2.0]], 0.0, torch.float32)
    assert logprobs_BC.dtype == torch.float32 and logprobs_BC.tolist() == [[-0.5, 0.0], [-1.25, -2.0]]
    assert right_pad([[], []], 0, torch.int64).shape == (2, 0)  # nothing sampled yet


def test_the_completion_mask_ends_at_the_first_eos_even_when_padding_is_eos():
    ids_BC = right_pad([[4, 2, 7], [2], [4, 4]], 2, torch.int64)  # pad id 2 is also the EOS
    assert completion_mask(ids_BC, [2]).tolist() == [[1, 1, 0], [1, 0, 0], [1, 1, 1]]
