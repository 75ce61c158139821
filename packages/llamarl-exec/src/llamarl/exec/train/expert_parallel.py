"""Expert parallelism for a mixture-of-experts trainer: each trainer rank holds E / R of every MoE
layer's experts, and the tokens travel to the experts (all-to-all) and back.

Under FSDP2 alone every rank gathers a whole layer for its forward: for a MoE that is all E experts, of
which each token uses K. With expert parallelism each experts tensor ([E, ...]: transformers' fused
`gate_up_proj` and `down_proj`) is a DTensor sharded on dim 0 over the trainer group (what llamarl.comm
sends from, shard to shard, and what torch.distributed.checkpoint saves) and FSDP2 leaves it alone. A MoE
layer's forward sends the hidden state of each (token, chosen expert) pair to the rank that holds that
expert (`all_to_all_single`, which autograd differentiates into the reverse exchange), that rank runs its
experts on what it received, and the outputs come back the same way, to be weighted and summed where
the tokens live. An expert's gradient is then whole on its own rank: every token any rank routed to it
passed through it there. The router stays replicated (FSDP2's), so routing replay is unchanged.

Shape legend:
    N  tokens on this rank, H  hidden size, K  experts per token, E  experts, R  ranks,
    A  (token, expert) pairs this rank sends (N x K), Q  pairs it receives
"""

from __future__ import annotations

import types

import torch
import torch.distributed as dist
import torch.nn.functional as F

EXPERT_CLASSES = ("MixtralExperts", "Qwen2MoeExperts", "Qwen3MoeExperts", "OlmoeExperts")
"""transformers' fused expert modules (`gate_up_proj` [E, 2I, H], gate rows first; `down_proj` [E, H, I];
`act_fn`) that `shard_experts` distributes."""


def find_experts(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's expert modules (`EXPERT_CLASSES`) in layer order; empty for a dense model."""
    return [m for m in model.modules() if type(m).__name__ in EXPERT_CLASSES]


def check_expert_parallel(num_experts: int, ranks: int) -> None:
    """Raises ValueError (one line) when `num_experts` cannot be split evenly over `ranks`."""
    if num_experts % ranks:
        raise ValueError(
            f"trainer.expert_parallel: {num_experts} experts per layer cannot be split evenly over "
            f"{ranks} trainer ranks"
        )


def shard_experts(
    model: torch.nn.Module, group: dist.ProcessGroup, *, device: torch.device
) -> set[torch.nn.Parameter]:
    """Shards every expert module's weights on dim 0 over `group` (each rank keeps its E / R experts,
    from the whole weights every rank loaded: no communication) and gives each module the
    expert-parallel forward. Returns the sharded parameters, for FSDP2 to leave alone."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = DeviceMesh.from_group(group, device_type=device.type)
    ranks, rank = dist.get_world_size(group), dist.get_rank(group)
    sharded: set[torch.nn.Parameter] = set()
    for experts in find_experts(model):
        check_expert_parallel(experts.num_experts, ranks)
        per_rank = experts.num_experts // ranks
        for name in ("gate_up_proj", "down_proj"):
            whole = getattr(experts, name)
            local = whole.detach()[rank * per_rank : (rank + 1) * per_rank].clone()
            shard = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
            parameter = torch.nn.Parameter(shard, requires_grad=whole.requires_grad)
            setattr(experts, name, parameter)
            sharded.add(parameter)
        experts.expert_group = group
        experts.forward = types.MethodType(expert_parallel_forward, experts)
    return sharded


def expert_parallel_forward(
    self: torch.nn.Module,
    hidden_NH: torch.Tensor,
    top_k_index_NK: torch.Tensor,
    top_k_weights_NK: torch.Tensor,
) -> torch.Tensor:
    """The expert module's forward with its experts spread over `self.expert_group` (see the module
    doc): every rank of the group must run it, the same number of times (a collective). Returns [N, H]:
    each token's experts' outputs weighted by `top_k_weights_NK` and summed."""
    group = self.expert_group
    ranks = dist.get_world_size(group)
    per_rank = self.num_experts // ranks
    tokens, top_k = top_k_index_NK.shape
    expert_A = top_k_index_NK.reshape(-1)
    token_A = torch.arange(tokens, device=hidden_NH.device).repeat_interleave(top_k)
    owner_A = torch.div(expert_A, per_rank, rounding_mode="floor")
    order_A = torch.argsort(owner_A, stable=True)  # pairs grouped by the rank that holds their expert
    send_counts = torch.bincount(owner_A, minlength=ranks).cpu()
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    sent, received = send_counts.tolist(), recv_counts.tolist()
    # Which of the receiver's experts each pair goes to (no gradient), then the hidden states (with one).
    local_expert_A = (expert_A - owner_A * per_rank)[order_A]
    local_expert_Q = local_expert_A.new_empty(sum(received))
    dist.all_to_all_single(local_expert_Q, local_expert_A, received, sent, group=group)
    from torch.distributed._functional_collectives import all_to_all_single_autograd as exchange

    hidden_QH = exchange(hidden_NH[token_A[order_A]], received, sent, group)
    gate_up, down = self.gate_up_proj.to_local(), self.down_proj.to_local()  # this rank's experts
    out_QH = hidden_QH.new_zeros(hidden_QH.shape)
    for expert in range(per_rank):
        # Every local expert runs, even on no rows: its weights are then in the graph on every rank with a
        # zero gradient (a missing one would leave the ranks' gradient-norm collectives unmatched).
        rows = (local_expert_Q == expert).nonzero().squeeze(1)
        gate, up = F.linear(hidden_QH[rows], gate_up[expert].to(hidden_QH.dtype)).chunk(2, dim=-1)
        out = F.linear(self.act_fn(gate) * up, down[expert].to(hidden_QH.dtype))
        out_QH = out_QH.index_add(0, rows, out)
    back_AH = exchange(out_QH, sent, received, group)
    out_AH = torch.empty_like(back_AH).index_copy(0, order_A, back_AH)  # (not in place: autograd)
    weighted_AH = out_AH * top_k_weights_NK.reshape(-1, 1).to(out_AH.dtype)
    return hidden_NH.new_zeros(hidden_NH.shape).index_add(0, token_A, weighted_AH.to(hidden_NH.dtype))
