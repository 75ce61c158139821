"""The weight-sync process group: its own store, its own gloo (or NCCL) group, deadlines everywhere.

``WeightSyncGroup`` never calls ``torch.distributed.init_process_group`` and never touches torch's
default group, so it can live inside an inference engine (or a trainer) that owns its own. Rank 0 hosts
a ``TCPStore``; the store carries the layouts every rank publishes, the per-sync announcements and the
rejoin requests, and each *generation* of the group builds a fresh ``ProcessGroupGloo`` under its own
store prefix. A receiver that restarts asks for a new generation; every member moves to it at the start
of the next sync (see ``sender.py`` / ``receiver.py``).

Every wait takes a deadline and raises ``WeightSyncError`` naming the peer (and the bucket), so a dead
or stuck peer is an error, never a hang. A dead peer is told from a slow one well before that deadline
while it is awaited through the store (a receiver that died between syncs never says it is ready): every
member beats a counter in the store from a thread of its own, and such a wait ends once the peer's
counter has stood still for ``dead_after_s`` (the thread beats while its process computes).
"""

from __future__ import annotations

import datetime
import json
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["ProcessGroupFactory", "WeightSyncError", "WeightSyncGroup", "free_port"]

# Builds a generation's process group: (store, rank, world_size, timeout) -> an object with torch's
# ``send([t], peer, tag)`` / ``recv([t], peer, tag)`` returning works with ``wait(timeout)``.
ProcessGroupFactory = Callable[[dist.Store, int, int, datetime.timedelta], Any]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago (the OS picks it; never a fixed port): where a
    ``WeightSyncGroup``'s store (or any rendezvous) can listen."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class WeightSyncError(RuntimeError):
    """A weight sync failed: a peer died or missed its deadline, a checksum or a manifest disagreed.

    ``peer`` is the group rank of the other side when one is to blame, ``bucket`` the bucket index
    (within its stream) when the failure happened in the middle of a transfer.
    """

    def __init__(self, message: str, *, peer: int | None = None, bucket: int | None = None) -> None:
        super().__init__(message)
        self.peer = peer
        self.bucket = bucket


_CLOSING_KEY = "heartbeat/closing"  # set by rank 0 when it closes: the store goes with it
_STOPPED_KEY = "heartbeat/stopped"  # /<rank>: that member's heartbeat stopped


def _td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


