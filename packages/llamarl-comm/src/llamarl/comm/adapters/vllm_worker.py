"""One engine worker's end of llamarl weight syncs, as the `llamarl` vLLM weight-transfer backend drives
it (`adapters.vllm_engine`), written without vLLM: its loader is handed in.

The worker joins the trainer's weight-sync group, expects the tensors of the checkpoint it serves
(`adapters.checkpoint`: whole tensors under their HF names, as a trainer holding the HF model sends
them; vLLM's loader fuses and shards them) and takes each sync in two steps:

- `start()`: the sync is pulled into staging buffers of the worker's own, on a thread
  (`adapters.staged.StagedReceiver`), while the engine keeps generating with the weights it serves;
- `swap()`: once the pull is whole (`staged()`), the engine stops between two steps, and the loader
  copies the staged, verified tensors into the model (vLLM: `reload_weights`, which fuses, shards and
  repacks). Only this step pauses generation.

The staging is one copy of the checkpoint's tensors on the group's device (host memory over gloo, the
worker's GPU over NCCL), allocated once and kept between syncs. A colocated worker (the trainer on the
worker's GPU, `llamarl.comm.colocated`) stages nothing: its loader reads the trainer's memory, so the
whole receive is the swap.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

import torch

from llamarl.comm.adapters.checkpoint import TensorSpec
from llamarl.comm.adapters.staged import StagedReceiver
from llamarl.comm.endpoint import WeightSyncEndpoint
from llamarl.comm.errors import WeightSyncError
from llamarl.comm.receiver import LoadFn, WeightReceiver
from llamarl.comm.transport import WeightSyncGroup

__all__ = ["INITIAL_POLICY_VERSION", "WorkerWeights"]

#: The policy_version an engine reports before its first sync: it serves the checkpoint it was started
#: from, which is what the trainer starts from too.
INITIAL_POLICY_VERSION = 0


class WorkerWeights:
    """The weights one engine worker receives: joins the group `endpoint` describes (this worker's own
    rank in it), expects the tensors `specs` names, loads each sync with `load_fn` (called once per
    sync, with every tensor: vLLM's layerwise reload needs a layer's weights in one call).

    `policy_version`: the version the model serves; INITIAL_POLICY_VERSION (the checkpoint) before any
    sync, None after a failed one until the next succeeds. `last_pull_s` / `last_swap_s`: how long the
    last sync took to arrive (off the pause) and to load (the pause).
    """

    def __init__(
        self,
        endpoint: WeightSyncEndpoint,
        *,
        specs: Mapping[str, TensorSpec],
        device: torch.device,
        load_fn: LoadFn,
        colocated: bool = False,
    ) -> None:
        from llamarl.comm.colocated import ColocatedReceiver

        self.group = WeightSyncGroup(endpoint, device=device if endpoint.backend == "nccl" else None)
        self.load_fn = load_fn
        self.num_tensors = len(specs)
        self.policy_version: int | None = INITIAL_POLICY_VERSION
        self.last_pull_s: float | None = None
        self.last_swap_s: float | None = None
        self._staging: dict[str, torch.Tensor] = {}
        self._staged: StagedReceiver | None = None
        self._colocated: ColocatedReceiver | None = None
        try:
            if colocated:
                # The receiver only reads names, shapes and dtypes from these (meta: no memory).
                expected = {n: torch.empty(s.shape, dtype=s.dtype, device="meta") for n, s in specs.items()}
                self._colocated = ColocatedReceiver(self.group, expected, load_fn=load_fn)
            else:
                self._staging = {
                    n: torch.empty(s.shape, dtype=s.dtype, device=self.group.device) for n, s in specs.items()
                }
                self._staged = StagedReceiver(WeightReceiver(self.group, self._staging))
        except BaseException:
            self.group.close()
            raise

    @property
    def staging_bytes(self) -> int:
        """Bytes of the staging buffers (0 when colocated): the memory pull-before-pause costs."""
        return sum(t.numel() * t.element_size() for t in self._staging.values())

    def start(self, timeout_s: float | None = None) -> None:
        """Starts pulling the next sync into staging (the engine keeps serving); the pull waits at most
        `timeout_s` (default: the group's) for the trainer to announce it. Colocated: nothing to pull
        ahead, the swap reads the trainer's memory."""
        if self._staged is not None:
            self._staged.start(timeout_s)

    def staged(self) -> bool:
        """Whether `swap()` would find the sync whole, so pause the engine only for the load (always
        True when colocated, where nothing is pulled ahead)."""
        return self._staged is None or self._staged.done()

    def swap(self, *, timeout_s: float | None = None, expected_version: int | None = None) -> int:
        """Waits at most `timeout_s` (default: the group's) for the pull to be whole, checks its version
        against `expected_version` (when given), loads it into the model; returns the version served.

        On failure `policy_version` is None: a failed pull left the model untouched, but a failed load
        may have replaced part of it."""
        wait_s = self.group.timeout_s if timeout_s is None else timeout_s
        self.policy_version = None
        if self._colocated is not None:
            start = time.perf_counter()
            version = self._colocated.receive(wait_s)
            self.last_pull_s, self.last_swap_s = 0.0, time.perf_counter() - start
        else:
            assert self._staged is not None
            if not self._staged.pending:
                raise RuntimeError("no weight update was started: start_weight_update first")
            version = self._staged.wait(wait_s)
            self.last_pull_s = self._staged.pull_s
            if expected_version is not None and version != expected_version:
                raise WeightSyncError(
                    f"rank {self.group.rank}: the sync received is policy_version {version}, the update "
                    f"announced {expected_version}"
                )
            start = time.perf_counter()
            self.load_fn(iter(self._staging.items()))
            self.last_swap_s = time.perf_counter() - start
        self.policy_version = version
        return version

    def close(self) -> None:
        """Leaves the group and frees the staging (the loaded weights and their version stay)."""
        if self._staged is not None:
            self._staged.close()
        if self._colocated is not None:
            self._colocated.close()
        self._staging = {}
        self.group.close()
