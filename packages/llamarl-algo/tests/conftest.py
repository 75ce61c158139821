"""Shared small batches for the algo tests, their helper module on sys.path, and the hypothesis profiles."""

import os
import pathlib
import sys
import tempfile

import pytest
import torch
from hypothesis import HealthCheck, Phase, settings

# Tests run with --import-mode=importlib: make `llamarl_algo_testing` (next to this file) importable.
sys.path.insert(0, str(pathlib.Path(__file__).parent))

# Property tests are deterministic (derandomize: the same examples on every run, so a failure reproduces
# and CI never flakes) and bounded (a few seconds each on a loaded 2-core machine). No example database:
# nothing is written into the checkout. The "mutation" profile (tools/mutation_test.py) skips shrinking:
# there only whether a test fails matters, and shrinking a failure against every mutant costs minutes.
_COMMON = {
    "derandomize": True,
    "database": None,
    "deadline": None,
    "suppress_health_check": [HealthCheck.too_slow],
}
# Hypothesis also caches and writes patches under .hypothesis/ in the working directory: keep that out
# of the checkout too (an explicit HYPOTHESIS_STORAGE_DIRECTORY wins).
os.environ.setdefault(
    "HYPOTHESIS_STORAGE_DIRECTORY", str(pathlib.Path(tempfile.gettempdir()) / "llamarl-hypothesis")
)
settings.register_profile("llamarl", max_examples=40, **_COMMON)
settings.register_profile("mutation", max_examples=40, phases=[Phase.explicit, Phase.generate], **_COMMON)
settings.load_profile(os.environ.get("LLAMARL_HYPOTHESIS_PROFILE", "llamarl"))


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
