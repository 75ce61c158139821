"""The engine process's weights (vLLM environment): joining the trainer's weight-sync group, taking each
sync through vLLM's weight-transfer API with llamarl.comm's `llamarl` backend, the version served, and
the prefix-cache reset every sync owes.

Pull before pause: `begin` has the workers start pulling a sync into their staging (vLLM's
`start_weight_update`) and returns; the engine keeps stepping its requests while `staged()` is False;
`complete` then swaps the sync in (`update_weights`: vLLM's reload from the staging, the only part that
stops generation) and finishes it with its version. `receive` does both at once, for a sync taken
with nothing to generate meanwhile.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from llamarl.comm import WeightSyncEndpoint


class EngineWeights:
    """The weights a `vllm.LLM` built with the `llamarl` weight-transfer backend (and llamarl.comm's
    worker extension) serves. `log` writes a line to the engine's log."""

    def __init__(self, llm: Any, log: Callable[[str], None]) -> None:
        self.llm = llm
        self.log = log
        # The policy_version loaded now (None after a failed sync): what stamps each sampled token.
        self.version: int | None = self.reported_version()
        # A sync taken with requests in flight owes a prefix-cache reset: vLLM refuses one while requests
        # run, so it runs once they are done (`settle_prefix_cache`).
        self._reset_owed_for: int | None = None
        self._began_at: float | None = None  # when the sync being pulled was started (None: none is)

    def join(self, endpoint: WeightSyncEndpoint, announce_timeout_s: float | None = None) -> int:
        """Every worker joins the group (worker 0 as `endpoint.rank`); returns the tensors a sync
        delivers. A started sync waits at most `announce_timeout_s` for the trainer to begin it."""
        from llamarl.comm.adapters.checkpoint import checkpoint_tensor_specs, resolve_model_dir
        from llamarl.comm.adapters.vllm import init_weight_transfer

        init_weight_transfer(self.llm, endpoint, announce_timeout_s=announce_timeout_s)
        model_config = self.llm.llm_engine.model_config
        return len(checkpoint_tensor_specs(resolve_model_dir(model_config.model, model_config.revision)))

    @property
    def pulling(self) -> bool:
        """A sync was begun and not yet completed."""
        return self._began_at is not None

    def begin(self) -> None:
        """The workers start pulling the next sync into their staging; the engine may keep stepping."""
        self.llm.start_weight_update()
        self._began_at = time.monotonic()

    def staged(self) -> bool:
        """Whether the sync begun is whole on every worker: `complete` would pause only for the swap."""
        from llamarl.comm.adapters.vllm import staged

        return staged(self.llm)

    def complete(self, timeout_s: float | None, *, in_flight: bool) -> int:
        """Swaps the sync begun in (waiting at most `timeout_s` for its pull to be whole) and finishes it
        with its version; then resets the prefix cache (checked), or, with requests `in_flight`, owes
        the reset (`settle_prefix_cache`): they keep their KV cache from the old weights."""
        from llamarl.comm.adapters.vllm import sync_weights

        began, self._began_at = self._began_at, None
        assert began is not None, "complete() without begin()"
        swap_start = time.monotonic()
        self.version = None  # until the workers report the new weights loaded
        received = sync_weights(self.llm, timeout_s=timeout_s, started=True, reset_prefix_cache=not in_flight)
        if in_flight:
            self._reset_owed_for = received
        self.version = received
        # The workers' own report, in the log for people and for the app test.
        end = time.monotonic()
        while_running = " (requests in flight)" if in_flight else ""
        self.log(
            f"serves policy_version {self.reported_version()}{while_running} ({end - began:.2f} s; "
            f"generation paused {end - swap_start:.2f} s)"
        )
        return received

    def receive(self, timeout_s: float | None, *, in_flight: bool) -> int:
        """One sync from the trainer, begun and completed here (nothing steps the engine meanwhile)."""
        self.begin()
        return self.complete(timeout_s, in_flight=in_flight)

    def settle_prefix_cache(self) -> None:
        """The prefix-cache reset a sync with requests in flight deferred; raises if vLLM refuses it."""
        from llamarl.comm.adapters.vllm import reset_prefix_cache_or_raise

        if self._reset_owed_for is None:
            return
        version, self._reset_owed_for = self._reset_owed_for, None
        # Nothing runs now, so a refusal means stale KV would be served: fail the call, as a sync does.
        reset_prefix_cache_or_raise(self.llm, version)

    def reported_version(self) -> int | None:
        """The version every worker reports (the checkpoint's before any sync, None after a failed one)."""
        from llamarl.comm.adapters.vllm import served_version

        return served_version(self.llm)

    def close(self) -> None:
        """The workers leave the weight-sync group; the weights they hold stay."""
        self.llm.shutdown_weight_transfer_engine()
