"""Data parallelism for the trainer: FSDP2 sharding over the trainer ranks' own process group, and the
small all-reduces that make per-rank numbers global.

The trainer ranks have a process group of their own (not the default one, which also holds the
generators), so every collective here takes `group` explicitly.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def group_size(group: dist.ProcessGroup | None) -> int:
    """Ranks in the trainer group; 1 without one."""
    return 1 if group is None else dist.get_world_size(group)


def shard_model(
    model: torch.nn.Module,
    group: dist.ProcessGroup,
    *,
    device: torch.device,
    param_dtype: torch.dtype | None = None,
    reshard_root_after_forward: bool = False,
    activation_checkpointing: bool = False,
    expert_parallel: bool = False,
) -> torch.nn.Module:
    """Shards `model` with FSDP2 (`fully_shard`) over `group`: each decoder layer, then the root.

    Parameters become DTensors sharded on dim 0, each rank holding one slice (what `llamarl.comm` sends
    from, with no gather). `param_dtype` (e.g. bf16 on CUDA) is the compute dtype of forward and
    backward; the sharded parameters, and so the optimizer state, keep the model's own dtype (fp32
    master weights) and gradients are reduced in that dtype. Gradients are summed across ranks, not
    averaged: the trainer already divides each rank's loss by the global token and sequence counts.

    `activation_checkpointing` recomputes each decoder layer's activations in backward, with torch's
    composable `checkpoint` (applied before `fully_shard`, the order FSDP2 composes with; it keeps the
    parameter names, which weight sync relies on). transformers' own `gradient_checkpointing_enable`
    hangs under FSDP2: its recomputation re-enters the layer's FSDP hooks in backward.

    `expert_parallel`: a mixture of experts' expert weights are sharded over `group` by expert instead
    (`llamarl.exec.train.expert_parallel.shard_experts`) and FSDP2 leaves them alone.
    """
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    mesh = DeviceMesh.from_group(group, device_type=device.type)
    policy = MixedPrecisionPolicy(
        param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None
    )
    ignored = None
    if expert_parallel:
        from llamarl.exec.train.expert_parallel import shard_experts

        ignored = shard_experts(model, group, device=device)
    # Sharding per decoder layer lets FSDP2 gather one layer's weights at a time (and free them after).
    layer_classes = set(getattr(model, "_no_split_modules", None) or ())
    for module in list(model.modules()):
        if type(module).__name__ in layer_classes:
            if activation_checkpointing:
                from torch.distributed._composable import checkpoint

                checkpoint(module)
            fully_shard(module, mesh=mesh, mp_policy=policy, ignored_params=ignored)
    fully_shard(
        model,
        mesh=mesh,
        mp_policy=policy,
        reshard_after_forward=reshard_root_after_forward,
        ignored_params=ignored,
    )
    for module in model.modules():
        if isinstance(module, FSDPModule):  # these setters act on one FSDP unit each
            module.set_gradient_divide_factor(1.0)
            # A plain SUM (then a division by 1.0): gloo has no PREMUL_SUM, the op a factor asks for.
            module.set_force_sum_reduction_for_comms(True)
    return model


def _all_reduce(values: list[float], group: dist.ProcessGroup | None, op: dist.ReduceOp) -> list[float]:
    """`values` reduced elementwise by `op` over the group's ranks (float64; as is without a group)."""
    if group is None or group_size(group) == 1 or not values:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=op, group=group)
    return t.tolist()


def all_reduce_sum(values: list[float], group: dist.ProcessGroup | None) -> list[float]:
    """The elementwise sum of `values` over the group's ranks."""
    return _all_reduce(values, group, dist.ReduceOp.SUM)


def all_reduce_max(values: list[float], group: dist.ProcessGroup | None) -> list[float]:
    """The elementwise maximum of `values` over the group's ranks."""
    return _all_reduce(values, group, dist.ReduceOp.MAX)


def all_reduce_min(values: list[float], group: dist.ProcessGroup | None) -> list[float]:
    """The elementwise minimum of `values` over the group's ranks."""
    return _all_reduce(values, group, dist.ReduceOp.MIN)


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered whole (a collective over its mesh), or the tensor as is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t
