"""The weight channel: trainer ranks -> generator ranks, shard to shard through llamarl.comm (DDMA).

Every trainer rank is a source (with FSDP2 each sends the slices its shards hold; nothing is gathered);
every generator rank, or its engine, is a destination. The group's `WeightSyncEndpoint` is built once,
here (`weight_sync_endpoint`: a port the first trainer rank picks and broadcasts, the backend, the
deadlines), and handed whole to the trainer ranks' group (`open_sender`) and to the generators
(`Generator.connect_weight_sync`). The group has a store of its own: it never depends on the default
process group, which carries only rollouts and small control messages.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from llamarl.comm import WeightSender, WeightSyncEndpoint, WeightSyncGroup, free_port

__all__ = ["FIRST_TRAINER_RANK", "open_sender", "weight_sync_endpoint"]

FIRST_TRAINER_RANK = 0  # hosts the weight-sync group's store; the source generators name


def weight_sync_endpoint(
    rank: int, world_size: int, *, backend: str, timeout_s: float, dead_after_s: float
) -> WeightSyncEndpoint | None:
    """This rank's endpoint of the weight-sync group of ranks 0 .. `world_size` - 1 (the trainers, then
    the generators), or None on a rank outside it (a reward rank). A collective over every rank of the
    default group: the first trainer rank picks the port. `backend`: the group's ("nccl" between GPUs,
    `llamarl.control.launch.devices.weight_sync_backend`); `timeout_s` bounds each step of a sync,
    `dead_after_s` a wait for a member whose heartbeat stood still."""
    # Checked free on every interface: other machines connect to it.
    port = torch.tensor([free_port("") if rank == FIRST_TRAINER_RANK else 0], dtype=torch.int64)
    dist.broadcast(port, FIRST_TRAINER_RANK)
    if rank >= world_size:
        return None
    return WeightSyncEndpoint(
        host=os.environ.get("MASTER_ADDR", "127.0.0.1"),
        port=int(port.item()),
        rank=rank,
        world_size=world_size,
        backend=backend,
        timeout_s=timeout_s,
        dead_after_s=dead_after_s,
        src_rank=FIRST_TRAINER_RANK,
    )


def open_sender(
    model: torch.nn.Module | dict[str, torch.Tensor],
    endpoint: WeightSyncEndpoint,
    *,
    bucket_mb: int,
    wire_dtype: torch.dtype | None,
    delta: bool | None = None,
) -> tuple[WeightSyncGroup, WeightSender]:
    """A trainer rank's end: joins the group `endpoint` describes as a source of `model`'s weights (its
    FSDP2 shards, if sharded), or of the tensors of a {name: tensor} mapping. On NCCL the buckets are
    packed on this rank's current GPU. `delta`: changed-only syncs (None: llamarl.comm's default, on
    for bf16 or fp8 on the wire)."""
    device = torch.device("cuda", torch.cuda.current_device()) if endpoint.backend == "nccl" else None
    group = WeightSyncGroup(endpoint, device=device)
    try:
        sender = WeightSender(group, model, bucket_bytes=bucket_mb << 20, wire_dtype=wire_dtype, delta=delta)
        return group, sender
    except BaseException:
        group.close()
        raise
