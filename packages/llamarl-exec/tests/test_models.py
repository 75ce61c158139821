"""Model helpers: dtype names, tiny models, the SmolLM2 cache's lock and atomic rename, EOS masks."""

from __future__ import annotations

import threading

import pytest
import torch

from llamarl.exec import models
from llamarl.exec.models import load_model_and_tokenizer, resolve_dtype, tiny_model
from llamarl.exec.padding import completion_mask


def test_resolve_dtype():
    assert resolve_dtype("bf16") is torch.bfloat16
    assert resolve_dtype("float32") is torch.float32
    assert resolve_dtype(torch.float16) is torch.float16
    with pytest.raises(ValueError, match="unknown floating-point dtype"):
        resolve_dtype("int8")


def test_tiny_model_is_seeded_and_loads_from_a_folder_without_tokenizer(tmp_path):
    first, second, other = tiny_model(32, seed=1), tiny_model(32, seed=1), tiny_model(32, seed=2)
    state, same, different = first.state_dict(), second.state_dict(), other.state_dict()
    assert all(torch.equal(state[k], same[k]) for k in state)
    assert not torch.equal(state["lm_head.weight"], different["lm_head.weight"])
    first.save_pretrained(tmp_path)
    loaded, tokenizer = load_model_and_tokenizer(tmp_path, dtype="bfloat16")
    assert tokenizer is None
    assert loaded.dtype is torch.bfloat16
    torch.testing.assert_close(loaded.lm_head.weight.float(), state["lm_head.weight"].bfloat16().float())


def test_smollm2_cache_converts_once_under_concurrent_callers(tmp_path, monkeypatch):
    """The lock and the atomic rename, with the (90 s) GGUF conversion replaced by a slow file write."""
    calls = []

    def fake_convert(gguf, out_dir):
        calls.append(out_dir)
        threading.Event().wait(0.5)  # long enough for the other caller to reach the lock
        (out_dir / "config.json").write_text("{}")

    monkeypatch.setattr(models, "_convert_smollm2", fake_convert)
    target = tmp_path / "smollm2"
    results = []
    threads = [threading.Thread(target=lambda: results.append(models.smollm2_path(target))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert results == [target, target]
    assert len(calls) == 1 and calls[0] != target  # written elsewhere, then renamed into place
    assert (target / "config.json").is_file()
    assert [p.name for p in tmp_path.iterdir() if "tmp" in p.name] == []


def test_a_failed_conversion_leaves_nothing_behind(tmp_path, monkeypatch):
    def broken_convert(gguf, out_dir):
        (out_dir / "partial").write_text("x")
        raise RuntimeError("disk full")

    monkeypatch.setattr(models, "_convert_smollm2", broken_convert)
    with pytest.raises(RuntimeError, match="disk full"):
        models.smollm2_path(tmp_path / "smollm2")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".smollm2.lock"]


def test_completion_mask_ends_at_the_first_eos():
    eos, pad = 2, 2  # SmolLM2 pads with its EOS token: the mask must not come from `!= pad`
    ids = torch.tensor(
        [[5, 6, eos, pad, pad], [eos, pad, pad, pad, pad], [5, 6, 7, 8, 9], [5, 9, 7, eos, pad]]
    )
    expected = torch.tensor([[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1], [1, 1, 1, 1, 0]])
    assert torch.equal(completion_mask(ids, [eos]), expected)
    assert torch.equal(
        completion_mask(ids, [eos, 9]),
        torch.tensor([[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]),
    )
