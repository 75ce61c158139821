"""What senders and receivers share: publishing layouts, planning, group generations, announcing syncs.

Store protocol (keys under the group's prefix, values JSON):

- ``layout/{rank}``: every rank's ``SourceLayout`` or ``DestLayout``; every rank reads all of them and
  computes the same plan (``plan.make_plan``), so there is no coordinator to agree with.
- ``gen/requested``: a counter; a restarted receiver bumps it to ask for a new group generation, the
  announcing source bumps it after a failed sync. ``gen/{g}/done`` marks a generation that formed: a
  receiver constructed when ``gen/0/done`` exists is rejoining, and skips syncs announced on
  generations already formed (its predecessor's), joining the next fresh one.
- ``sync/count`` and ``sync/{n}``: the announcing source (the lowest source rank) announces sync ``n``
  with the generation it runs on, its ``policy_version`` and, in a group of changed-only syncs, its
  ``delta_base``: the sync whose weights it sends the changes to (None: a full sync); everyone else
  waits for the announcement, (re)forms the group if the generation moved, then runs its part of the
  plan.
- ``held/{rank}``: the ``policy_version`` each receiver holds after its last successful sync.

Changed-only syncs (sources built with ``anchor_every`` > 0, see ``delta.py``): every rank remembers
the last sync it completed on the current generation (``held_sync``); the announcer sends a delta
against it unless the group (re)formed since (a first sync, a restarted receiver, any failure: a
failed sync abandons its generation) or an anchor is due (every ``anchor_every``-th sync is full). A
rank that does not hold the delta's base refuses the sync at once, naming itself, and abandons the
generation: the next sync is then a full one on a new generation. Rebuilt buckets are checksummed
(``_delta_transfer``), so a delta applied to other weights than the sender's is refused too.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from llamarl.comm._delta_transfer import DeltaReceive, DeltaSend, Moved
from llamarl.comm._liveness import abandoned_key
from llamarl.comm._staging import SourceLocals, StagingCache
from llamarl.comm._transfer import SyncTransfer
from llamarl.comm.layouts import DestLayout, SourceLayout
from llamarl.comm.plan import TransferPlan, make_plan
from llamarl.comm.transport import WeightSyncError, WeightSyncGroup


@dataclass(kw_only=True)
class SyncStats:
    """What one sync did on this rank."""

    seconds: float  # wall time of the sync on this rank, announcement included
    bytes: int  # bytes this rank sent (source) or received (destination): payloads, and in a group of
    # changed-only syncs each bucket's header too
    buckets: int  # buckets this rank sent or received
    policy_version: int  # the version synced
    generation: int  # group generation the sync ran on
    delta: bool = False  # only what changed since the previous sync travelled (see delta.py)
    full_bytes: int | None = None  # the payload bytes of a full sync on this rank (default: bytes)
    changed_bytes: int | None = None  # a delta sync's wire bytes whose value changed (None: a full sync)

    def __post_init__(self) -> None:
        if self.full_bytes is None:
            self.full_bytes = self.bytes


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
        self.anchor_every = 0  # the sources' setting: 0, full syncs only; k, changed-only, every k-th full
        self.held_sync: int | None = None  # the last sync completed here on this generation
        self._deltas_in_a_row = 0  # (announcer) delta syncs since the last full one
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
            (s.bucket_bytes, s.checksum, s.direct_min_bytes, s.anchor_every)
            != (first.bucket_bytes, first.checksum, first.direct_min_bytes, first.anchor_every)
            for s in sources.values()
        ):
            raise WeightSyncError(
                "source ranks disagree on bucket_bytes, checksum, direct_min_bytes or anchor_every (delta)"
            )
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
        self.anchor_every = int(first.anchor_every) if first else 0
        self.staging.clear()
        self.held_sync = None  # the shadows went with the staging: the next sync is a full one
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

    def _announce(self, policy_version: int) -> tuple[int, int, int | None]:
        """(Announcing source) pick the generation and the kind (full, or changed-only against which
        sync) of the next sync and announce them."""
        group = self.group
        if group.formed and group.store.check([abandoned_key(group.generation)]):  # type: ignore[arg-type]
            group.invalidate()  # a member failed the last sync after this rank was done with it
        requested = group.add("gen/requested", 0)
        if not group.formed or group.generation is None:
            generation = group.add("gen/requested", 1)  # after a failure: a fresh generation for all
        elif requested > group.generation:
            generation = requested  # a receiver restarted and asked for this one
        else:
            generation = group.generation
        n = self._sync_index + 1
        base = self._delta_base(generation)
        group.put(
            f"sync/{n}", {"generation": generation, "policy_version": policy_version, "delta_base": base}
        )
        group.add("sync/count", 1)
        return n, generation, base

    def _delta_base(self, generation: int) -> int | None:
        """The sync the next one can send the changes to: the last one completed here, on the same
        generation, unless an anchor (a full sync) is due. None: a full sync."""
        if not self.anchor_every or self.held_sync is None or generation != self.group.generation:
            return None
        return None if self._deltas_in_a_row + 1 >= self.anchor_every else self.held_sync

    def _await_announcement(self, timeout_s: float | None) -> tuple[int, int, int, int | None]:
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
            base = data.get("delta_base")
            return (
                n,
                int(data["generation"]),
                int(data["policy_version"]),
                None if base is None else int(base),
            )

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
            n, generation, base = self._announce(announce_version)
            policy_version = announce_version
        else:
            n, generation, policy_version, base = self._await_announcement(timeout_s)
        try:
            if generation != self.group.generation or not self.group.formed:
                self._form(generation)
            self._check_base(n, base)
            self.held_sync = None  # until this sync completes
            moved = self._transfer(n, policy_version, base, get_locals, dst_tensors)
        except BaseException as exc:
            # The group may hold half-delivered messages or dead peers: never reuse it, and tell the
            # other members, whose sends and receives of this sync would otherwise wait for ours.
            self.group.abandon(f"{type(exc).__name__}: {exc}"[:500])
            self._sync_index = n
            raise
        self._sync_index = n
        self.held_sync = n
        self._deltas_in_a_row = self._deltas_in_a_row + 1 if base is not None else 0
        return SyncStats(
            seconds=time.perf_counter() - start,
            bytes=moved.bytes,
            buckets=moved.buckets,
            policy_version=policy_version,
            generation=generation,
            delta=base is not None,
            full_bytes=moved.full_bytes,
            changed_bytes=moved.changed if base is not None else None,
        )

    def _check_base(self, n: int, base: int | None) -> None:
        """A delta sync applies to the weights of sync ``base``: refuse it unless this rank holds them."""
        if base is not None and base != self.held_sync:
            held = "none whole" if self.held_sync is None else f"those of sync {self.held_sync}"
            raise WeightSyncError(
                f"rank {self.rank}: sync {n} sends only what changed since sync {base}, but this rank holds "
                f"{held} (a sync it missed or failed); the next sync is a full one"
            )

    def _transfer(
        self,
        n: int,
        policy_version: int,
        base: int | None,
        get_locals: Callable[[], SourceLocals] | None,
        dst_tensors: dict[str, torch.Tensor] | None,
    ) -> Moved:
        """This rank's part of sync ``n``: the header-and-payload protocol in a group of changed-only
        syncs (``anchor_every``), else the full one."""
        assert self.plan is not None
        locals_ = get_locals() if get_locals is not None else None
        common = {"group": self.group, "plan": self.plan, "staging": self.staging}
        common |= {"checksum_stride": self.checksum, "sync_index": n, "policy_version": policy_version}
        if self.anchor_every:
            if locals_ is not None:
                return DeltaSend(locals_=locals_, base_sync=base, **common).run()
            assert dst_tensors is not None
            return DeltaReceive(dst_tensors=dst_tensors, base_sync=base, **common).run()
        num_bytes, num_buckets = SyncTransfer(locals_=locals_, dst_tensors=dst_tensors, **common).run()
        return Moved(bytes=num_bytes, full_bytes=num_bytes, buckets=num_buckets)