class WeightSyncGroup:
    """A private process group for weight sync: ``world_size`` ranks meeting at ``host:port``.

    Rank 0 hosts the ``TCPStore`` (it must outlive the others: put it on the trainer). ``timeout_s`` is
    the deadline of every single wait: connecting, forming the group, each bucket. ``backend`` is
    ``"gloo"`` (CPU tensors) or ``"nccl"`` (CUDA tensors on ``device``). The sync protocol never relies
    on message tags and posts the messages of each pair of ranks in the same order on both sides (what
    NCCL needs); its small control messages go through the store. On NCCL a work's deadline counts from
    when it was posted, not from the wait (torch's ``WorkNCCL.wait(timeout)``): keep ``timeout_s`` above
    the length of a whole sync.

    ``process_group_factory`` replaces the backend's process group (tests run the protocol over
    ``llamarl.comm.testing.nccl_rules_process_group``: gloo under NCCL's ordering rules).

    Every member beats a counter in the store every ``heartbeat_s`` seconds (a daemon thread with its own
    store connection). A wait for a peer's control message (`get` with ``peer``) fails once that peer
    has beaten and then stood still for ``dead_after_s``; a peer never seen beating is waited for up to
    the deadline, as is a live one. Transfers keep their single deadline: a timed-out wait on a send or
    receive may break the pair, so it cannot be sliced to look at heartbeats in between.
    """

    def __init__(
        self,
        *,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        timeout_s: float = 60.0,
        backend: str = "gloo",
        device: torch.device | str | None = None,
        prefix: str = "llamarl-wsync",
        process_group_factory: ProcessGroupFactory | None = None,
        heartbeat_s: float = 1.0,
        dead_after_s: float = 10.0,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a group of world_size {world_size}")
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        self.host = host
        self.port = port
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.backend = backend
        self.process_group_factory = process_group_factory
        self.device = torch.device(device if device is not None else ("cuda" if backend == "nccl" else "cpu"))
        try:
            # world_size=None: nobody waits for a head count, so a restarted rank can connect later.
            self._tcp_store = dist.TCPStore(
                host, port, None, rank == 0, _td(timeout_s), wait_for_workers=False
            )
        except Exception as exc:
            what = "host" if rank == 0 else "reach"
            raise WeightSyncError(
                f"rank {rank} could not {what} the weight-sync store at {host}:{port} "
                f"within {timeout_s}s: {exc}",
                peer=None if rank == 0 else 0,
            ) from exc
        self.store = dist.PrefixStore(f"{prefix}/", self._tcp_store)
        self.generation: int | None = None
        self._pg: Any = None
        self.heartbeat_s = heartbeat_s
        self.dead_after_s = dead_after_s
        self._heartbeat = _Heartbeat(host, port, prefix, rank, heartbeat_s, timeout_s)

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
            if self.process_group_factory is not None:
                pg = self.process_group_factory(pg_store, self.rank, self.world_size, _td(self.timeout_s))
            elif self.backend == "gloo":
                pg = dist.ProcessGroupGloo(pg_store, self.rank, self.world_size, _td(self.timeout_s))
            else:  # pragma: no cover - needs CUDA
                opts = dist.ProcessGroupNCCL.Options()
                opts._timeout = _td(self.timeout_s)
                pg = dist.ProcessGroupNCCL(pg_store, self.rank, self.world_size, opts)
        except Exception as exc:
            missing = [
                r for r in range(self.world_size) if not self.store.check([f"gen/{generation}/member/{r}"])
            ]
            raise WeightSyncError(
                f"rank {self.rank} could not form weight-sync group generation {generation} within "
                f"{self.timeout_s}s; ranks that never joined: {missing or 'none (connection failed)'}: {exc}",
                peer=missing[0] if missing else None,
            ) from exc
        self._pg = pg
        self.generation = generation
        self.store.set(f"gen/{generation}/done", "1")

    @property
    def formed(self) -> bool:
        """Whether a process group of some generation is up."""
        return self._pg is not None

    def invalidate(self) -> None:
        """Forget the current generation after a failure; the next sync re-forms the group."""
        self._pg = None
        self.generation = None

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
        """Wait for ``work`` at most ``timeout_s``; raise ``WeightSyncError`` naming ``peer`` otherwise."""
        try:
            work.wait(_td(self.timeout_s))
        except Exception as exc:
            where = f" (bucket {bucket})" if bucket is not None else ""
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

    def get(self, key: str, *, peer: int | None = None, timeout_s: float | None = None) -> Any:
        """Wait (at most ``timeout_s``, default the group's) for ``key`` and return its JSON value."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        try:
            if peer is None or peer == self.rank:
                self.store.wait([key], _td(timeout))
            else:
                self._wait_while_beating(key, peer, timeout)
            raw = self.store.get(key)
        except WeightSyncError:
            raise
        except Exception as exc:
            who = f"peer rank {peer}" if peer is not None else "a peer"
            raise WeightSyncError(
                f"rank {self.rank}: waited {timeout}s for {who} to publish {key!r}: {exc}", peer=peer
            ) from exc
        return json.loads(raw.decode())

    def _wait_while_beating(self, key: str, peer: int, timeout_s: float) -> None:
        """Waits for ``key``, raising as soon as ``peer``'s heartbeat has stood still for ``dead_after_s``.

        Polls (`check`, at most 10 ms apart: a sync's handshake must not wait long) instead of a store
        wait with a short timeout, which torch logs as a warning each time it expires."""
        deadline = time.monotonic() + timeout_s
        beats, still_since, next_look = 0, time.monotonic(), time.monotonic() + self.heartbeat_s
        pause = 0.001
        while not self.store.check([key]):
            now = time.monotonic()
            if now >= deadline:
                raise TimeoutError(f"{key!r} was not set within {timeout_s}s")
            if now >= next_look:
                next_look = now + self.heartbeat_s
                seen = self.store.add(f"heartbeat/{peer}", 0)  # adding 0 reads the counter, no wait
                if seen != beats:
                    beats, still_since = seen, now
                elif beats and now - still_since >= self.dead_after_s:
                    raise WeightSyncError(
                        f"rank {self.rank}: peer rank {peer} is gone: its heartbeat stopped "
                        f"{now - still_since:.0f}s ago (dead_after_s={self.dead_after_s}) while rank "
                        f"{self.rank} waited for it to publish {key!r}",
                        peer=peer,
                    )
            time.sleep(min(pause, max(deadline - now, 0.0)))
            pause = min(2 * pause, 0.01)

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
        if self.rank == 0:
            self._let_heartbeats_stop()
        self._pg = None
        self.generation = None
        self.store = None  # type: ignore[assignment]
        self._tcp_store = None

    def _let_heartbeats_stop(self) -> None:
        """Before the store goes away with rank 0: tells every member's heartbeat to stop and waits a
        moment for them to, so that no live member's thread meets a closed store (torch logs each such
        failure as a warning, in every run's last lines)."""
        try:
            self.store.set(_CLOSING_KEY, "1")
            others = [f"{_STOPPED_KEY}/{r}" for r in range(1, self.world_size)]
            give_up = time.monotonic() + 2 * self.heartbeat_s
            while others and not self.store.check(others) and time.monotonic() < give_up:
                time.sleep(0.01)
        except Exception:
            pass  # a member that is dead (or already gone) never answers: close anyway

    def __repr__(self) -> str:
        return (
            f"WeightSyncGroup(rank={self.rank}, world_size={self.world_size}, backend={self.backend!r}, "
            f"generation={self.generation})"
        )


class _Heartbeat:
    """A daemon thread adding 1 to the store's ``heartbeat/<rank>`` counter every ``interval_s``,
    through a store connection of its own (a TCPStore client is not shared between threads), until
    `stop()`, rank 0 closing the group, or the store going away."""

    def __init__(
        self, host: str, port: int, prefix: str, rank: int, interval_s: float, timeout_s: float
    ) -> None:
        client = dist.TCPStore(host, port, None, False, _td(timeout_s), wait_for_workers=False)
        self._store = dist.PrefixStore(f"{prefix}/", client)
        self._rank = rank
        self._interval_s = interval_s
        self._stopped = threading.Event()
        self._store.delete_key(f"{_STOPPED_KEY}/{rank}")  # (left by an earlier process of this rank)
        self._store.add(f"heartbeat/{rank}", 1)  # beating from the start: up, not just slow
        self._thread = threading.Thread(target=self._run, name=f"weight-sync heartbeat {rank}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stopped.wait(self._interval_s):
                if self._store.check([_CLOSING_KEY]):
                    break
                self._store.add(f"heartbeat/{self._rank}", 1)
            if self._rank != 0:  # (rank 0 hosts the store and closes it right after)
                self._store.set(f"{_STOPPED_KEY}/{self._rank}", "1")
        except Exception:
            return  # the store's host (rank 0) is gone: waits on it fail on their own

    def stop(self) -> None:
        """Stops beating (the thread says so in the store as it ends)."""
        self._stopped.set()
