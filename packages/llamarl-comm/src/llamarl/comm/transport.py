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
import queue
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


# Seconds a member's heartbeat may stand still before it counts as gone: the default of every group,
# and of the settings that reach one (`dead_after_s` of the generators and of llamarl's run config).
DEAD_AFTER_S = 10.0


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
    the deadline, as is a live one. On NCCL (and the stand-in), a send or receive (`wait`) ends the same
    way, or once a member has `abandon`-ed the generation: it is polled (``is_completed``), never waited
    on with a short timeout, which may break the pair. gloo's say they are complete only once waited on
    and such a wait cannot be cut short: a thread of the group's waits them (``_Waiter``) while the
    rank's own watches the heartbeat the same way (measured here: a SmolLM2 sync 0.09 -> 0.10 s).
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
        dead_after_s: float = DEAD_AFTER_S,
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
        self._waiter = _Waiter(rank)

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
        pg, self._pg, self.generation = self._pg, None, None
        # A wait given up on may still block the waiter's thread (until gloo's deadline): the next
        # generation's waits go to a thread of their own.
        self._waiter.retire()
        self._waiter = _Waiter(self.rank)
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
                self.store.compare_set(f"gen/{self.generation}/abandoned", "", reason)
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
                work.wait(_td(self.timeout_s))
            elif isinstance(self._pg, dist.ProcessGroupGloo):
                # gloo's sends and receives say they are complete only once waited on, and such a wait
                # cannot be cut short (gloo fails it at once only when the peer's socket closes): the
                # waiter's thread waits, this one watches the peer's heartbeat meanwhile.
                waited = self._waiter.wait(work, self.timeout_s)
                self._wait_while_beating(
                    waited.is_set, peer, self.timeout_s, waiting_for, in_sync=True, sleep=waited.wait
                )
                waited.result()
            else:
                self._wait_while_beating(work.is_completed, peer, self.timeout_s, waiting_for, in_sync=True)
                work.wait(_td(self.timeout_s))  # complete by now: raises its error, orders NCCL's stream
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
                self.store.wait([key], _td(timeout))
            else:
                store = self.store
                self._wait_while_beating(
                    lambda: store.check([key]), peer, timeout, f"it to publish {key!r}", in_sync=in_sync
                )
            raw = self.store.get(key)
        except WeightSyncError:
            raise
        except Exception as exc:
            who = f"peer rank {peer}" if peer is not None else "a peer"
            raise WeightSyncError(
                f"rank {self.rank}: waited {timeout}s for {who} to publish {key!r}: {exc}", peer=peer
            ) from exc
        return json.loads(raw.decode())

    def _wait_while_beating(
        self,
        done: Callable[[], bool],
        peer: int,
        timeout_s: float,
        waiting_for: str,
        *,
        in_sync: bool,
        sleep: Callable[[float], Any] = time.sleep,
    ) -> None:
        """Polls ``done`` until it is true; raises ``WeightSyncError`` once ``peer``'s heartbeat has
        stood still for ``dead_after_s`` or, ``in_sync``, once a member abandoned the generation, and
        ``TimeoutError`` after ``timeout_s``. Polled, not waited with short timeouts: torch logs every
        expired store wait as a warning, and a timed-out wait on a send or receive may break its pair.
        ``sleep(seconds)`` pauses between two looks (an event's ``wait`` ends the pause when it is set)."""
        start = time.monotonic()
        deadline = start + timeout_s
        beats, still_since, next_look = 0, start, start + self.heartbeat_s
        while not done():
            now = time.monotonic()
            if now >= deadline:
                raise TimeoutError(f"{waiting_for} did not happen within {timeout_s}s")
            if now >= next_look:
                next_look = now + self.heartbeat_s
                if in_sync:
                    self._raise_if_abandoned(peer, waiting_for)
                seen = self.store.add(f"heartbeat/{peer}", 0)  # adding 0 reads the counter, no wait
                if seen != beats:
                    beats, still_since = seen, now
                elif beats and now - still_since >= self.dead_after_s:
                    raise WeightSyncError(
                        f"rank {self.rank}: peer rank {peer} is gone: its heartbeat stopped "
                        f"{now - still_since:.0f}s ago (dead_after_s={self.dead_after_s}) while rank "
                        f"{self.rank} waited for {waiting_for}",
                        peer=peer,
                    )
            # A twentieth of the time waited so far (50 us to 10 ms): a wait overshoots what it waits
            # for by at most 5% (a sync's many short waits stay short), a long one polls 100 times a second.
            sleep(min(max((now - start) / 20, 5e-5), 0.01, max(deadline - now, 0.0)))

    def _raise_if_abandoned(self, peer: int, waiting_for: str) -> None:
        if self.generation is None:
            return
        key = f"gen/{self.generation}/abandoned"
        if self.store.check([key]):
            reason = json.loads(self.store.get(key).decode())
            raise WeightSyncError(
                f"rank {self.rank}: stopped waiting for {waiting_for} (peer rank {peer}): generation "
                f"{self.generation} of the group was abandoned by {reason}",
                peer=peer,
            )

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


class _Waited(threading.Event):
    """A work handed to a `_Waiter`: set once its wait returned; `result()` raises what the wait raised."""

    error: BaseException | None = None

    def result(self) -> None:
        if self.error is not None:
            raise self.error


class _Waiter:
    """A daemon thread that waits, one after the other, the works handed to it (`wait`), each with the
    deadline given; started on first use. `retire()` lets it end after the wait in hand, which may
    block until that deadline: a group gives up on a wait by retiring its waiter for a new one."""

    def __init__(self, rank: int) -> None:
        self._rank = rank
        self._jobs: queue.SimpleQueue[tuple[Any, float, _Waited] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def wait(self, work: Any, timeout_s: float) -> _Waited:
        """Hands ``work`` over; returns the event set once it has been waited on."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name=f"weight-sync waiter {self._rank}", daemon=True
            )
            self._thread.start()
        waited = _Waited()
        self._jobs.put((work, timeout_s, waited))
        return waited

    def retire(self) -> None:
        self._jobs.put(None)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            work, timeout_s, waited = job
            try:
                work.wait(_td(timeout_s))
            except BaseException as exc:  # handed to the rank's thread, which raises it
                waited.error = exc
            waited.set()


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
