"""llamarl.comm as a vLLM weight-transfer backend: `WeightTransferConfig(backend="llamarl")`.

vLLM (0.32) has a pluggable weight-transfer system: one `WeightTransferEngine` per worker, a trainer-side
engine, registries that map a backend name to each (`WeightTransferEngineFactory`,
`WeightTransferTrainerFactory`), and four phases driven from the trainer (offline through `LLM`
methods, online through `vllm serve`'s HTTP routes `/init_weight_transfer_engine`,
`/start_weight_update`, `/update_weights`, `/finish_weight_update`). This package registers itself
there as `llamarl` through vLLM's plugin entry points (`vllm.general_plugins`: `register` below, run by
vLLM in every process it starts), so with llamarl-comm installed beside vLLM nothing else is needed:

    vllm serve MODEL --weight-transfer-config '{"backend": "llamarl"}'     # (+ VLLM_SERVER_DEV_MODE=1)
    LLM(model=MODEL, weight_transfer_config=WeightTransferConfig(backend="llamarl"))

- Worker side: `adapters.vllm_engine.LlamarlWeightTransferEngine` (`adapters.vllm_worker` does the work).
- Trainer side, any PyTorch trainer, with or without vLLM installed: `adapters.vllm_trainer`
  (`LlamarlTrainerWeightTransferEngine`; `HTTPWeightSyncClient` for a running `vllm serve`).
  A complete example: `examples/vllm_weight_update/` at the repository's root.
- Offline drivers (an `LLM` in this process): `init_weight_transfer` and `sync_weights` below.

What it adds over vLLM's built-in backends (nccl broadcasts every parameter whole from trainer rank 0 to
every worker, ipc maps a colocated trainer's memory, m2n reshards DTensor layouts): each slice goes
straight from the trainer rank that owns it to the worker that needs it (FSDP2 shards never gathered,
replicas served by a relay chain), in buckets that each carry a checksum and the policy_version, every
wait has a deadline and names the peer it waits for, a restarted engine rejoins the same group, and
gloo works as well as NCCL. And pull before pause: `start_weight_update` only starts the transfer, into
staging buffers on a thread of each worker, while the engine keeps generating; `update_weights` is the
swap (vLLM's reload of the staged, verified tensors), the only part that stops generation. The staging
is one copy of the checkpoint's tensors per worker, on the group's device, kept between syncs.

Workers receive whole tensors under the checkpoint's (HF) names, read from the safetensors headers of
the folder the engine serves: what a trainer holding the HF model sends; vLLM's loader fuses q/k/v and
gate/up and cuts tensor-parallel shards. The destination dtypes are the checkpoint's: a float32 trainer
for a bfloat16 checkpoint sends with `wire_dtype=torch.bfloat16` (the plan refuses a silent cast).

What vLLM's API does not cover stays in a worker extension (`WORKER_EXTENSION_CLS`): the policy_version
each worker serves as a number (None after a failed update; vLLM's engine-wide version is a string the
trainer sets), and whether a started update is whole (`weights_staged`), which a driver that steps
the engine itself polls to pause only once the bytes are in (llamarl's own vLLM generator does).

Neither CUDA path has run on a GPU yet (NCCL between processes with different torch builds; CUDA IPC
for a colocated trainer: `init_info={"colocated": true}`); on the CPU the NCCL message order is tested
with the NCCL-rules transport (`llamarl.comm.testing`).

This module imports without vLLM: `register` imports vLLM's registries when vLLM calls it.
"""

from __future__ import annotations

from typing import Any

from llamarl.comm.adapters.vllm_trainer import BACKEND
from llamarl.comm.adapters.vllm_worker import INITIAL_POLICY_VERSION
from llamarl.comm.endpoint import WeightSyncEndpoint

__all__ = [
    "BACKEND",
    "INITIAL_POLICY_VERSION",
    "WORKER_EXTENSION_CLS",
    "WeightSyncWorkerExtension",
    "init_weight_transfer",
    "register",
    "reset_prefix_cache_or_raise",
    "served_version",
    "staged",
    "sync_weights",
]

#: The value to pass as `LLM(..., worker_extension_cls=...)` (vLLM resolves it by qualified name).
WORKER_EXTENSION_CLS = "llamarl.comm.adapters.vllm.WeightSyncWorkerExtension"


