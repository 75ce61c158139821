"""What a rank's part of one sync holds, in a group of full syncs (``_transfer.SyncTransfer``) or of
changed-only ones (``_delta_transfer``): ``SyncPart``."""

from __future__ import annotations

from typing import Any

import torch

from llamarl.comm._lanes import Message, PairOrder, plan_lanes
from llamarl.comm._staging import StagingCache
from llamarl.comm.buckets import Checksummer
from llamarl.comm.plan import TransferPlan
from llamarl.comm.transport import WeightSyncError, WeightSyncGroup


class SyncPart:
    """What a rank's part of one sync holds, in a group of full syncs or changed-only ones: its group,
    plan and staging, the sync's ids, its messages' order on each pair (``delta``: each bucket a header
    then a payload, see ``_lanes.plan_lanes``), and checksums with their views cached."""

    def __init__(
        self,
        *,
        group: WeightSyncGroup,
        plan: TransferPlan,
        staging: StagingCache,
        checksum_stride: int,
        sync_index: int,
        policy_version: int,
        delta: bool,
    ) -> None:
        self.group = group
        self.rank = group.rank
        self.plan = plan
        self.staging = staging
        self.checksum_stride = checksum_stride  # 0: checksums off
        self.sync_index = sync_index
        self.policy_version = policy_version
        lanes = staging.views.get(("lanes", delta))
        if lanes is None:
            lanes = staging.views[("lanes", delta)] = plan_lanes(plan, self.rank, delta=delta)
        self.pairs = PairOrder(group, lanes, sync_index=sync_index, receive_target=self._receive_target)

    def _receive_target(self, msg: Message) -> Any:
        """Where a receive from upstream lands (see ``_lanes.ReceiveTarget``)."""
        raise WeightSyncError(f"rank {self.rank}: nothing is received here ({msg})")

    def _checksum(
        self, cache: dict[Any, Any], key: tuple[Any, ...], payload: torch.Tensor
    ) -> torch.Tensor | None:
        """The checksum of ``payload`` at this sync's phase (0-d; None with checksums off), its views
        cached in ``cache`` under ``key``."""
        # Taken right after a payload was written or read (sent, packed, received) while its bytes are
        # still in cache: later, summing a spot-check stride reads DRAM as much as a copy does.
        if not self.checksum_stride:
            return None
        summer = cache.get(key)
        if summer is None:
            summer = cache[key] = Checksummer(payload, self.checksum_stride)
        return summer(self.sync_index)
