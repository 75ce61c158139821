"""Packed linear layers (`llamarl.exec.generate.packed_linear`): the same numbers as `F.linear` to float
rounding, repacked after the weights change, ordinary linear layers where a gradient is wanted.

What every CPU gives is agreement to rounding (`ROUNDING`): oneDNN may multiply one row with another
kernel than `F.linear` does (to the bit on CPUs with AMX; within the last bits on an AMD EPYC with
avx512_bf16 and no AMX), so no test here asks for bitwise equality."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from llamarl.exec.generate.packed_linear import (
    ROUNDING,
    PackedLinear,
    pack_linear_layers,
    packing_works,
    weights_changed,
)


def _logits(model: torch.nn.Module, ids_BT: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids_BT).logits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_packed_model_computes_the_plain_models_logits_to_rounding(tiny_model_dir, dtype):
    # (a CPU without bf16 support leaves bf16 layers plain: the same logits, nothing packed)
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=dtype).eval()
    packed = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=dtype).eval()
    linears = sum(type(m) is torch.nn.Linear for m in packed.modules())
    assert linears > 0
    if packing_works(dtype):
        assert pack_linear_layers(packed) == linears
        assert not any(type(m) is torch.nn.Linear for m in packed.modules())
    else:
        assert pack_linear_layers(packed) == 0
    assert packed.state_dict().keys() == plain.state_dict().keys()  # names unchanged: weight sync and
    ids_BT = torch.randint(0, packed.config.vocab_size, (3, 7))  # checkpoints see the same model
    torch.testing.assert_close(_logits(packed, ids_BT), _logits(plain, ids_BT), **ROUNDING[dtype])
    # a decoding step's shape too: one token per row
    torch.testing.assert_close(
        _logits(packed, ids_BT[:, :1]), _logits(plain, ids_BT[:, :1]), **ROUNDING[dtype]
    )


def test_a_write_through_the_parameter_is_seen_and_a_write_through_data_needs_weights_changed():
    assert packing_works(torch.float32)  # (oneDNN, in every x86 and arm build of torch)
    layer = torch.nn.Linear(16, 8)
    pack_linear_layers(layer)
    assert isinstance(layer, PackedLinear)
    x_BK = torch.randn(4, 16)
    with torch.no_grad():
        before = layer(x_BK)
        layer.weight.mul_(2.0)  # in place through the parameter: its version counter moves
        plain = torch.nn.functional.linear(x_BK, layer.weight, layer.bias)
        torch.testing.assert_close(layer(x_BK), plain, **ROUNDING[torch.float32])
        layer.weight.data.copy_(torch.zeros(8, 16))  # as the weight sync's receiver writes: unseen...
        stale = layer(x_BK)
        assert not torch.allclose(stale, layer.bias.expand(4, 8))  # still the doubled weights' product
        weights_changed(layer)  # ...until its writer says so
        torch.testing.assert_close(layer(x_BK), layer.bias.expand(4, 8), **ROUNDING[torch.float32])
        layer.weight = torch.nn.Parameter(torch.ones(8, 16))  # a new tensor in its place
        plain = torch.nn.functional.linear(x_BK, layer.weight, layer.bias)
        torch.testing.assert_close(layer(x_BK), plain, **ROUNDING[torch.float32])
    assert not torch.equal(before, layer(x_BK).detach())


def test_with_a_gradient_wanted_a_packed_layer_is_an_ordinary_linear_layer():
    layer = torch.nn.Linear(16, 8)
    reference = torch.nn.Linear(16, 8)
    reference.load_state_dict(layer.state_dict())
    pack_linear_layers(layer)
    x_BK = torch.randn(4, 16, requires_grad=True)
    layer(x_BK).square().sum().backward()
    grad_x = x_BK.grad.clone()
    x_BK.grad = None
    reference(x_BK).square().sum().backward()
    assert torch.equal(grad_x, x_BK.grad)
    assert torch.equal(layer.weight.grad, reference.weight.grad)
