"""The trainer side: ``WeightSender`` sends this rank's slices of the policy to every destination."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from llamarl.comm._session import SyncStats, _Membership
from llamarl.comm.layouts import dtype_to_str, named_tensors_of, source_layout
from llamarl.comm.plan import TransferPlan
from llamarl.comm.transport import WeightSyncGroup

__all__ = ["SyncStats", "WeightSender"]


class WeightSender:
    """Sends a model's weights, as this source rank holds them, to the destination ranks of ``group``.

    ``named_tensors_or_module``: a module (its parameters and persistent buffers; tied weights once) or
    a ``{name: tensor}`` mapping. Plain tensors are whole parameters (one trainer rank, or replicated
    over several: the plan spreads the work); FSDP2 ``DTensor`` parameters are sent from their local
    shards, each slice straight from the rank that owns it. Every ``send`` reads the tensors' current
    values, so the optimizer may update them in place between syncs (a parameter replaced by a new
    tensor object needs a new sender).

    Construction publishes this rank's layout and waits (the group's deadline) for every other rank's,
    computes the transfer plan and forms the group: construct the senders and receivers of a group at
    about the same time. ``bucket_bytes`` is the payload size of one bucket; ``wire_dtype`` (None,
    ``torch.bfloat16`` or ``torch.float8_e4m3fn``) changes precision on the wire. ``checksum`` makes
    every bucket carry a checksum the receivers verify: a sum over every ``checksum_stride``-th int64
    word (default 64: 1/8 of the memory traffic), its first word rotating with each sync so that every
    word is verified once in ``checksum_stride`` syncs (``checksum_stride=1`` sums every word).
    ``strict`` fails construction when a parameter is not wanted by any destination (a name mismatch).
    Slices of at least ``direct_min_bytes`` that are contiguous in the destination tensor are received
    in place, and sent from the source tensor's memory where they are contiguous there too.
    """

    def __init__(
        self,
        group: WeightSyncGroup,
        named_tensors_or_module: torch.nn.Module | Mapping[str, torch.Tensor],
        *,
        bucket_bytes: int = 64 << 20,
        wire_dtype: torch.dtype | None = None,
        checksum: bool = True,
        checksum_stride: int = 64,
        strict: bool = True,
        direct_min_bytes: int = 256 << 10,
    ) -> None:
        self.group = group
        self._named = named_tensors_of(named_tensors_or_module)
        layout, _ = source_layout(self._named, wire_dtype=wire_dtype)
        # Where each local shard sits in its parameter, computed once (placements do not change). The
        # shard itself is re-read at every sync (~0.5 ms for 272 DTensors): FSDP2 may swap a DTensor's
        # local tensor (its lazy init re-pads shards replaced by load_state_dict(assign=True)).
        self._offsets = {name: layout.tensors[name].offsets for name in layout.tensors}
        layout.bucket_bytes = bucket_bytes
        layout.checksum = max(1, checksum_stride) if checksum else 0
        layout.direct_min_bytes = direct_min_bytes
        self.wire_dtype = dtype_to_str(wire_dtype) if wire_dtype is not None else None
        self._membership = _Membership(group, layout, strict=strict)
        self._membership._replan()
        group.form(0)
        self.policy_version: int | None = None  # the last version sent successfully

    @property
    def plan(self) -> TransferPlan | None:
        """The transfer plan of the current group generation."""
        return self._membership.plan

    def _locals(self) -> dict[str, tuple[torch.Tensor, tuple[int, ...]]]:
        from torch.distributed.tensor import DTensor

        return {
            name: (t.to_local() if isinstance(t, DTensor) else t.detach(), self._offsets[name])
            for name, t in self._named.items()
        }

    @torch.no_grad()
    def send(self, policy_version: int) -> SyncStats:
        """Send the current weights as ``policy_version`` to every destination rank.

        Every source rank of the group calls this for each sync (the lowest one announces it); every
        receiver must call ``receive`` for it. Returns this rank's ``SyncStats``. Raises
        ``WeightSyncError`` naming the peer and bucket when a peer dies or misses the group's deadline;
        the next ``send`` then re-forms the group (waiting for restarted receivers to rejoin).
        """
        is_announcer = self.group.rank == self._membership.announcer
        stats = self._membership._sync(
            announce_version=int(policy_version) if is_announcer else None,
            timeout_s=self.group.timeout_s,
            get_locals=self._locals,
            dst_tensors=None,
        )
        self.policy_version = stats.policy_version
        return stats

    def held_versions(self) -> dict[int, int | None]:
        """The ``policy_version`` each destination rank reported after its last successful sync."""
        out: dict[int, int | None] = {}
        plan = self._membership.plan
        assert plan is not None
        for r in plan.dest_ranks:
            key = f"held/{r}"
            out[r] = self.group.get(key) if self.group.store.check([key]) else None
        return out

    def close(self) -> None:
        """Release buffers (the group is closed by its owner)."""
        self._membership.staging.clear()
