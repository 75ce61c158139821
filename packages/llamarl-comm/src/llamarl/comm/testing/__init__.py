"""Test helpers every llamarl package can use.

- ``run_distributed`` / ``free_port`` / ``DistributedPool`` (``harness``): run a function in several
  real processes on the CPU, tracebacks re-raised in the parent, a timeout on every run;
  ``wait_until``: wait on an event another process makes (a file, a reported version), with a deadline.
- ``nccl_rules_process_group`` / ``NcclRulesProcessGroup`` (``nccl_rules``): a gloo transport that
  follows NCCL's point-to-point rules (tags ignored, one ordered stream per pair), so a protocol is
  tested against NCCL without a GPU: ``WeightSyncGroup(..., process_group_factory=
  nccl_rules_process_group)``, or ``**transport_kwargs("nccl-rules")`` in a parametrized test.
"""

from __future__ import annotations

from typing import Any

from llamarl.comm.testing.harness import (
    DistributedPool,
    DistributedTestError,
    Rendezvous,
    free_port,
    run_distributed,
    wait_until,
)
from llamarl.comm.testing.nccl_rules import (
    NcclRulesProcessGroup,
    NcclRulesViolation,
    nccl_rules_process_group,
)

__all__ = [
    "TRANSPORTS",
    "DistributedPool",
    "DistributedTestError",
    "NcclRulesProcessGroup",
    "NcclRulesViolation",
    "Rendezvous",
    "free_port",
    "nccl_rules_process_group",
    "run_distributed",
    "transport_kwargs",
    "wait_until",
]

#: The transports a protocol test runs over: gloo as it is, and gloo under NCCL's rules.
TRANSPORTS = ("gloo", "nccl-rules")


def transport_kwargs(transport: str) -> dict[str, Any]:
    """``WeightSyncGroup`` keyword arguments for a name in ``TRANSPORTS`` (names pickle; factories
    need not)."""
    if transport == "gloo":
        return {}
    if transport == "nccl-rules":
        return {"process_group_factory": nccl_rules_process_group}
    raise ValueError(f"unknown transport {transport!r}; choose from {TRANSPORTS}")
