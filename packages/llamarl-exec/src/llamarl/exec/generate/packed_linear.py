"""Linear layers that decode on the CPU with their weights packed once for oneDNN, not on every call.

A CPU matrix product reorders its weight into oneDNN's blocked layout on every call. Decoding multiplies
a few rows (one token per sequence) by every weight of the model at every step, so that reorder is paid
once per weight per step, on top of reading the weight. `pack_linear_layers` turns the `nn.Linear`
layers of a generator's model into `PackedLinear`s, which keep a copy of their weight in the blocked
layout (`torch.ops.mkldnn._reorder_linear_weight`, the same packing torch.compile's CPU backend does for
frozen weights) and multiply with it (`torch.ops.mkldnn._linear_pointwise`), with the same results as
`F.linear` to float rounding (tested on every CPU). Where oneDNN runs the same kernel for both (seen on
CPUs with AMX) they agree to the bit; elsewhere a product of one row (a decoding step of one sequence)
may take another kernel than `F.linear`'s and differ in the last bits (seen on an AMD EPYC with
avx512_bf16 and no AMX: 1e-4 of a [1, 576] x [576, 49152] product's magnitude in fp32), which sampling
and the trainer's recomputed log-probs never notice.

Measured (SmolLM2-135M, bf16, 4 prompts x 4 samples x 128 new tokens, one thread, a CPU with AMX): a
generate call 11.3-11.7 -> 10.1-10.3 s; a [16, 576] x [576, 49152] output head 7.5 -> 3.7 ms (fp32:
22.8 -> 13.2 ms). The price is the packed copy: the linear weights once more (for SmolLM2-135M in bf16,
0.27 GB).

The packed copy goes stale when the weights change. `PackedLinear` notices an in-place write to its
weight through the parameter itself (`copy_`, `load_state_dict`: the tensor's version counter) or a
new tensor in its place, and repacks at its next call; a write through `weight.data` (as the weight
sync's receiver writes) bypasses the version counter, so whoever writes that way calls
`weights_changed` after. Packing applies where it can and is right: CPU float weights, no gradient
wanted (with one, the layer is an ordinary `nn.Linear`), and a oneDNN build whose packed product
matches `F.linear` on a probe.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_ROWS_HINT = 16  # the rows oneDNN picks the layout for; decoding multiplies a batch of single tokens
ROUNDING = {
    torch.float32: {"rtol": 1e-4, "atol": 1e-5},
    torch.bfloat16: {"rtol": 2e-2, "atol": 1e-2},
    torch.float16: {"rtol": 2e-3, "atol": 1e-3},
}
"""How far a packed product may be from `F.linear`'s: a few units in the last place of the dtype, over
the products' own rounding (another kernel sums in another order)."""


class PackedLinear(torch.nn.Linear):
    """An `nn.Linear` (same parameters, names and state dict) whose forward without autograd multiplies
    with a oneDNN-packed copy of its weight, packed on first use and again after the weight changed."""

    _packed: torch.Tensor | None
    _packed_of: tuple[int, int] | None  # (data_ptr, version) of the weight the copy was packed from

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """input [..., in_features] -> [..., out_features]."""
        weight = self.weight
        if (
            (torch.is_grad_enabled() and (weight.requires_grad or input.requires_grad))
            or input.dtype != weight.dtype
            or input.device.type != "cpu"
        ):
            return F.linear(input, weight, self.bias)
        if self._packed is None or self._packed_of != (weight.data_ptr(), weight._version):
            self.repack()
        return torch.ops.mkldnn._linear_pointwise(input, self._packed, self.bias, "none", [], "")

    @torch.no_grad()
    def repack(self) -> None:
        """Packs the weight as it is now (after a write the version counter cannot see)."""
        weight = self.weight
        self._packed = None  # (the old copy goes before the new one is made: one layer's extra at a time)
        self._packed = pack_weight(weight)
        self._packed_of = (weight.data_ptr(), weight._version)

    def adopt(self, packed: torch.Tensor | None) -> None:
        """Takes `packed` (`pack_weight` of the values the weight holds now, e.g. prepared off the decoding
        thread before the weight was pointed at new memory) as the packed copy of its current weight;
        None: the weight's values did not change, only its memory, and the copy held still fits."""
        if packed is None:
            packed = self._packed
        if packed is None:  # never packed yet: its first call packs it
            return
        self._packed = packed
        self._packed_of = (self.weight.data_ptr(), self.weight._version)


@torch.no_grad()
def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [out_features, in_features] in oneDNN's blocked layout: what `PackedLinear` multiplies by."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _ROWS_HINT)


def packing_works(dtype: torch.dtype) -> bool:
    """Whether this torch build packs CPU linear weights of `dtype` and multiplies with them as `F.linear`
    does, to float rounding (checked on a small probe of one row and of several)."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False
    probe = torch.nn.Linear(64, 32, dtype=dtype)
    x_BK = torch.randn(5, 64, dtype=dtype)
    try:
        with torch.no_grad():
            packed = torch.ops.mkldnn._reorder_linear_weight(probe.weight, _ROWS_HINT)
            pairs = [
                (
                    torch.ops.mkldnn._linear_pointwise(x, packed, probe.bias, "none", [], ""),
                    F.linear(x, probe.weight, probe.bias),
                )
                for x in (x_BK, x_BK[:1])
            ]
    except (RuntimeError, AttributeError, NotImplementedError):  # (a build without these ops)
        return False
    return all(torch.allclose(got, expected, **ROUNDING[dtype]) for got, expected in pairs)


def pack_linear_layers(model: torch.nn.Module) -> int:
    """Makes every CPU `nn.Linear` of `model` with float weights a `PackedLinear`, in place (the weights
    are packed at first use); returns how many. None where packing does not work in this build."""
    layers = [
        m
        for m in model.modules()
        if type(m) is torch.nn.Linear and m.weight.device.type == "cpu" and m.weight.is_floating_point()
    ]
    works: dict[torch.dtype, bool] = {}
    count = 0
    for layer in layers:
        dtype = layer.weight.dtype
        if dtype not in works:
            works[dtype] = packing_works(dtype)
        if works[dtype]:
            layer.__class__ = PackedLinear  # (same attributes; the forward differs)
            layer._packed, layer._packed_of = None, None
            count += 1
    return count


def weights_changed(model: torch.nn.Module) -> None:
    """Drops the packed copies of every `PackedLinear` of `model` (after its weights were written through
    `.data`); each layer packs its new weight at its next call."""
    for module in model.modules():
        if isinstance(module, PackedLinear):
            module._packed, module._packed_of = None, None
