"""``WeightSyncError``: what every failed weight sync raises, naming the peer (and bucket) to blame."""

from __future__ import annotations

__all__ = ["WeightSyncError"]


class WeightSyncError(RuntimeError):
    """A weight sync failed: a peer died or missed its deadline, a checksum or a manifest disagreed.

    ``peer`` is the group rank of the other side when one is to blame, ``bucket`` the bucket index
    (within its stream) when the failure happened in the middle of a transfer.
    """

    def __init__(self, message: str, *, peer: int | None = None, bucket: int | None = None) -> None:
        super().__init__(message)
        self.peer = peer
        self.bucket = bucket
