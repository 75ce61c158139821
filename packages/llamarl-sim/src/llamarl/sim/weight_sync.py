"""Weight sync time: bytes moved, the layout of the move and the bandwidth of the links it uses.

- `shard_to_shard` (DDMA, llamarl.comm): every trainer device sends its own shard straight to the
  generator devices that hold those weights; all links work at once, so the time is the larger of
  what the busiest sender sends and what each receiver receives.
- `gather_broadcast`: the trainer gathers the whole model on one device, which then sends it to every
  generator replica (a pipelined broadcast): the whole model crosses one link twice.
- `colocated_reshard`: the synchronous baseline's generator lives on the trainer's devices; each
  device gathers its tensor-parallel slice of the new weights from the FSDP shards.

Any layout can move a delta instead of the whole model (`DeltaSync`): only the weights that changed
since the generator's copy, as (index, value) pairs or a bitmap plus values, whichever is smaller,
with a full copy (an anchor) every so many syncs. The bytes follow from the change density: between
RL steps more than 98% of bf16 weights are bit-identical (the Adam update is below half an ulp; PULSE,
arXiv 2602.03839); llamarl's own measurement gives the default, 1% (see `DeltaSync.change_density`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from llamarl.sim.hardware import Efficiency, GpuSpec
from llamarl.sim.models import ModelSpec

SyncLayout = Literal["shard_to_shard", "gather_broadcast", "colocated_reshard"]


class DeltaSync(BaseModel):
    """A weight sync that sends only what changed (stated inputs; the defaults say where they come from)."""

    change_density: float = Field(
        0.01,
        ge=0,
        le=1,
        description="share of weights whose bf16 bits change between two syncs: 0.84-1.29% (mean 1.0%) per "
        "policy-gradient step at llamarl's default lr 3e-6, measured on SmolLM2-135M-Instruct (AdamW, bf16 "
        "compute, float32 masters; tools/bench_weight_sync.py --delta: 0.43-0.95% at lr 1e-6, 2.1-2.7% at "
        "1e-5; AdamW's first step, which moves every weight by about lr, 4.4-6.2%). PULSE (arXiv "
        "2602.03839) reports >98% bit-identical per RL step",
    )
    index_bytes: float = Field(4.0, gt=0, description="bytes of one changed weight's position (int32)")
    anchor_every: int = Field(
        0, ge=0, description="a full sync every this many syncs, bounding drift (0: deltas only)"
    )

    def wire_bytes_per_param(self, value_bytes: float) -> float:
        """Mean bytes per parameter on the wire: the cheaper of (index, value) pairs and a bitmap plus
        values, never more than the dense copy; anchors averaged in."""
        pairs = self.change_density * (self.index_bytes + value_bytes)
        bitmap = 1 / 8 + self.change_density * value_bytes
        delta = min(value_bytes, pairs, bitmap)
        if self.anchor_every <= 1:
            return value_bytes if self.anchor_every == 1 else delta
        return (value_bytes + (self.anchor_every - 1) * delta) / self.anchor_every


def weight_sync_s(
    layout: SyncLayout,
    model: ModelSpec,
    *,
    wire_bytes_per_param: float,
    trainer_gpus: int,
    replicas: int,
    replica_gpus: int,
    gpu: GpuSpec,
    eff: Efficiency,
    crosses_nodes: bool = True,
) -> float:
    """Seconds of one trainer -> generators weight sync.

    Args:
        wire_bytes_per_param: bytes per parameter on the wire (2: bf16).
        trainer_gpus: devices the trainer's shards are spread over.
        replicas: generator replicas that each need the whole model.
        replica_gpus: devices of one replica (each gets 1 / replica_gpus of the model).
        crosses_nodes: whether the transfer crosses nodes (network) or stays on NVLink.
    """
    model_bytes = model.params * wire_bytes_per_param
    bandwidth = gpu.link_bandwidth(crosses_nodes) * eff.link_eff
    latency = eff.p2p_latency_us * 1e-6
    if layout == "shard_to_shard":
        received = model_bytes / replica_gpus
        sent = model_bytes * replicas / trainer_gpus
        return max(received, sent) / bandwidth + latency
    if layout == "gather_broadcast":
        return 2 * model_bytes / bandwidth + 2 * latency
    if layout == "colocated_reshard":
        return model_bytes / replica_gpus / bandwidth + latency
    raise ValueError(f"unknown weight sync layout {layout!r}")
