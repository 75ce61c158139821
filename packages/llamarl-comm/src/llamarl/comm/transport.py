"""The weight-sync process group: its own store, its own gloo (or NCCL) group, deadlines everywhere.

``WeightSyncGroup`` never calls ``torch.distributed.init_process_group`` and never touches torch's
default group, so it can live inside an inference engine (or a trainer) that owns its own. Rank 0 hosts
a ``TCPStore``; the store carries the layouts every rank publishes, the per-sync announcements and the
rejoin requests, and each *generation* of the group builds a fresh ``ProcessGroupGloo`` under its own
store prefix. A receiver that restarts asks for a new generation; every member moves to it at the start
of the next sync (see ``sender.py`` / ``receiver.py``).

Every wait takes a deadline and raises ``WeightSyncError`` naming the peer (and the bucket), so a dead
or stuck peer is an error, never a hang. A dead peer is told from a slow one well before that deadline:
every member beats a counter in the store from a thread of its own (it beats while its process
computes), and a wait for a peer, through the store or (on NCCL) for a send or receive, ends once that
peer's counter has stood still for ``dead_after_s``. A member whose sync fails marks the group's
generation abandoned in the store, so the other members' NCCL sends and receives of that sync end too,
at once, instead of at their deadline (NCCL, unlike gloo, never fails a transfer whose peer died).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import socket
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from llamarl.comm._liveness import Heartbeat, PeerWatch, Waiter, abandoned_key, let_heartbeats_stop, td
from llamarl.comm.endpoint import DEAD_AFTER_S, WeightSyncEndpoint
from llamarl.comm.errors import WeightSyncError

__all__ = ["DEAD_AFTER_S", "ProcessGroupFactory", "WeightSyncError", "WeightSyncGroup", "free_port"]

# Builds a generation's process group: (store, rank, world_size, timeout) -> an object with torch's
# ``send([t], peer, tag)`` / ``recv([t], peer, tag)`` returning works with ``wait(timeout)``.
ProcessGroupFactory = Callable[[dist.Store, int, int, datetime.timedelta], Any]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago (the OS picks it; never a fixed port): where a
    ``WeightSyncGroup``'s store (or any rendezvous) can listen."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class WeightSyncGroup:
    """A private process group for weight sync: the member ``endpoint`` describes (where the group meets,
    this member's rank, the backend, the deadlines: ``llamarl.comm.WeightSyncEndpoint``).

    Rank 0 hosts the ``TCPStore`` (it must outlive the others: put it on the trainer). On ``"nccl"`` the
    tensors are CUDA tensors on ``device`` (default: the current CUDA device), on ``"gloo"`` CPU ones.
    The sync protocol never relies on message tags and posts the messages of each pair of ranks in the
    same order on both sides (what NCCL needs); its small control messages go through the store. On
    NCCL a work's deadline counts from when it was posted, not from the wait (torch's
    ``WorkNCCL.wait(timeout)``): keep ``endpoint.timeout_s`` above the length of a whole sync.

    ``process_group_factory`` replaces the backend's process group (tests run the protocol over
    ``llamarl.comm.testing.nccl_rules_process_group``: gloo under NCCL's ordering rules).

    Every member beats a counter in the store every ``endpoint.heartbeat_s`` seconds (a daemon thread
    with its own store connection). A wait for a peer's control message (`get` with ``peer``) fails once
    that peer has beaten and then stood still for ``endpoint.dead_after_s``; a peer never seen beating
    is waited for up to the deadline, as is a live one. On NCCL (and the stand-in), a send or receive
    (`wait`) ends the same way, or once a member has `abandon`-ed the generation: it is polled
    (``is_completed``), never waited on with a short timeout, which may break the pair. gloo's say they
    are complete only once waited on and such a wait cannot be cut short: a thread of the group's waits
    them (``_liveness.Waiter``) while the rank's own watches the heartbeat the same way (measured here:
    a SmolLM2 sync 0.09 -> 0.10 s).
    """

    def __init__(
        self,
        endpoint: WeightSyncEndpoint,
        *,
        device: torch.device | str | None = None,
        process_group_factory: ProcessGroupFactory | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.process_group_factory = process_group_factory
        self.device = torch.device(
            device if device is not None else ("cuda" if self.backend == "nccl" else "cpu")
        )
        rank = endpoint.rank
        try:
            # world_size=None: nobody waits for a head count, so a restarted rank can connect later.
            self._tcp_store = dist.TCPStore(
                endpoint.host, endpoint.port, None, rank == 0, td(self.timeout_s), wait_for_workers=False
            )
        except Exception as exc:
            what = "host" if rank == 0 else "reach"
            raise WeightSyncError(
                f"rank {rank} could not {what} the weight-sync store at {endpoint.host}:{endpoint.port} "
                f"within {self.timeout_s}s: {exc}",
                peer=None if rank == 0 else 0,
            ) from exc
        self.store = dist.PrefixStore(f"{endpoint.prefix}/", self._tcp_store)
        self.generation: int | None = None
        self._pg: Any = None
        self._watch = PeerWatch(self.store, endpoint)
        self._heartbeat = Heartbeat(endpoint)
        self._waiter = Waiter(rank)

    @property
    def rank(self) -> int:
        """This member's rank in the group."""
        return self.endpoint.rank

    @property
    def world_size(self) -> int:
        return self.endpoint.world_size

    @property
    def backend(self) -> str:
        return self.endpoint.backend

    @property
    def timeout_s(self) -> float:
        """The deadline of every single wait."""
        return self.endpoint.timeout_s

    # ----------------------------------------------------------------------------------------------
    # Group generations

    def form(self, generation: int) -> None:
        """(Re)build the process group for ``generation``; every rank must call this with the same value.

        Blocks until all ``world_size`` ranks have joined, at most ``timeout_s``; on timeout the error
        names the ranks that never arrived.
        """
        if self.generation == generation and self._pg is not None:
            return
        self._pg = None  # drop the old generation first: its peers may be gone
        self.store.set(f"gen/{generation}/member/{self.rank}", "1")
        pg_store = dist.PrefixStore(f"gen/{generation}/pg/", self.store)
        try:
            self._pg = self._new_process_group(pg_store)
        except Exception as exc:
            missing = [
                r for r in range(self.world_size) if not self.store.check([f"gen/{generation}/member/{r}"])
            ]
            raise WeightSyncError(
                f"rank {self.rank} could not form weight-sync group generation {generation} within "
                f"{self.timeout_s}s; ranks that never joined: {missing or 'none (connection failed)'}: {exc}",
                peer=missing[0] if missing else None,
            ) from exc
        self.generation = generation
        self.store.set(f"gen/{generation}/done", "1")

    def _new_process_group(self, pg_store: dist.Store) -> Any:
        timeout = td(self.timeout_s)
        if self.process_group_factory is not None:
            return self.process_group_factory(pg_store, self.rank, self.world_size, timeout)
        if self.backend == "gloo":
            return dist.ProcessGroupGloo(pg_store, self.rank, self.world_size, timeout)
        opts = dist.ProcessGroupNCCL.Options()  # pragma: no cover - needs CUDA
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(pg_store, self.rank, self.world_size, opts)

    @property
    def formed(self) -> bool:
        """Whether a process group of some generation is up."""
        return self._pg is not None

    def invalidate(self) -> None:
        """Forget the current generation after a failure; the next sync re-forms the group."""
        pg, self._pg, self.generation = self._pg, None, None
        # A wait given up on may still block the waiter's thread (until gloo's deadline): the next
        # generation's waits go to a thread of their own.
        self._waiter.retire()
        self._waiter = Waiter(self.rank)
        abort = getattr(pg, "abort", None)
        if abort is not None:
            # NCCL: ends the failed sync's sends and receives still queued on the GPU, which would
            # otherwise wait there for a dead peer until the watchdog's deadline (gloo's is a no-op).
            with contextlib.suppress(Exception):
                abort()

    def abandon(self, reason: str) -> None:
        """Marks the current generation failed (``reason``) for every member, whose sends and receives
        in it then end at once with that reason, and forgets it (`invalidate`)."""
        if self.generation is not None and self.store is not None:
            reason = json.dumps(f"rank {self.rank}: {reason}")
            with contextlib.suppress(Exception):  # the store's host may be what failed
                # The first reason stays: the members that fail after it fail because of it.
                self.store.compare_set(abandoned_key(self.generation), "", reason)
        self.invalidate()

    # ----------------------------------------------------------------------------------------------
    # Point to point

    def send(self, tensor: torch.Tensor, dst: int, tag: int, *, bucket: int | None = None) -> Any:
        """Start sending a contiguous ``tensor`` to ``dst``; returns the torch ``Work`` to ``wait`` on."""
        return self._start("send", tensor, dst, tag, bucket)

    def recv(self, tensor: torch.Tensor, src: int, tag: int, *, bucket: int | None = None) -> Any:
        """Start receiving into a contiguous ``tensor`` from ``src``; returns the torch ``Work``."""
        return self._start("recv", tensor, src, tag, bucket)

    def _start(self, op: str, tensor: torch.Tensor, peer: int, tag: int, bucket: int | None) -> Any:
        if self._pg is None:
            raise WeightSyncError(f"rank {self.rank}: weight-sync group not formed", peer=peer, bucket=bucket)
        try:
            return getattr(self._pg, op)([tensor], peer, tag)
        except Exception as exc:  # gloo raises at once when the pair to a dead peer is closed
            where = f" (bucket {bucket})" if bucket is not None else ""
            raise WeightSyncError(
                f"rank {self.rank}: could not {op} weights with peer rank {peer}{where}: {exc}",
                peer=peer,
                bucket=bucket,
            ) from exc

    def broadcast(self, tensor: torch.Tensor, root: int) -> Any:
        """Start a broadcast of ``tensor`` from ``root`` over the whole group (used by the benchmark)."""
        assert self._pg is not None, "weight-sync group not formed"
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        opts.rootTensor = 0
        return self._pg.broadcast([tensor], opts)

    def wait(self, work: Any, *, peer: int, what: str, bucket: int | None = None) -> None:
        """Wait for ``work`` (a send or receive with ``peer``) at most ``timeout_s``, less if ``peer``'s
        heartbeat stands still for ``dead_after_s`` or a member abandons the generation; raise
        ``WeightSyncError`` naming ``peer`` (and ``bucket``) when it does not complete."""
        where = f" (bucket {bucket})" if bucket is not None else ""
        waiting_for = f"{what}{where} to complete"
        try:
            if peer == self.rank:
                work.wait(td(self.timeout_s))
            elif isinstance(self._pg, dist.ProcessGroupGloo):
                # gloo's sends and receives say they are complete only once waited on, and such a wait
                # cannot be cut short (gloo fails it at once only when the peer's socket closes): the
                # waiter's thread waits, this one watches the peer's heartbeat meanwhile.
                waited = self._waiter.wait(work, self.timeout_s)
                self._watch.wait(
                    waited.is_set, peer, self.timeout_s, waiting_for, generation=self.generation,
                    sleep=waited.wait,
                )  # fmt: skip
                waited.result()
            else:
                self._watch.wait(
                    work.is_completed, peer, self.timeout_s, waiting_for, generation=self.generation
                )
                work.wait(td(self.timeout_s))  # complete by now: raises its error, orders NCCL's stream
        except WeightSyncError:
            raise
        except Exception as exc:
            raise WeightSyncError(
                f"rank {self.rank}: {what} with peer rank {peer}{where} failed or missed its "
                f"{self.timeout_s}s deadline: {exc}",
                peer=peer,
                bucket=bucket,
            ) from exc

    # ----------------------------------------------------------------------------------------------
    # Small control messages through the store (JSON, never pickle: peers need not trust each other's
    # Python objects)

    def put(self, key: str, value: Any) -> None:
        """Publish ``value`` (JSON-serialisable) under ``key``."""
        self.store.set(key, json.dumps(value))

    def get(
        self, key: str, *, peer: int | None = None, timeout_s: float | None = None, in_sync: bool = False
    ) -> Any:
        """Wait (at most ``timeout_s``, default the group's) for ``key`` and return its JSON value; with
        ``peer``, less once its heartbeat stood still, and ``in_sync`` (a message of the current
        generation's sync), once a member abandoned the generation."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        try:
            if peer is None or peer == self.rank:
                self.store.wait([key], td(timeout))
            else:
                store = self.store
                self._watch.wait(
                    lambda: store.check([key]), peer, timeout, f"it to publish {key!r}",
                    generation=self.generation if in_sync else None,
                )  # fmt: skip
            raw = self.store.get(key)
        except WeightSyncError:
            raise
        except Exception as exc:
            who = f"peer rank {peer}" if peer is not None else "a peer"
            raise WeightSyncError(
                f"rank {self.rank}: waited {timeout}s for {who} to publish {key!r}: {exc}", peer=peer
            ) from exc
        return json.loads(raw.decode())

    def delete(self, key: str) -> None:
        """Remove ``key`` (no error when it is absent)."""
        self.store.delete_key(key)

    def add(self, key: str, amount: int) -> int:
        """Atomically add ``amount`` to the integer counter ``key`` and return the new value."""
        return int(self.store.add(key, amount))

    def close(self) -> None:
        """Drop the process group and the store connection (rank 0 stops hosting the store)."""
        if self.store is None:
            return
        self._heartbeat.stop()
        self._waiter.retire()
        if self.rank == 0:
            let_heartbeats_stop(self.store, self.world_size, self.endpoint.heartbeat_s)
        self._pg = None
        self.generation = None
        self.store = None  # type: ignore[assignment]
        self._tcp_store = None

    def __repr__(self) -> str:
        return (
            f"WeightSyncGroup(rank={self.rank}, world_size={self.world_size}, backend={self.backend!r}, "
            f"generation={self.generation})"
        )
