"""Helpers the two-process vLLM tests share: ranks signal steps to each other with files in the
rendezvous folder (`rdv.tmpdir`), and the trainer makes new weights the way a training step would."""

from __future__ import annotations

import time
from pathlib import Path

import torch

FILE_WAIT_S = 400.0  # a rank waiting for the other's step (they include engine starts)


def touch(rdv, name: str) -> None:
    """Marks step `name` as reached."""
    Path(rdv.tmpdir, name).touch()


def reached(rdv, name: str) -> bool:
    return Path(rdv.tmpdir, name).exists()


def wait_for(rdv, name: str, timeout_s: float = FILE_WAIT_S) -> None:
    """Waits until the other rank reached step `name`; raises TimeoutError past `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not reached(rdv, name):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the other rank never reached {name!r} ({timeout_s:.0f} s)")
        time.sleep(0.05)


def publish(rdv, name: str, obj) -> None:
    """Saves `obj` as file `name` for the other rank, whole: written under another name, then renamed,
    so a rank that sees the name (`wait_for`) never reads a file half written."""
    partial = Path(rdv.tmpdir, f".{name}.partial")
    torch.save(obj, partial)
    partial.replace(Path(rdv.tmpdir, name))


def receive(rdv, name: str, timeout_s: float = FILE_WAIT_S):
    """Waits for the other rank's `publish(rdv, name, ...)` and loads it."""
    wait_for(rdv, name, timeout_s)
    return torch.load(Path(rdv.tmpdir, name), weights_only=False)


def perturb(model: torch.nn.Module, seed: int) -> None:
    """New weights, as a training step would make them (different for every seed)."""
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.03 * p.abs().mean())
