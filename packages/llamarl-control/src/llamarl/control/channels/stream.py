"""The stream-mode channel: generators send finished groups to the first trainer rank while they sample
the next ones, and every rank reads the run's few shared counters from the launcher's key-value store.

- `StreamControl`: weight syncs announced (every generator takes part in each), the stop, requests for
  the weights again (a replaced engine, a failed sync). Cheap reads, polled between decoding steps.
- `RolloutOutbox`: a generator's sending side; a thread sends while the generator samples on, and a
  full trainer buffer holds the generator back (back-pressure) while it can still take new weights.
- `drain_into_buffer`: the trainer's receiving side of one generator's stream, into the
  `RolloutBuffer` (`llamarl.control.channels.buffer`).

Each takes its transport as a small object or callable, so tests run both ends in one process.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Protocol

from llamarl.control.channels.buffer import BufferClosed, RolloutBuffer
from llamarl.exec.types import RolloutBatch

__all__ = ["KeyValueStore", "RolloutOutbox", "StreamControl", "drain_into_buffer"]


class KeyValueStore(Protocol):
    """The part of torch.distributed.Store that `StreamControl` uses."""

    def set(self, key: str, value: str | bytes) -> None: ...

    def get(self, key: str) -> bytes: ...

    def check(self, keys: list[str]) -> bool: ...

    def add(self, key: str, amount: int) -> int: ...


class StreamControl:
    """Counters every rank reads through a key-value store: how many weight syncs the trainer started
    (every generator takes part in each), whether the run is over, and how many times a generator
    asked for the current weights again (its engine was replaced, or a sync failed half-way).
    Generators poll them between decoding steps, so the reads must be cheap."""

    _SYNCS = "stream/syncs_announced"
    _STOP = "stream/stop"
    _WANTED = "stream/weights_wanted"

    def __init__(self, store: KeyValueStore) -> None:
        self.store = store

    def announce(self) -> int:
        """Trainer: a weight sync starts now; every generator should take part. Returns its number."""
        return self.store.add(self._SYNCS, 1)

    def announced(self) -> int:
        """How many weight syncs were announced (0 before any)."""
        return self.store.add(self._SYNCS, 0)

    def stop(self) -> None:
        self.store.set(self._STOP, "1")

    def want_weights(self) -> None:
        """Generator: a restarted engine holds no synced weights; asks the trainer to send them again."""
        self.store.add(self._WANTED, 1)

    def weights_wanted(self) -> int:
        """How many times generators asked for the current weights again (cumulative)."""
        return self.store.add(self._WANTED, 0)

    def stopped(self) -> bool:
        return self.store.check([self._STOP])


class RolloutOutbox:
    """A generator's sending side in stream mode: a thread sends finished batches while the generator
    samples the next one. `put` waits while one batch is already queued (back-pressure from a full
    trainer buffer), calling `while_waiting` so the generator can still take new weights meanwhile."""

    def __init__(self, send: Callable[[RolloutBatch | None, dict[str, float]], None], *, timeout_s: float):
        self._send = send
        self.timeout_s = timeout_s
        self._queue: queue.Queue[tuple[RolloutBatch | None, dict[str, float]]] = queue.Queue(maxsize=1)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="rollout-outbox", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            batch, metrics = self._queue.get()
            try:
                self._send(batch, metrics)
            except BaseException as e:  # re-raised in the generator's thread by put/close
                self._error = e
                return
            if batch is None:
                return

    def put(
        self, batch: RolloutBatch, metrics: dict[str, float], *, while_waiting: Callable[[], None]
    ) -> None:
        """Queues `batch` for sending; returns once queued. Raises the sender thread's error."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            self._raise_error()
            try:
                self._queue.put((batch, metrics), timeout=0.05)
                return
            except queue.Full:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the trainer took no rollouts for {self.timeout_s:.0f} s") from None
                while_waiting()

    def close(self, metrics: dict[str, float]) -> None:
        """Sends the end of the stream (with the final totals) after what is queued, and waits for it."""
        self._raise_error()
        self._queue.put((None, metrics), timeout=self.timeout_s)
        self._thread.join(self.timeout_s)
        if self._thread.is_alive():
            raise TimeoutError("the end of the rollout stream was not delivered in time")
        self._raise_error()

    def _raise_error(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"sending rollouts failed: {self._error}") from self._error


def drain_into_buffer(
    buffer: RolloutBuffer,
    receive: Callable[[], tuple[RolloutBatch | None, dict[str, float]]],
    on_metrics: Callable[[dict[str, float]], None],
    *,
    timeout_s: float,
) -> int:
    """Trainer side of one generator's stream: receive batches into `buffer` until its end marker.

    Batches arriving after the buffer closed (the run is over) are received and discarded, so the
    generator's sending thread never blocks. Returns the number of batches discarded.
    """
    discarded = 0
    while True:
        batch, metrics = receive()
        on_metrics(metrics)
        if batch is None:
            return discarded
        try:
            buffer.put(batch, timeout_s=timeout_s)
        except BufferClosed:
            discarded += 1
