"""llamarl.comm: DDMA weight sync for LLM RL, trainer -> generator shard to shard, over gloo or NCCL.

Torch only; never imports another llamarl package, so it can be embedded in any inference stack.

Public API:

- ``WeightSyncEndpoint``: everything a member needs to join a group (where it meets, this member's rank,
  the world size, the backend, the deadlines, the source rank), one frozen value built once and handed
  whole to each member (``to_json`` / ``from_json`` across a process boundary).
- ``WeightSyncGroup(endpoint)``: a private process group (own TCPStore, own gloo/NCCL group), deadlines
  on every wait.
- ``WeightSender`` / ``WeightReceiver``: ``sender.send(policy_version) -> SyncStats``,
  ``receiver.receive() -> policy_version``, in place or through an engine's loader (``load_fn``).
  Changed-only syncs (``WeightSender(delta=..., anchor_every=...)``, on by default for bf16 or fp8 on
  the wire): after a full sync only the bytes that changed travel (``llamarl.comm.delta``).
- Layouts: ``replicated``, ``tp_shard``, ``fused``, ``DestLayout``, ``SourceLayout`` (FSDP2 DTensors read
  automatically); ``make_plan`` computes the transfer plan.
- ``llamarl.comm.colocated``: ``ColocatedSender`` / ``ColocatedReceiver`` for an engine on the trainer's
  GPU (the trainer's memory mapped by CUDA IPC, handles from ``llamarl.comm.shared_memory``).
- ``free_port``: a port for a group's store.
- ``llamarl.comm.testing``: ``run_distributed`` for multi-process tests, and ``nccl_rules_process_group``:
  gloo under NCCL's point-to-point rules, to test a protocol without a GPU.
"""

from llamarl.comm._session import SyncStats
from llamarl.comm.endpoint import DEAD_AFTER_S, WeightSyncEndpoint
from llamarl.comm.errors import WeightSyncError
from llamarl.comm.layouts import (
    DestLayout,
    DestTensor,
    Piece,
    SourceLayout,
    SourceTensor,
    fused,
    named_tensors_of,
    replicated,
    source_layout,
    tp_shard,
)
from llamarl.comm.plan import PlanError, TransferPlan, make_plan
from llamarl.comm.receiver import LoadFn, WeightReceiver
from llamarl.comm.sender import WeightSender
from llamarl.comm.transport import WeightSyncGroup, free_port

__all__ = [
    "DEAD_AFTER_S",
    "DestLayout",
    "DestTensor",
    "LoadFn",
    "Piece",
    "PlanError",
    "SourceLayout",
    "SourceTensor",
    "SyncStats",
    "TransferPlan",
    "WeightReceiver",
    "WeightSender",
    "WeightSyncEndpoint",
    "WeightSyncError",
    "WeightSyncGroup",
    "free_port",
    "fused",
    "make_plan",
    "named_tensors_of",
    "replicated",
    "source_layout",
    "tp_shard",
]
