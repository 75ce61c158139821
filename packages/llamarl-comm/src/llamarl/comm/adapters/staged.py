"""Pull before pause: receive a sync into staging on a thread while the engine keeps serving, and pause
the engine only to swap the staged weights in.

An engine that receives a sync into the weights it serves must stop serving for the whole transfer:
its forward passes would read half-written tensors. prime-rl measured that pause at 5.2 s of an 8.6 s
update at scale, once the transfer itself was fast. `StagedReceiver` takes the transfer off the pause:
`start()` runs `WeightReceiver.receive()` on a thread of its own, into the receiver's destination
tensors (the *staging*, which the engine does not serve from), while the engine keeps generating with
its live weights; once `done()`, the engine swaps at a moment of its choosing (between two decoding
steps) and `wait()` hands it the verified version. What the swap is belongs to the engine: vLLM's
loader copies and repacks the staged tensors into its own (`adapters.vllm_worker`), the hf generator
exchanges tensor storage (`llamarl.exec.generate.hf_weights`).

Memory: the staging is one more copy of the tensors the receiver delivers (the receiver's
destination), kept between syncs; nothing else is allocated per sync. The staging always holds the
last sync received, whole, which is what a receiver of changed-only syncs needs its destination to hold.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from llamarl.comm.errors import WeightSyncError
from llamarl.comm.receiver import WeightReceiver

__all__ = ["StagedReceiver"]


class StagedReceiver:
    """Runs `receiver.receive()` on a thread of its own, one sync at a time, into the receiver's own
    destination tensors (the staging).

    The engine calls `start()` when the trainer is about to send (or any time before: the pull waits for
    the announcement), keeps serving while `done()` is False, and calls `wait()` once it is ready to
    swap: that returns the sync's policy_version, or raises what the pull raised. `pull_s` is how long
    the last pull took from `start()` to whole (the part of a sync the engine did not pause for).
    `after_pull`, when given, runs on the pull's thread once a sync is whole: what the engine derives
    from the staged tensors (its kernel layouts) is prepared there too, off the pause.
    """

    def __init__(self, receiver: WeightReceiver, *, after_pull: Callable[[], None] | None = None) -> None:
        self.receiver = receiver
        self.after_pull = after_pull
        self.pull_s: float | None = None
        self._thread: threading.Thread | None = None
        self._result: int | None = None
        self._error: BaseException | None = None
        self._started_at = 0.0

    @property
    def pending(self) -> bool:
        """A pull was started and its outcome not yet taken by `wait()`."""
        return self._thread is not None

    def start(self, timeout_s: float | None = None) -> None:
        """Starts pulling the next sync into the staging; waits at most `timeout_s` (default: the
        group's) for the trainer to announce it.

        A pull still running (its `wait()` gave up on it) is the pull of the next sync already: it is
        kept. One that ended without being taken is dropped: a failure is stale, and a sync received
        is superseded by the next one, which lands on top of it in the same staging."""
        if self._thread is not None and self._thread.is_alive():
            return
        self._thread, self._result, self._error, self.pull_s = None, None, None, None
        self._started_at = time.perf_counter()
        self._thread = threading.Thread(
            target=self._pull,
            args=(timeout_s,),
            name=f"llamarl-pull-rank{self.receiver.group.rank}",
            daemon=True,
        )
        self._thread.start()

    def _pull(self, timeout_s: float | None) -> None:
        try:
            version = self.receiver.receive(timeout_s)
            if self.after_pull is not None:
                self.after_pull()
            self._result = version
        except BaseException as exc:  # handed to the engine's thread by wait()
            self._error = exc
        finally:
            self.pull_s = time.perf_counter() - self._started_at

    def done(self) -> bool:
        """Whether the pending pull has ended (whole, or failed); False when none is pending."""
        return self._thread is not None and not self._thread.is_alive()

    def wait(self, timeout_s: float) -> int:
        """Waits at most `timeout_s` for the pending pull to end; returns its policy_version (the staging
        holds that sync, verified) or raises its error. Either way the pull is no longer pending.

        The pull's own waits have the group's deadlines, so `timeout_s` only bounds a pull that outlives
        them; raises WeightSyncError naming the trainer's rank when it does."""
        thread = self._thread
        if thread is None:
            raise RuntimeError("no staged pull is pending: start() one first")
        thread.join(timeout_s)
        if thread.is_alive():
            src = self.receiver.group.endpoint.src_rank
            raise WeightSyncError(
                f"rank {self.receiver.group.rank}: the staged pull of a sync from rank {src} did not end "
                f"within {timeout_s:.0f} s"
            )
        self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        assert self._result is not None
        return self._result

    def close(self, timeout_s: float = 5.0) -> None:
        """Releases the receiver's buffers; a pull still running is left to its own deadline (its thread
        is a daemon) after waiting `timeout_s` for it. The group is closed by its owner."""
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout_s)
        self.receiver.close()
