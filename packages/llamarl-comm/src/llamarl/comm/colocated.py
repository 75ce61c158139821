"""Colocated weight sync: a trainer and an engine that share one GPU share the trainer's memory.

Two processes on one GPU cannot talk NCCL to each other (a communicator refuses two ranks on one
device), and going through the host would stage the model in host memory. So the trainer exports a
handle to each tensor's memory once (``llamarl.comm.shared_memory``: CUDA IPC on a GPU, shared-memory
files on the CPU), publishes the handles through the group's store, and the engine maps that memory.
A sync is then: the trainer's writes are finished (its stream synchronized), it announces the version;
every engine reads the mapped tensors (its loader copies them into its own parameters, device to
device, or they are copied in place) and acknowledges; the trainer returns once every engine has, so
its next optimizer step never writes while an engine reads.

Store protocol (keys under the group's prefix, values JSON):

- ``colocated/tensors/{src}``: every tensor's name, shape, dtype and memory handle, published once.
- ``colocated/joined/{rank}``: a receiver mapped the tensors; the sender's constructor waits for all.
- ``colocated/count`` and ``colocated/sync/{n}``: sync ``n`` and its ``policy_version``.
- ``colocated/done/{n}/{rank}``: the receiver loaded sync ``n`` (or failed, with its error).
- ``held/{rank}``: the version each receiver holds, as with ``WeightReceiver``.

Whole tensors only (a trainer on one device; no FSDP2 shards). The GPU path has NOT RUN ON A GPU YET;
the protocol is tested across processes on the CPU with shared-memory files standing in for CUDA IPC.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Mapping, Sequence

import torch

from llamarl.comm._session import SyncStats
from llamarl.comm.layouts import named_tensors_of
from llamarl.comm.receiver import LoadFn
from llamarl.comm.shared_memory import export_tensor, import_tensor
from llamarl.comm.transport import WeightSyncError, WeightSyncGroup

__all__ = ["ColocatedReceiver", "ColocatedSender"]


def _finish_writes(tensors: Iterable[torch.Tensor]) -> None:
    """Wait until the queued kernels writing ``tensors`` are done (another process reads them next)."""
    for device in {t.device for t in tensors if t.device.type == "cuda"}:  # pragma: no cover - CUDA
        torch.cuda.current_stream(device).synchronize()


def _spec(t: torch.Tensor) -> list:
    """``[shape, dtype name]``, as it reads back from JSON."""
    return [list(t.shape), str(t.dtype).removeprefix("torch.")]


class ColocatedSender:
    """Shares the trainer's tensors with the engines of ``group`` that run on its device.

    ``named_tensors_or_module``: whole tensors (not DTensor shards), updated in place between syncs
    (their memory must stay where it is). Construction exports the handles and waits (the group's
    deadline) until every receiver (``receivers``, default: every other rank) has mapped them.
    """

    def __init__(
        self,
        group: WeightSyncGroup,
        named_tensors_or_module: torch.nn.Module | Mapping[str, torch.Tensor],
        *,
        receivers: Sequence[int] | None = None,
    ) -> None:
        from torch.distributed.tensor import DTensor

        self.group = group
        self._named = {name: t.detach() for name, t in named_tensors_of(named_tensors_or_module).items()}
        sharded = [name for name, t in self._named.items() if isinstance(t, DTensor)]
        if sharded:
            raise WeightSyncError(f"colocated sync shares whole tensors; these are DTensors: {sharded[:4]}")
        self.receivers = (
            tuple(receivers)
            if receivers is not None
            else tuple(r for r in range(group.world_size) if r != group.rank)
        )
        handles = {name: {"spec": _spec(t), "memory": export_tensor(t)} for name, t in self._named.items()}
        group.put(f"colocated/tensors/{group.rank}", handles)
        self._sync_index = group.add("colocated/count", 0)
        for r in self.receivers:
            group.get(f"colocated/joined/{r}", peer=r)
        self.policy_version: int | None = None  # the last version every receiver loaded

    def send(self, policy_version: int, *, timeout_s: float | None = None) -> SyncStats:
        """Announce the current values as ``policy_version`` and wait (``timeout_s``, default the group's)
        until every receiver has loaded them. Raises ``WeightSyncError`` naming a receiver that failed or
        missed the deadline; the tensors may be written again only after this returns or raises."""
        start = time.perf_counter()
        _finish_writes(self._named.values())
        n = self._sync_index + 1
        self.group.put(f"colocated/sync/{n}", {"policy_version": int(policy_version)})
        self.group.add("colocated/count", 1)
        self._sync_index = n
        for r in self.receivers:
            done = self.group.get(f"colocated/done/{n}/{r}", peer=r, timeout_s=timeout_s)
            self.group.delete(f"colocated/done/{n}/{r}")
            if not done["ok"]:
                raise WeightSyncError(f"rank {r} failed to load sync {n}: {done['error']}", peer=r)
        self.group.delete(f"colocated/sync/{n - 1}")  # every receiver is past it
        self.policy_version = int(policy_version)
        return SyncStats(
            seconds=time.perf_counter() - start,
            bytes=sum(t.numel() * t.element_size() for t in self._named.values()),
            buckets=len(self._named),  # one shared tensor each
            policy_version=int(policy_version),
            generation=0,  # no process group: nothing to re-form
        )

    def held_versions(self) -> dict[int, int | None]:
        """The ``policy_version`` each receiver reported after its last successful sync."""
        return {
            r: self.group.get(f"held/{r}") if self.group.store.check([f"held/{r}"]) else None
            for r in self.receivers
        }


class ColocatedReceiver:
    """Reads the weights a ``ColocatedSender`` on the same device shares, at each of its syncs.

    ``named_tensors_or_module`` says which tensors to expect (names, shapes, dtypes: the sender's must
    match exactly). Without ``load_fn`` the shared values are copied into those tensors in place; with
    it (an engine's own loader, e.g. vLLM's ``reload_weights``) they only describe what to expect (meta
    tensors are fine) and ``load_fn`` is called once per sync with ``(name, tensor)`` pairs that alias
    the trainer's memory: nothing is staged anywhere, the loader copies straight from the trainer.
    The sender is the group's ``endpoint.src_rank``. A receiver constructed after syncs already ran (a
    restarted engine) takes the next one.
    """

    def __init__(
        self,
        group: WeightSyncGroup,
        named_tensors_or_module: torch.nn.Module | Mapping[str, torch.Tensor],
        *,
        load_fn: LoadFn | None = None,
    ) -> None:
        self.group = group
        self.src_rank = src_rank = group.endpoint.src_rank
        self.load_fn = load_fn
        expected = named_tensors_of(named_tensors_or_module)
        published = group.get(f"colocated/tensors/{src_rank}", peer=src_rank)
        self._check(expected, published)
        self._shared = {name: import_tensor(published[name]["memory"]) for name in expected}
        self._dst = None if load_fn is not None else {name: t.data for name, t in expected.items()}
        self._sync_index = group.add("colocated/count", 0)
        self.policy_version: int | None = None
        group.put(f"colocated/joined/{group.rank}", True)

    def _check(self, expected: Mapping[str, torch.Tensor], published: Mapping[str, dict]) -> None:
        problems = [
            f"{name}: not shared by rank {self.src_rank}" for name in expected if name not in published
        ]
        problems += [f"{name}: shared, not expected" for name in published if name not in expected]
        problems += [
            f"{name}: shared as {published[name]['spec']}, expected {_spec(t)}"
            for name, t in expected.items()
            if name in published and published[name]["spec"] != _spec(t)
        ]
        if problems:
            raise WeightSyncError(
                f"rank {self.group.rank}: the colocated trainer's tensors do not match: {problems[:8]}",
                peer=self.src_rank,
            )

    def receive(self, timeout_s: float | None = None) -> int:
        """Wait (``timeout_s``, default the group's) for the next sync, load it, acknowledge it; returns
        its ``policy_version``. On failure the sender hears of it and ``policy_version`` is None."""
        n = self._sync_index + 1
        announced = self.group.get(f"colocated/sync/{n}", peer=self.src_rank, timeout_s=timeout_s)
        self._sync_index = n
        self.policy_version = None
        done_key = f"colocated/done/{n}/{self.group.rank}"
        try:
            if self.load_fn is not None:
                self.load_fn(iter(self._shared.items()))
            else:
                assert self._dst is not None
                for name, dst in self._dst.items():
                    dst.copy_(self._shared[name])
            _finish_writes([*self._shared.values()])  # our reads are done before the trainer writes
        except BaseException as exc:
            self.group.put(done_key, {"ok": False, "error": f"{type(exc).__name__}: {exc}"})
            raise
        self.group.put(done_key, {"ok": True})
        self.policy_version = int(announced["policy_version"])
        # Best effort: the weights are loaded, and a trainer that had every acknowledgement may be gone.
        with contextlib.suppress(Exception):
            self.group.put(f"held/{self.group.rank}", self.policy_version)
        return self.policy_version

    def close(self) -> None:
        """Unmap the trainer's memory."""
        self._shared.clear()
