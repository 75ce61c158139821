"""The engine side: ``WeightReceiver`` receives the policy into local tensors or an engine's loader."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping

import torch

from llamarl.comm._session import SyncStats, _Membership
from llamarl.comm.layouts import DestLayout, dtype_from_str, named_tensors_of, replicated
from llamarl.comm.plan import TransferPlan
from llamarl.comm.transport import WeightSyncError, WeightSyncGroup

__all__ = ["LoadFn", "WeightReceiver"]

logger = logging.getLogger(__name__)

# An engine's own weight loader: takes (name, tensor) pairs, e.g. vLLM's
# ``model_runner.reload_weights(weights_iterator=..., is_checkpoint_format=True)``.
LoadFn = Callable[[Iterable[tuple[str, torch.Tensor]]], None]


class WeightReceiver:
    """Receives weights from the source ranks of ``group`` into this destination rank.

    ``named_tensors_or_module``: the destination tensors by (engine) name, or a module (its parameters
    and persistent buffers). Without ``layout`` each tensor is a whole parameter under the trainer's
    name; with ``layout`` (a ``DestLayout`` built with ``tp_shard`` / ``fused`` / ``replicated``) its
    tensors may be tensor-parallel shards or fused parameters, and ``named_tensors_or_module`` must hold
    a tensor of the layout's shape under each of the layout's names.

    Without ``load_fn`` received bytes are written into those tensors in place. With ``load_fn`` (for
    engines that repack weights, e.g. vLLM's CPU backend) the tensors only describe shapes and dtypes
    (``meta`` tensors are fine): the receiver assembles each tensor in a staging buffer of its own and,
    once the whole sync is verified, calls ``load_fn`` once with an iterable of ``(name, tensor)`` pairs.

    In a group of changed-only syncs (the sender's ``delta``, on by default for bf16 or fp8 on the
    wire) a sync may carry only the bytes that changed since the last one: they are applied to the
    tensors as the last sync left them (or to ``load_fn``'s staging copies), so an engine must not
    write into them between syncs; if it does, the next delta is refused by checksum, naming the
    sender, and the sync after it is a full one. This costs no memory where the tensors hold the wire
    values exactly (the wire dtype, or bf16 into float32); with fp8 on the wire the receiver keeps a
    copy of its wire bytes (scales and values, about one byte per weight).

    The group's ``endpoint.src_rank`` must be one of the plan's sources (checked here). A receiver
    constructed after its group already ran (a restarted process with the same rank) rejoins: it asks
    for a new group generation, and the next ``send`` re-forms the group and delivers the latest weights.
    """

    def __init__(
        self,
        group: WeightSyncGroup,
        named_tensors_or_module: torch.nn.Module | Mapping[str, torch.Tensor],
        *,
        layout: DestLayout | None = None,
        load_fn: LoadFn | None = None,
        strict: bool = True,
    ) -> None:
        self.group = group
        named = named_tensors_of(named_tensors_or_module)
        self.layout = layout if layout is not None else replicated(named)
        for name, t in self.layout.tensors.items():
            have = named.get(name)
            if have is None:
                raise WeightSyncError(
                    f"rank {group.rank}: the layout names {name!r} but no such tensor was given"
                )
            if tuple(have.shape) != t.shape:
                raise WeightSyncError(
                    f"rank {group.rank}: {name} is {tuple(have.shape)}, the layout says {t.shape}"
                )
        self.load_fn = load_fn
        if load_fn is None:
            self._dst = {name: named[name].data for name in self.layout.tensors}
        else:
            self._dst = {
                name: torch.empty(t.shape, dtype=dtype_from_str(t.dtype), device=group.device)
                for name, t in self.layout.tensors.items()
            }
        self.policy_version: int | None = None  # version held; None before the first sync or after a failure
        self._membership = _Membership(group, self.layout, strict=strict)
        rejoining = group.store.check(["gen/0/done"])
        plan = self._membership._replan()
        src_rank = group.endpoint.src_rank
        if src_rank not in plan.source_ranks:
            raise WeightSyncError(
                f"rank {group.rank}: src_rank {src_rank} is not a source; sources are {plan.source_ranks}"
            )
        if rejoining:
            # Ask for a new generation; the next sync on a generation not yet formed is ours.
            self._membership.rejoining = True
            # Start from the latest announced sync: it may be the one re-forming the group for us.
            self._membership._sync_index = max(0, group.add("sync/count", 0) - 1)
            group.add("gen/requested", 1)
        else:
            group.form(0)
        self.rejoined = rejoining
        self.last_stats: SyncStats | None = None

    @property
    def plan(self) -> TransferPlan | None:
        """The transfer plan of the current group generation."""
        return self._membership.plan

    @torch.no_grad()
    def receive(self, timeout_s: float | None = None) -> int:
        """Wait for the next sync and receive it; returns its ``policy_version``.

        Waits at most ``timeout_s`` (default: the group's) for the sync to be announced, then the group's
        deadline for each bucket. Raises ``WeightSyncError`` naming the peer and bucket on a dead peer,
        a missed deadline or a checksum mismatch; the weights are then partly updated and
        ``policy_version`` is None until the next successful sync.
        """
        self.policy_version = None
        stats = self._membership._sync(
            announce_version=None,
            timeout_s=self.group.timeout_s if timeout_s is None else timeout_s,
            get_locals=None,
            dst_tensors=self._dst,
        )
        self._membership.rejoining = False  # rejoined: from now on every sync is ours
        if self.load_fn is not None:
            self.load_fn(iter(self._dst.items()))
        self.policy_version = stats.policy_version
        self.last_stats = stats
        try:
            self.group.put(f"held/{self.group.rank}", stats.policy_version)
        except Exception as exc:  # the weights arrived; a trainer that already left hosts no store
            logger.warning(
                "rank %d: could not report held version %d: %s", self.group.rank, stats.policy_version, exc
            )
        return stats.policy_version

    def close(self) -> None:
        """Release buffers (the group is closed by its owner); a later sync would be a full one."""
        self._membership.staging.clear()
        self._membership.held_sync = None  # (the shadows went with the buffers)
