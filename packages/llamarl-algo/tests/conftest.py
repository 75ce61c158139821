"""Shared small batches for the algo tests, and their helper module on sys.path."""

import pathlib
import sys

import pytest
import torch

# Tests run with --import-mode=importlib: make `llamarl_algo_testing` (next to this file) importable.
sys.path.insert(0, str(pathlib.Path(__file__).parent))


def _make_batch(seed: int = 0, batch: int = 4, tokens: int = 5, spread: float = 0.15):
    """A float64 batch of `batch` sequences (2 groups of batch // 2) with right padding.

    Ratios exp(logprobs - behaviour) stay within about exp(+-3 spread), so the clipped losses have
    both clipped and unclipped tokens, and random values keep away from the clip kinks.
    """
    gen = torch.Generator().manual_seed(seed)
    logprobs_BT = -torch.rand(batch, tokens, generator=gen, dtype=torch.float64) * 3 - 0.05
    behavior_BT = logprobs_BT + spread * torch.randn(batch, tokens, generator=gen, dtype=torch.float64)
    lengths = torch.tensor([tokens, tokens - 2, 1, tokens - 1][:batch] + [tokens] * max(0, batch - 4))
    mask_BT = (torch.arange(tokens)[None, :] < lengths[:, None]).to(torch.int64)
    advantages_B = torch.randn(batch, generator=gen, dtype=torch.float64)
    return logprobs_BT.requires_grad_(), behavior_BT, advantages_B, mask_BT


@pytest.fixture
def make_batch():
    """The batch factory (tests run with --import-mode=importlib, so conftest is not importable)."""
    return _make_batch


@pytest.fixture
def batch():
    return _make_batch()
