"""What senders and receivers share: publishing layouts, planning, group generations, announcing syncs.

Store protocol (keys under the group's prefix, values JSON):

- ``layout/{rank}``: every rank's ``SourceLayout`` or ``DestLayout``; every rank reads all of them and
  computes the same plan (``plan.make_plan``), so there is no coordinator to agree with.
- ``gen/requested``: a counter; a restarted receiver bumps it to ask for a new group generation, the
  announcing source bumps it after a failed sync. ``gen/{g}/done`` marks a generation that formed: a
  receiver constructed when ``gen/0/done`` exists is rejoining, and skips syncs announced on
  generations already formed (its predecessor's), joining the next fresh one.
- ``sync/count`` and ``sync/{n}``: the announcing source (the lowest source rank) announces sync ``n``
  with the generation it runs on and its ``policy_version``; everyone else waits for the announcement,
  (re)forms the group if the generation moved, then runs its part of the plan.
- ``held/{rank}``: the ``policy_version`` each receiver holds after its last successful sync.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from llamarl.comm._staging import SourceLocals, StagingCache
from llamarl.comm._transfer import SyncTransfer
from llamarl.comm.layouts import DestLayout, SourceLayout
from llamarl.comm.plan import TransferPlan, make_plan
from llamarl.comm.transport import WeightSyncError, WeightSyncGroup


@dataclass(kw_only=True)
class SyncStats:
    """What one sync did on this rank."""

    seconds: float  # wall time of the sync on this rank, announcement included
    bytes: int  # payload bytes this rank sent (source) or received (destination)
    buckets: int  # buckets this rank sent or received
    policy_version: int  # the version synced
    generation: int  # group generation the sync ran on


class _Membership:
    """A rank's membership in a weight-sync group: its layout, the plan, the generation, the sync count."""

    def __init__(self, group: WeightSyncGroup, layout: SourceLayout | DestLayout, *, strict: bool) -> None:
        self.group = group
        self.rank = group.rank
        self.layout = layout
        self.strict = strict
        self.plan: TransferPlan | None = None
        self._sync_index = 0  # index of the last sync this rank took part in (or skipped)
        self.rejoining = False  # a restarted receiver skips syncs on generations formed without it
        self.staging = StagingCache(self.rank, group.device)
        group.put(f"layout/{self.rank}", layout.to_json())

    # ----------------------------------------------------------------------------------------------

    def _read_layouts(self) -> tuple[dict[int, SourceLayout], dict[int, DestLayout]]:
        sources: dict[int, SourceLayout] = {}
        dests: dict[int, DestLayout] = {}
        for r in range(self.group.world_size):
            data = self.group.get(f"layout/{r}", peer=r)
            if data["role"] == "source":
                sources[r] = SourceLayout.from_json(data)
            else:
                dests[r] = DestLayout.from_json(data)
        return sources, dests

    def _replan(self) -> TransferPlan:
        sources, dests = self._read_layouts()
        first = sources[min(sources)] if sources else None
        if first is not None and any(
            (s.bucket_bytes, s.checksum, s.direct_min_bytes)
            != (first.bucket_bytes, first.checksum, first.direct_min_bytes)
            for s in sources.values()
        ):
            raise WeightSyncError("source ranks disagree on bucket_bytes, checksum or direct_min_bytes")
        try:
            self.plan = make_plan(
                sources,
                dests,
                bucket_bytes=first.bucket_bytes if first else 64 << 20,
                strict=self.strict,
                direct_min_bytes=first.direct_min_bytes if first else 256 << 10,
            )
        except ValueError as exc:
            raise WeightSyncError(f"rank {self.rank}: weight layouts do not match: {exc}") from exc
        self.checksum = int(first.checksum) if first else 1
        self.staging.clear()
        return self.plan

    def _form(self, generation: int) -> None:
        """Move to ``generation``: re-read every layout (a rejoined rank republished its own) and form."""
        self._replan()
        self.group.form(generation)

    @property
    def announcer(self) -> int:
        assert self.plan is not None
        return min(self.plan.source_ranks)

    # ----------------------------------------------------------------------------------------------
    # Announcements

    def _announce(self, policy_version: int) -> tuple[int, int]:
        """(Announcing source) pick the generation for the next sync and announce it."""
        group = self.group
        requested = group.add("gen/requested", 0)
        if not group.formed or group.generation is None:
            generation = group.add("gen/requested", 1)  # after a failure: a fresh generation for all
        elif requested > group.generation:
            generation = requested  # a receiver restarted and asked for this one
        else:
            generation = group.generation
        n = self._sync_index + 1
        group.put(f"sync/{n}", {"generation": generation, "policy_version": policy_version})
        group.add("sync/count", 1)
        return n, generation

    def _await_announcement(self, timeout_s: float | None) -> tuple[int, int, int]:
        """(Everyone else) wait for the next announced sync this rank should take part in."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            n = self._sync_index + 1
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            data = self.group.get(f"sync/{n}", peer=self.announcer_hint(), timeout_s=remaining)
            if self.rejoining and self.group.store.check([f"gen/{data['generation']}/done"]):
                # A generation formed before this process existed (with our dead predecessor): the
                # sender fails that sync without us and moves to a new generation, which we join.
                self._sync_index = n
                continue
            return n, int(data["generation"]), int(data["policy_version"])

    def announcer_hint(self) -> int | None:
        return self.announcer if self.plan is not None else None

    def _sync(
        self,
        *,
        announce_version: int | None,
        timeout_s: float | None,
        get_locals: Callable[[], SourceLocals] | None,
        dst_tensors: dict[str, torch.Tensor] | None,
    ) -> SyncStats:
        start = time.perf_counter()
        if announce_version is not None:
            n, generation = self._announce(announce_version)
            policy_version = announce_version
        else:
            n, generation, policy_version = self._await_announcement(timeout_s)
        try:
            if generation != self.group.generation or not self.group.formed:
                self._form(generation)
            assert self.plan is not None
            transfer = SyncTransfer(
                group=self.group,
                plan=self.plan,
                staging=self.staging,
                checksum_stride=self.checksum,
                sync_index=n,
                policy_version=policy_version,
                locals_=get_locals() if get_locals is not None else None,
                dst_tensors=dst_tensors,
            )
            num_bytes, num_buckets = transfer.run()
        except BaseException as exc:
            # The group may hold half-delivered messages or dead peers: never reuse it, and tell the
            # other members, whose sends and receives of this sync would otherwise wait for ours.
            self.group.abandon(f"{type(exc).__name__}: {exc}"[:500])
            self._sync_index = n
            raise
        self._sync_index = n
        return SyncStats(
            seconds=time.perf_counter() - start,
            bytes=num_bytes,
            buckets=num_buckets,
            policy_version=policy_version,
            generation=generation,
        )
