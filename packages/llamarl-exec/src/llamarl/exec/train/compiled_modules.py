"""torch.compile for the modules whose elementwise steps dominate a CPU training step.

A decoder layer's RMSNorm (an upcast, a square, a mean, a scale, a downcast, a weight) and its gated MLP
(an activation and a product between three matrix products) are chains of elementwise passes over the
[tokens, hidden] activations, each a trip through memory, forward, recomputed (activation
checkpointing) and backward. torch.compile (inductor) fuses each chain into one loop; the matrix
products stay oneDNN's. Measured (SmolLM2-135M, bf16, one CPU thread, the GSM8K benchmark's step of 16
x 128-token completions): an RMSNorm's forward and backward 12.9 -> 2.3 ms, the step 8.9 -> 8.0 s with
the norms compiled, 7.7 s with the MLPs too.

Compiled in place (`nn.Module.compile`), so parameter names, state dicts, checkpoints and weight sync see
the same modules. One graph per module class serves every layer (parameters are graph inputs) and the
token count is symbolic (`dynamic=True`): a run compiles once, about 12 s on this machine the first time
and 3 s with inductor's on-disk cache warm, which is why small models (tests, toys) are left eager.
"""

from __future__ import annotations

import copy
import logging

import torch

from llamarl.exec.config import CompileMode

log = logging.getLogger(__name__)

COMPILED_CLASS_SUFFIXES = ("RMSNorm", "MLP")
"""Module classes compiled, by the end of their name (LlamaRMSNorm, Qwen3MLP, ...): any module compiles
to the same function, these are where fusing pays."""

AUTO_MIN_PARAMETERS = 50_000_000
"""`auto` compiles models from this size: below it the one-time compile costs more than it saves."""


def refuse_compile_under_fsdp2(setting: CompileMode, *, sharded: bool) -> None:
    """Raises ValueError (one line) for `on` with FSDP2: under it the parameters are swapped for gathered
    ones at every forward, untested with compiled modules. (The run config checks it when it loads.)"""
    if setting == "on" and sharded:
        raise ValueError("trainer.compile on is not supported with FSDP2 (several trainer ranks); use auto")


def wants_compile(setting: CompileMode, model: torch.nn.Module, device: str, *, sharded: bool) -> bool:
    """Whether `compile_modules` should run for a trainer with this setting (`TrainerConfig.compile`).

    auto: a CPU model of AUTO_MIN_PARAMETERS or more on one trainer rank (measured there); `on` under
    FSDP2 is refused (`refuse_compile_under_fsdp2`).
    """
    refuse_compile_under_fsdp2(setting, sharded=sharded)
    if setting != "auto":
        return setting == "on"
    size = sum(p.numel() for p in model.parameters())
    return not sharded and torch.device(device).type == "cpu" and size >= AUTO_MIN_PARAMETERS


def compile_modules(model: torch.nn.Module, *, required: bool) -> int:
    """Compiles `model`'s RMSNorm and MLP modules (those with parameters) in place; returns how many.

    A copy of the first one is compiled and run forward and backward first, so that a machine where
    torch.compile cannot work (no C++ compiler, an unsupported torch) is found here, not in the middle
    of a step: then `required` raises a one-line error, else the model stays eager (logged).
    """
    targets = [
        m
        for m in model.modules()
        if type(m).__name__.endswith(COMPILED_CLASS_SUFFIXES) and next(m.parameters(), None) is not None
    ]
    if not targets:
        return 0
    try:
        _probe(targets[0])
    except Exception as error:  # inductor raises many kinds (compiler missing, lowering, backend)
        message = f"torch.compile does not work here ({type(error).__name__}: {str(error).splitlines()[0]})"
        if required:
            raise RuntimeError(f"trainer.compile=on: {message}") from error
        log.warning("%s; the trainer runs eager", message)
        return 0
    for module in targets:
        module.compile(dynamic=True)
    return len(targets)


def _probe(module: torch.nn.Module) -> None:
    """Compiles a copy of `module` and runs it forward and backward on a few random tokens."""
    probe = copy.deepcopy(module)
    probe.compile(dynamic=True)
    parameter = next(probe.parameters())
    width = _input_width(probe)
    hidden = torch.randn(1, 3, width, dtype=parameter.dtype, device=parameter.device, requires_grad=True)
    probe(hidden).float().sum().backward()


def _input_width(module: torch.nn.Module) -> int:
    """The hidden size a norm or MLP module reads: its first linear layer's input, else its weight's."""
    for sub in module.modules():
        if isinstance(sub, torch.nn.Linear):
            return sub.in_features
    return next(module.parameters()).shape[-1]
