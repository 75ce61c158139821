"""torch.compile of the trainer's RMSNorm and MLP modules (llamarl.exec.train.compiled_modules), for real
(inductor, the machine's C++ compiler) on the tiny model: the same loss, gradients and step as eager."""

from __future__ import annotations

import pytest
import torch

from llamarl.exec.models import tiny_model
from llamarl.exec.testing import TINY_EOS_TOKEN_ID, build_trainer
from llamarl.exec.train.compiled_modules import AUTO_MIN_PARAMETERS, compile_modules, wants_compile
from llamarl.exec.types import RolloutBatch

PROMPTS = [[1, 5, 9, 13, 17], [1, 7]]


def _batch() -> RolloutBatch:
    g = torch.Generator().manual_seed(0)
    completions = torch.randint(3, 30, (4, 9), generator=g)
    completions[0, 6] = TINY_EOS_TOKEN_ID
    mask = torch.ones_like(completions)
    mask[0, 7:] = 0
    width = max(map(len, PROMPTS))
    prompt_ids = torch.tensor([[0] * (width - len(p)) + p for p in PROMPTS for _ in range(2)])
    return RolloutBatch(
        prompt_ids_BP=prompt_ids,
        prompt_mask_BP=(prompt_ids != 0).long(),
        completion_ids_BC=completions * mask,
        completion_mask_BC=mask,
        behavior_logprobs_BC=torch.full((4, 9), -3.0) * mask,
        rewards_B=torch.tensor([1.0, 0.0, 0.0, 1.0]),
        policy_version_B=torch.zeros(4, dtype=torch.int64),
        group_size=2,
    )


@pytest.mark.parametrize("compute_dtype", ["float32", "bfloat16"])
def test_compiled_norms_and_mlps_train_as_eager_ones_do(tiny_model_dir, compute_dtype):
    batch = _batch()
    trainers = {}
    for setting in ("off", "on"):
        trainer = build_trainer(
            str(tiny_model_dir), compile=setting, compute_dtype=compute_dtype, lr=1e-2, seed=0, pack_tokens=64
        )
        trainer.setup()
        trainers[setting] = trainer
    compiled = [m for m in trainers["on"].compute_model.modules() if getattr(m, "_compiled_call_impl", None)]
    # Every layer's two norms and MLP, and the final norm: 3 per layer + 1.
    assert len(compiled) == 3 * trainers["on"].model.config.num_hidden_layers + 1
    metrics = {s: t.accumulate_gradients(batch) for s, t in trainers.items()}
    tolerance = 1e-5 if compute_dtype == "float32" else 2e-2
    assert metrics["on"]["loss"] == pytest.approx(metrics["off"]["loss"], rel=tolerance, abs=tolerance / 10)
    eager, fused = (dict(t.model.named_parameters()) for t in trainers.values())
    assert eager.keys() == fused.keys()  # compiled in place: the same names (state dicts, weight sync)
    grad = {s: torch.cat([p.grad.flatten() for p in t.model.parameters()]) for s, t in trainers.items()}
    assert (grad["on"] - grad["off"]).norm() < tolerance * grad["off"].norm()


def test_auto_compiles_large_cpu_models_on_one_rank_only():
    small = tiny_model(vocab_size=96, num_hidden_layers=1, seed=0)
    assert not wants_compile("auto", small, "cpu", sharded=False)
    assert wants_compile("on", small, "cpu", sharded=False)
    assert not wants_compile("off", small, "cpu", sharded=False)

    class Large(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.empty(AUTO_MIN_PARAMETERS, device="meta"))

    assert wants_compile("auto", Large(), "cpu", sharded=False)
    assert not wants_compile("auto", Large(), "cpu", sharded=True)
    assert not wants_compile("auto", Large(), "cuda", sharded=False)
    with pytest.raises(ValueError, match="not supported with FSDP2"):
        wants_compile("on", small, "cpu", sharded=True)


def test_a_compile_that_fails_is_one_line_when_asked_for_and_eager_otherwise(monkeypatch, caplog):
    from llamarl.exec.train import compiled_modules

    def broken(module: torch.nn.Module) -> None:
        raise RuntimeError("no C++ compiler found\nmore detail")

    monkeypatch.setattr(compiled_modules, "_probe", broken)
    model = tiny_model(vocab_size=96, num_hidden_layers=1, seed=0)
    one_line = (
        r"^trainer.compile=on: torch.compile does not work here \(RuntimeError: no C\+\+ compiler found\)$"
    )
    with pytest.raises(RuntimeError, match=one_line):
        compile_modules(model, required=True)
    assert compile_modules(model, required=False) == 0
    assert "the trainer runs eager" in caplog.text
    assert not any(getattr(m, "_compiled_call_impl", None) for m in model.modules())
