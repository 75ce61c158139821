"""The trainer side: ``WeightSender`` sends this rank's slices of the policy to every destination."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from llamarl.comm._session import SyncStats, _Membership
from llamarl.comm.layouts import dtype_to_str, named_tensors_of, source_layout
from llamarl.comm.plan import TransferPlan
from llamarl.comm.transport import WeightSyncGroup

__all__ = ["ANCHOR_EVERY", "SyncStats", "WeightSender", "narrow_on_the_wire"]

# A full sync every this many syncs in a group of changed-only syncs (see WeightSender's doc).
ANCHOR_EVERY = 64


def narrow_on_the_wire(named: Mapping[str, torch.Tensor], wire_dtype: torch.dtype | None) -> bool:
    """Whether most of the floating-point bytes travel as values of 2 bytes or fewer (cast to
    ``wire_dtype``, or held so): where changed-only syncs pay off."""
    if wire_dtype is not None:
        return wire_dtype.itemsize <= 2
    narrow = wide = 0
    for t in named.values():
        if t.is_floating_point():
            nbytes = t.numel() * t.element_size()
            narrow, wide = (narrow + nbytes, wide) if t.element_size() <= 2 else (narrow, wide + nbytes)
    return narrow > wide


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

    ``delta``: changed-only syncs (``llamarl.comm.delta``): after a full sync, each bucket travels as
    only the bytes whose wire value changed since the previous sync, which the receivers apply to
    the weights they hold, bit for bit, and verify by checksum. A full sync runs first on every group
    generation (the first sync, after a receiver restarted or any sync failed) and every
    ``anchor_every``-th sync. None (the default) turns it on where values travel in 2 bytes or fewer
    (a ``wire_dtype``, or bf16 / fp16 weights): there most of them keep their wire value from one RL
    step to the next (SmolLM2-135M at lr 3e-6: 0.8-1.3% of bf16 values change per step, a delta is
    1.4-2.1% of a full sync's bytes), while a float32 value changes at almost every step. Memory:
    every source keeps a copy of the wire bytes it sent last (its shadow: as many bytes as it sends
    per full sync, ``plan.bytes_sent_by()[rank]``); a receiver keeps none where its tensors hold the
    wire values exactly (in place, or ``load_fn``'s staging, in the wire dtype or a wider float),
    else (fp8 on the wire) a copy of its own wire bytes (scales and values: ~1 byte per weight).
    ``SyncStats`` says what travelled (``delta``, ``bytes``, ``full_bytes``, ``changed_bytes``).
    ``anchor_every`` (default 64) bounds how long a wrong byte could be served unnoticed to the
    period over which the rotating checksum reads every word once (``checksum_stride``, 64), at a
    cost of 1/64 of a full sync per sync, about one measured delta's worth.
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
        delta: bool | None = None,
        anchor_every: int = ANCHOR_EVERY,
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
        if anchor_every < 1:
            raise ValueError(f"anchor_every must be at least 1, got {anchor_every}")
        self.delta = narrow_on_the_wire(self._named, wire_dtype) if delta is None else bool(delta)
        layout.anchor_every = anchor_every if self.delta else 0
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
        """Release buffers (the group is closed by its owner); a later sync would be a full one."""
        self._membership.staging.clear()
        self._membership.held_sync = None  # (the shadows went with the buffers)
