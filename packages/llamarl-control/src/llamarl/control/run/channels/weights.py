"""The weight channel: trainer ranks -> generator ranks, shard to shard through llamarl.comm (DDMA).

Every trainer rank is a source (with FSDP2 each sends the slices its shards hold; nothing is gathered);
every generator rank, or its engine, is a destination. The group has a store of its own on a port the
first trainer rank picks and broadcasts: it never depends on the default process group, which carries
only rollouts and small control messages.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from llamarl.comm import WeightSender, WeightSyncGroup, free_port
from llamarl.exec.types import Generator

__all__ = ["WeightChannelAddress", "connect_generator", "open_sender", "weight_channel_address"]

FIRST_TRAINER_RANK = 0  # hosts the weight-sync group's store


@dataclass(frozen=True)
class WeightChannelAddress:
    """Where this rank meets the weight-sync group."""

    host: str  # the first trainer rank's address (the group's store)
    port: int
    rank: int  # this rank (the same as in the default group)
    world_size: int
    backend: str = "gloo"  # "nccl" between GPUs (llamarl.control.launch.devices.weight_sync_backend)


def weight_channel_address(rank: int, world_size: int, backend: str = "gloo") -> WeightChannelAddress:
    """Where the weight-sync group meets: a port chosen by the first trainer rank (a collective over
    every rank of the default group), and the group's backend (every rank must give the same)."""
    # Checked free on every interface: other machines connect to it.
    port = torch.tensor([free_port("") if rank == FIRST_TRAINER_RANK else 0], dtype=torch.int64)
    dist.broadcast(port, FIRST_TRAINER_RANK)
    return WeightChannelAddress(
        host=os.environ.get("MASTER_ADDR", "127.0.0.1"),
        port=int(port.item()),
        rank=rank,
        world_size=world_size,
        backend=backend,
    )


def open_sender(
    model: torch.nn.Module | dict[str, torch.Tensor],
    address: WeightChannelAddress,
    *,
    timeout_s: float,
    dead_after_s: float,
    bucket_mb: int,
    wire_dtype: torch.dtype | None,
) -> tuple[WeightSyncGroup, WeightSender]:
    """A trainer rank's end: joins the group as a source of `model`'s weights (its FSDP2 shards, if
    sharded), or of the tensors of a {name: tensor} mapping. `timeout_s` bounds each step of a sync,
    `dead_after_s` a wait for a generator whose heartbeat stood still. On NCCL the buckets are packed on
    this rank's current GPU."""
    device = torch.device("cuda", torch.cuda.current_device()) if address.backend == "nccl" else None
    group = WeightSyncGroup(**asdict(address), timeout_s=timeout_s, dead_after_s=dead_after_s, device=device)
    try:
        return group, WeightSender(group, model, bucket_bytes=bucket_mb << 20, wire_dtype=wire_dtype)
    except BaseException:
        group.close()
        raise


def connect_generator(
    generator: Generator, address: WeightChannelAddress, *, timeout_s: float, dead_after_s: float
) -> None:
    """A generator rank's end: the generator (or its engine) joins the group and receives straight from
    the trainer ranks from then on (`generator.receive_weights`). `dead_after_s`: as `open_sender`'s,
    for a wait on a trainer rank."""
    generator.connect_weight_sync(
        **asdict(address), timeout_s=timeout_s, dead_after_s=dead_after_s, src_rank=FIRST_TRAINER_RANK
    )
