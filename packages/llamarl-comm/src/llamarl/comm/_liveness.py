"""Telling a dead peer from a slow one, well before a wait's deadline (``WeightSyncGroup``'s helpers).

Every member beats a counter in the store from a thread of its own (``Heartbeat``: it beats while its
process computes). A wait for a peer (``PeerWatch.wait``) polls what it waits for and ends once that
peer's counter has stood still for ``dead_after_s``, or once a member marked the sync's generation
abandoned. gloo's sends and receives say they are complete only once waited on, and such a wait cannot
be cut short: a ``Waiter`` thread waits them while the rank's own thread watches the peer.
"""

from __future__ import annotations

import datetime
import json
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from llamarl.comm.endpoint import WeightSyncEndpoint
from llamarl.comm.errors import WeightSyncError

CLOSING_KEY = "heartbeat/closing"  # set by rank 0 when it closes: the store goes with it
STOPPED_KEY = "heartbeat/stopped"  # /<rank>: that member's heartbeat stopped


def td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def abandoned_key(generation: int) -> str:
    """The store key a member sets (to its reason, JSON) when a sync of ``generation`` failed."""
    return f"gen/{generation}/abandoned"


class PeerWatch:
    """Waits on something a peer does, watching the peer's heartbeat (and the generation's abandon
    mark) meanwhile; ``store`` is the group's (prefixed) store."""

    def __init__(self, store: dist.Store, endpoint: WeightSyncEndpoint) -> None:
        self.store = store
        self.rank = endpoint.rank
        self.heartbeat_s = endpoint.heartbeat_s
        self.dead_after_s = endpoint.dead_after_s

    def wait(
        self,
        done: Callable[[], bool],
        peer: int,
        timeout_s: float,
        waiting_for: str,
        *,
        generation: int | None,
        sleep: Callable[[float], Any] = time.sleep,
    ) -> None:
        """Polls ``done`` until it is true; raises ``WeightSyncError`` once ``peer``'s heartbeat has
        stood still for ``dead_after_s`` or, with ``generation``, once a member abandoned it, and
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
                if generation is not None:
                    self._raise_if_abandoned(generation, peer, waiting_for)
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

    def _raise_if_abandoned(self, generation: int, peer: int, waiting_for: str) -> None:
        key = abandoned_key(generation)
        if self.store.check([key]):
            reason = json.loads(self.store.get(key).decode())
            raise WeightSyncError(
                f"rank {self.rank}: stopped waiting for {waiting_for} (peer rank {peer}): generation "
                f"{generation} of the group was abandoned by {reason}",
                peer=peer,
            )


def let_heartbeats_stop(store: dist.Store, world_size: int, heartbeat_s: float) -> None:
    """Before the store goes away with rank 0: tells every member's heartbeat to stop and waits a
    moment for them to, so that no live member's thread meets a closed store (torch logs each such
    failure as a warning, in every run's last lines)."""
    try:
        store.set(CLOSING_KEY, "1")
        others = [f"{STOPPED_KEY}/{r}" for r in range(1, world_size)]
        give_up = time.monotonic() + 2 * heartbeat_s
        while others and not store.check(others) and time.monotonic() < give_up:
            time.sleep(0.01)
    except Exception:
        pass  # a member that is dead (or already gone) never answers: close anyway


class Waited(threading.Event):
    """A work handed to a `Waiter`: set once its wait returned; `result()` raises what the wait raised."""

    error: BaseException | None = None

    def result(self) -> None:
        if self.error is not None:
            raise self.error


class Waiter:
    """A daemon thread that waits, one after the other, the works handed to it (`wait`), each with the
    deadline given; started on first use. `retire()` lets it end after the wait in hand, which may
    block until that deadline: a group gives up on a wait by retiring its waiter for a new one."""

    def __init__(self, rank: int) -> None:
        self._rank = rank
        self._jobs: queue.SimpleQueue[tuple[Any, float, Waited] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def wait(self, work: Any, timeout_s: float) -> Waited:
        """Hands ``work`` over; returns the event set once it has been waited on."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name=f"weight-sync waiter {self._rank}", daemon=True
            )
            self._thread.start()
        waited = Waited()
        self._jobs.put((work, timeout_s, waited))
        return waited

    def retire(self) -> None:
        self._jobs.put(None)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            work, timeout_s, waited = job
            try:
                work.wait(td(timeout_s))
            except BaseException as exc:  # handed to the rank's thread, which raises it
                waited.error = exc
            waited.set()


class Heartbeat:
    """A daemon thread adding 1 to the store's ``heartbeat/<rank>`` counter every ``heartbeat_s``,
    through a store connection of its own (a TCPStore client is not shared between threads), until
    `stop()`, rank 0 closing the group, or the store going away."""

    def __init__(self, endpoint: WeightSyncEndpoint) -> None:
        client = dist.TCPStore(
            endpoint.host, endpoint.port, None, False, td(endpoint.timeout_s), wait_for_workers=False
        )
        self._store = dist.PrefixStore(f"{endpoint.prefix}/", client)
        self._rank = endpoint.rank
        self._interval_s = endpoint.heartbeat_s
        self._stopped = threading.Event()
        self._store.delete_key(f"{STOPPED_KEY}/{self._rank}")  # (left by an earlier process of this rank)
        self._store.add(f"heartbeat/{self._rank}", 1)  # beating from the start: up, not just slow
        self._thread = threading.Thread(
            target=self._run, name=f"weight-sync heartbeat {self._rank}", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stopped.wait(self._interval_s):
                if self._store.check([CLOSING_KEY]):
                    break
                self._store.add(f"heartbeat/{self._rank}", 1)
            if self._rank != 0:  # (rank 0 hosts the store and closes it right after)
                self._store.set(f"{STOPPED_KEY}/{self._rank}", "1")
        except Exception:
            return  # the store's host (rank 0) is gone: waits on it fail on their own

    def stop(self) -> None:
        """Stops beating (the thread says so in the store as it ends)."""
        self._stopped.set()
