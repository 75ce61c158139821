"""The engine process's weights (vLLM environment): joining the trainer's weight-sync group, loading each
sync into the workers (llamarl.comm's vLLM worker extension), the version served, and the prefix-cache
reset every sync owes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from llamarl.comm import WeightSyncEndpoint


class EngineWeights:
    """The weights a `vllm.LLM` (built with llamarl.comm's worker extension) serves. `log` writes a line
    to the engine's log."""

    def __init__(self, llm: Any, log: Callable[[str], None]) -> None:
        self.llm = llm
        self.log = log
        # The policy_version loaded now (None after a failed sync): what stamps each sampled token.
        self.version: int | None = self.reported_version()
        # A sync taken with requests in flight owes a prefix-cache reset: vLLM refuses one while requests
        # run, so it runs once they are done (`settle_prefix_cache`).
        self._reset_owed_for: int | None = None

    def join(self, endpoint: WeightSyncEndpoint) -> int:
        """Every worker joins the group (worker 0 as `endpoint.rank`); returns the tensors it expects."""
        from llamarl.comm.adapters.vllm import join_weight_sync

        return join_weight_sync(self.llm, endpoint)

    def receive(self, timeout_s: float | None, *, in_flight: bool) -> int:
        """One sync from the trainer into every worker, then the prefix cache reset (checked).

        With requests `in_flight` the reset is owed instead (vLLM refuses it while requests run), made
        by `settle_prefix_cache` once they are done; the requests keep their KV cache from the old
        weights.
        """
        from llamarl.comm.adapters.vllm import sync_weights

        start = time.monotonic()
        self.version = None  # until the workers report the new weights loaded
        if in_flight:
            versions = self.llm.collective_rpc("receive_weights", kwargs={"timeout_s": timeout_s})
            if len(set(versions)) != 1:
                raise RuntimeError(f"engine workers received different policy versions: {versions}")
            received = int(versions[0])
            self._reset_owed_for = received
        else:
            received = sync_weights(self.llm, timeout_s=timeout_s)  # raises when the reset is refused
        self.version = received
        # The workers' own report, in the log for people and for the app test.
        seconds, while_running = time.monotonic() - start, " (requests in flight)" if in_flight else ""
        self.log(f"serves policy_version {self.reported_version()}{while_running} ({seconds:.2f} s)")
        return received

    def settle_prefix_cache(self) -> None:
        """The prefix-cache reset a sync with requests in flight deferred; raises if vLLM refuses it."""
        if self._reset_owed_for is None:
            return
        version, self._reset_owed_for = self._reset_owed_for, None
        # Nothing runs now, so a refusal means stale KV would be served: fail the call, as sync_weights does.
        if self.llm.reset_prefix_cache() is False:
            raise RuntimeError(
                f"vLLM refused to reset its prefix cache after loading policy_version {version} during a "
                "generate: its cached KV was computed with the old weights"
            )

    def reported_version(self) -> int | None:
        """The version every worker reports (the checkpoint's before any sync, None after a failed one)."""
        versions = set(self.llm.collective_rpc("weight_version"))
        if len(versions) != 1:
            raise RuntimeError(f"engine workers serve different policy versions: {versions}")
        return versions.pop()

    def close(self) -> None:
        """The workers leave the weight-sync group; the weights they hold stay."""
        self.llm.collective_rpc("close_weight_sync")