def register() -> None:
    """vLLM's plugin hook (entry point `vllm.general_plugins: llamarl`): registers the `llamarl` backend
    with vLLM's worker-side and trainer-side factories, by module path (imported when first used).
    vLLM may run plugins more than once per process: a second call changes nothing."""
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    module = "llamarl.comm.adapters"
    for factory, where, cls in (
        (WeightTransferEngineFactory, f"{module}.vllm_engine", "LlamarlWeightTransferEngine"),
        (WeightTransferTrainerFactory, f"{module}.vllm_trainer", "LlamarlTrainerWeightTransferEngine"),
    ):
        if BACKEND not in factory._registry:  # (register_engine refuses a name twice)
            factory.register_engine(BACKEND, where, cls)


class WeightSyncWorkerExtension:
    """Mixed into vLLM's worker class (`worker_extension_cls=WORKER_EXTENSION_CLS`): what the native
    weight-transfer API does not answer, callable as `LLM.collective_rpc(name)`. vLLM refuses an
    extension whose attribute names clash with the worker's, hence these two methods only. `self` is
    the vLLM worker; `self.weight_transfer_engine` its backend (the llamarl one, or None)."""

    def weight_version(self) -> int | None:
        """The policy_version this worker serves: INITIAL_POLICY_VERSION (its checkpoint) before any
        update, None after a failed one."""
        engine = getattr(self, "weight_transfer_engine", None)
        return INITIAL_POLICY_VERSION if engine is None else engine.policy_version

    def weights_staged(self) -> bool:
        """Whether the update started on this worker is whole: `update_weights` would only load it."""
        return bool(self.weight_transfer_engine.staged())  # type: ignore[attr-defined]


def init_weight_transfer(
    llm: Any,
    endpoint: WeightSyncEndpoint,
    *,
    colocated: bool = False,
    announce_timeout_s: float | None = None,
) -> None:
    """Offline driver: every worker of `llm` (a `vllm.LLM` built with the llamarl backend) joins the
    group as `endpoint` describes (the first worker's member). Blocks until the trainer's senders are
    built too (run them concurrently). `announce_timeout_s`: how long each started update waits for the
    trainer's send (default: the endpoint's timeout_s)."""
    init_info = {
        "endpoint": endpoint.to_json(),
        "colocated": colocated,
        "announce_timeout_s": announce_timeout_s,
    }
    llm.init_weight_transfer_engine({"init_info": init_info})


def sync_weights(
    llm: Any, *, timeout_s: float | None = None, started: bool = False, reset_prefix_cache: bool = True
) -> int:
    """Offline driver of one update: start (unless `started`), update (wait at most `timeout_s` for the
    pull, then load), finish with the version, reset the prefix cache (unless `reset_prefix_cache` is
    False: the caller owes it, e.g. with requests in flight, where vLLM refuses it). Returns the
    policy_version now served; raises if the workers disagree or vLLM refuses the reset (stale KV
    would be served).

    Blocks until the trainer sends: run it concurrently with the trainer's `send`."""
    if not started:
        llm.start_weight_update()
    llm.update_weights({"update_info": {"timeout_s": timeout_s}})
    version = served_version(llm)
    if version is None:
        raise RuntimeError("the engine's workers report no policy_version after an update")
    llm.finish_weight_update(weight_version=str(version))
    if reset_prefix_cache:
        reset_prefix_cache_or_raise(llm, version)
    return version


def reset_prefix_cache_or_raise(llm: Any, version: int) -> None:
    """Drops `llm`'s prefix cache after `version` was loaded; raises RuntimeError if vLLM refuses."""
    # Cached KV blocks were computed with the old weights: a prompt sharing a prefix with an earlier one
    # would otherwise be continued from stale keys and values. vLLM refuses (False) while requests run.
    if llm.reset_prefix_cache() is False:
        raise RuntimeError(
            f"vLLM refused to reset its prefix cache after loading policy_version {version} "
            "(requests still running?): its cached KV was computed with the old weights"
        )


def served_version(llm: Any) -> int | None:
    """The policy_version every worker of `llm` serves (`WeightSyncWorkerExtension.weight_version`);
    raises RuntimeError when they disagree."""
    versions = set(llm.collective_rpc("weight_version"))
    if len(versions) != 1:
        raise RuntimeError(f"engine workers serve different policy versions: {sorted(versions, key=str)}")
    return versions.pop()


def staged(llm: Any) -> bool:
    """Whether the update started is whole on every worker of `llm` (the swap would not wait)."""
    return all(llm.collective_rpc("weights_staged"))
