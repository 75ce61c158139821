"""Where a member joins a weight-sync group: ``WeightSyncEndpoint``, one value with all of it.

Built once by whoever starts the members (llamarl's controller, a test, another inference stack) and
handed whole to each member: ``WeightSyncGroup(endpoint)`` on a trainer rank, a generator's
``connect_weight_sync(endpoint)``, an engine's worker (across a process boundary as JSON: ``to_json`` /
``from_json``). The members of one group hold equal endpoints but for ``rank`` (``for_rank``). Plain
Python, no torch: it travels to processes that build their group from it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

__all__ = ["BACKENDS", "DEAD_AFTER_S", "WeightSyncEndpoint"]

# Seconds a member's heartbeat may stand still before it counts as gone: the default of every endpoint,
# and of the settings that lead to one (llamarl's run config).
DEAD_AFTER_S = 10.0

#: The process-group backends a group runs on: gloo (CPU tensors) or NCCL (CUDA tensors).
BACKENDS = ("gloo", "nccl")


@dataclass(frozen=True, kw_only=True)
class WeightSyncEndpoint:
    """Everything a member needs to join a weight-sync group, and nothing that is only its own (its
    device, a test's transport: arguments of ``WeightSyncGroup``).

    ``host``/``port``: where the group's store listens; rank 0 hosts it (put a trainer rank there, it
    must outlive the others). ``rank``: this member's rank, of ``world_size``. ``backend``: ``"gloo"``
    or ``"nccl"``, the same for every member. ``timeout_s``: the deadline of every single wait
    (connecting, forming the group, each bucket; on NCCL keep it above a whole sync). ``dead_after_s``:
    a wait for a peer ends once that peer's heartbeat has stood still this long; ``heartbeat_s``: how
    often each member beats. ``src_rank``: the source rank a receiver expects among the plan's sources
    (the trainer rank whose tensors a colocated receiver maps). ``prefix``: the store prefix of the
    group's keys.
    """

    host: str
    port: int
    rank: int
    world_size: int
    backend: str = "gloo"
    timeout_s: float = 60.0
    dead_after_s: float = DEAD_AFTER_S
    heartbeat_s: float = 1.0
    src_rank: int = 0
    prefix: str = "llamarl-wsync"

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside a group of world_size {self.world_size}")
        if not 0 <= self.src_rank < self.world_size:
            raise ValueError(f"src_rank {self.src_rank} is outside a group of world_size {self.world_size}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        for name in ("timeout_s", "dead_after_s", "heartbeat_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    def for_rank(self, rank: int) -> WeightSyncEndpoint:
        """The same group seen by member ``rank`` (e.g. worker i of an engine whose first worker is
        ``self.rank`` joins as ``self.rank + i``)."""
        return replace(self, rank=rank)

    def to_json(self) -> dict[str, Any]:
        """A JSON-serialisable dict (what crosses a process boundary); ``from_json`` reads it back."""
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> WeightSyncEndpoint:
        """The endpoint ``to_json`` wrote; raises ValueError naming a field it does not know."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown weight-sync endpoint fields {unknown}; known: {sorted(known)}")
        return cls(**data)
