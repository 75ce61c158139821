"""Layouts: which rank holds which slice of which parameter, on the trainer and on the engine side.

A *box* is an N-d rectangular region of a full (logical) parameter: ``offsets`` and ``sizes`` per dim.

- Source side (trainer): each source rank publishes a ``SourceLayout``: for each parameter its full
  shape, dtype, and the box that rank holds locally (the whole tensor on a single or replicated trainer;
  the local shard of an FSDP2 ``DTensor``, read from its placements).
- Destination side (engine): each destination rank publishes a ``DestLayout``: for each of *its* tensors
  (engine names, local shapes) a list of ``Piece``s, each saying "this box of my tensor comes from that
  box of the trainer's parameter ``src_name``". Replicated copies, tensor-parallel row/column shards and
  fused parameters (qkv, gate_up) with their name mapping are all just lists of pieces; builders below.

Layouts are plain data (JSON through the group's store), so every rank computes the same transfer plan
from the same inputs (``plan.py``) with no coordinator.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

__all__ = [
    "DestLayout",
    "DestTensor",
    "Piece",
    "SourceLayout",
    "SourceTensor",
    "chunk_range",
    "dtype_from_str",
    "dtype_to_str",
    "fused",
    "named_tensors_of",
    "replicated",
    "source_layout",
    "tp_shard",
]

Shape = tuple[int, ...]


def dtype_to_str(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``."""
    return str(dtype).removeprefix("torch.")


def dtype_from_str(name: str) -> torch.dtype:
    """``"float32"`` -> ``torch.float32``."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def chunk_range(size: int, num_chunks: int, index: int) -> tuple[int, int]:
    """``(start, length)`` of chunk ``index`` when ``size`` is split like ``torch.chunk`` (and DTensor
    ``Shard``): chunks of ``ceil(size / num_chunks)``, the last ones shorter or empty."""
    step = math.ceil(size / num_chunks) if size else 0
    start = min(index * step, size)
    return start, min(step, size - start)


@dataclass(frozen=True, kw_only=True)
class SourceTensor:
    """One parameter as a source rank holds it."""

    name: str  # the trainer's parameter name
    full_shape: Shape  # shape of the whole (unsharded) parameter
    dtype: str  # torch dtype name, e.g. "bfloat16"
    offsets: Shape  # where the local box starts in the full parameter
    sizes: Shape  # the local box's shape (== the local tensor's shape)
    contiguous: bool = True  # False: the local tensor is a strided view, its boxes are always packed


@dataclass(frozen=True, kw_only=True)
class Piece:
    """A box of a destination tensor filled from a box (same sizes) of a source parameter."""

    src_name: str  # the trainer's parameter name
    src_offsets: Shape  # where the box starts in the full source parameter
    dst_offsets: Shape  # where it lands in the local destination tensor
    sizes: Shape  # the box's shape


@dataclass(frozen=True, kw_only=True)
class DestTensor:
    """One tensor as a destination rank holds it, and where each of its boxes comes from."""

    name: str  # the engine's tensor name (e.g. "layers.0.attn.qkv_proj.weight")
    shape: Shape  # local shape on this rank
    dtype: str  # torch dtype name
    pieces: tuple[Piece, ...]  # should tile the tensor; the plan checks every piece has a source


@dataclass(kw_only=True)
class SourceLayout:
    """What one source (trainer) rank holds, and how it will put it on the wire."""

    tensors: dict[str, SourceTensor] = field(default_factory=dict)  # by parameter name, in send order
    wire_dtype: str | None = None  # None: as held; "bfloat16" or "float8_e4m3fn": cast on the wire
    bucket_bytes: int = 64 << 20  # payload bytes per bucket (all source ranks must agree)
    checksum: int = 64  # bucket checksum over every n-th int64 word (1: all of them), 0: none
    direct_min_bytes: int = 256 << 10  # contiguous slices at least this big go zero-copy
    anchor_every: int = 0  # 0: every sync full; k: changed-only syncs, every k-th one full (delta.py)

    def to_json(self) -> dict[str, Any]:
        """Plain data for the store."""
        return {
            "role": "source",
            "wire_dtype": self.wire_dtype,
            "bucket_bytes": self.bucket_bytes,
            "checksum": self.checksum,
            "direct_min_bytes": self.direct_min_bytes,
            "anchor_every": self.anchor_every,
            "tensors": [asdict(t) for t in self.tensors.values()],
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> SourceLayout:
        """Inverse of ``to_json``."""
        tensors = {}
        for t in data["tensors"]:
            tensors[t["name"]] = SourceTensor(
                name=t["name"],
                full_shape=tuple(t["full_shape"]),
                dtype=t["dtype"],
                offsets=tuple(t["offsets"]),
                sizes=tuple(t["sizes"]),
                contiguous=bool(t.get("contiguous", True)),
            )
        return cls(
            tensors=tensors,
            wire_dtype=data.get("wire_dtype"),
            bucket_bytes=int(data.get("bucket_bytes", 64 << 20)),
            checksum=int(data.get("checksum", 64)),
            direct_min_bytes=int(data.get("direct_min_bytes", 256 << 10)),
            anchor_every=int(data.get("anchor_every", 0)),
        )


@dataclass(kw_only=True)
class DestLayout:
    """What one destination (engine) rank holds, and where each piece comes from."""

    tensors: dict[str, DestTensor] = field(default_factory=dict)  # by engine name

    @classmethod
    def of(cls, tensors: Iterable[DestTensor]) -> DestLayout:
        """Build from a list of ``DestTensor`` (e.g. from ``tp_shard`` and ``fused``)."""
        out = cls()
        for t in tensors:
            if t.name in out.tensors:
                raise ValueError(f"destination tensor {t.name!r} appears twice")
            out.tensors[t.name] = t
        return out

    def to_json(self) -> dict[str, Any]:
        """Plain data for the store."""
        return {"role": "dest", "tensors": [asdict(t) for t in self.tensors.values()]}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> DestLayout:
        """Inverse of ``to_json``."""
        tensors = []
        for t in data["tensors"]:
            pieces = tuple(
                Piece(
                    src_name=p["src_name"],
                    src_offsets=tuple(p["src_offsets"]),
                    dst_offsets=tuple(p["dst_offsets"]),
                    sizes=tuple(p["sizes"]),
                )
                for p in t["pieces"]
            )
            tensors.append(
                DestTensor(name=t["name"], shape=tuple(t["shape"]), dtype=t["dtype"], pieces=pieces)
            )
        return cls.of(tensors)


# --------------------------------------------------------------------------------------------------
# Reading tensors and modules


def named_tensors_of(obj: torch.nn.Module | Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors to sync: a mapping as given, or a module's parameters plus persistent buffers.

    Tied weights appear once (under their first name, as ``named_parameters`` lists them); buffers not in
    the state dict (e.g. rotary ``inv_freq``) are left out, since engines recompute them.
    """
    if isinstance(obj, torch.nn.Module):
        out: dict[str, torch.Tensor] = {}
        seen: set[int] = set()
        for name, param in obj.named_parameters():
            out[name] = param
            seen.add(id(param))
        for module_name, module in obj.named_modules():
            for buf_name, buf in module.named_buffers(recurse=False):
                if buf is None or buf_name in module._non_persistent_buffers_set or id(buf) in seen:
                    continue
                seen.add(id(buf))
                out[f"{module_name}.{buf_name}" if module_name else buf_name] = buf
        return out
    return dict(obj)


def _dtensor_box(tensor: Any) -> tuple[Shape, Shape]:
    """The box of the full tensor held locally by this rank, read from a DTensor's placements."""
    from torch.distributed.tensor import Replicate, Shard

    mesh = tensor.device_mesh
    coord = mesh.get_coordinate()
    if coord is None:
        raise ValueError("this rank is not part of the DTensor's mesh")
    offsets = [0] * tensor.dim()
    sizes = list(tensor.shape)
    # Placements apply in mesh-dim order; a second Shard on the same tensor dim shards the shard
    # (DTensor's default, non-strided semantics).
    for mesh_dim, placement in enumerate(tensor.placements):
        if isinstance(placement, Shard):
            start, length = chunk_range(sizes[placement.dim], mesh.size(mesh_dim), coord[mesh_dim])
            offsets[placement.dim] += start
            sizes[placement.dim] = length
        elif not isinstance(placement, Replicate):
            raise ValueError(f"cannot send a DTensor with placement {placement} (Partial: reduce it first)")
    return tuple(offsets), tuple(sizes)


def source_layout(
    named_tensors: Mapping[str, torch.Tensor], *, wire_dtype: torch.dtype | None = None
) -> tuple[SourceLayout, dict[str, torch.Tensor]]:
    """The layout of a source rank and its local tensors (``DTensor``s are read as their local shard).

    Plain tensors are the whole parameter (single rank, or replicated over the source ranks).
    """
    from torch.distributed.tensor import DTensor

    layout = SourceLayout(wire_dtype=dtype_to_str(wire_dtype) if wire_dtype is not None else None)
    local: dict[str, torch.Tensor] = {}
    for name, tensor in named_tensors.items():
        tensor = tensor.detach()
        if isinstance(tensor, DTensor):
            offsets, sizes = _dtensor_box(tensor)
            local_t = tensor.to_local()
            if tuple(local_t.shape) != sizes:
                raise ValueError(f"{name}: local shard {tuple(local_t.shape)} != placement box {sizes}")
        else:
            offsets, sizes, local_t = (0,) * tensor.dim(), tuple(tensor.shape), tensor
        layout.tensors[name] = SourceTensor(
            name=name,
            full_shape=tuple(tensor.shape),
            dtype=dtype_to_str(tensor.dtype),
            offsets=offsets,
            sizes=sizes,
            contiguous=local_t.is_contiguous(),
        )
        local[name] = local_t
    return layout, local


# --------------------------------------------------------------------------------------------------
# Destination builders


def _whole(name: str, shape: Shape) -> Piece:
    return Piece(src_name=name, src_offsets=(0,) * len(shape), dst_offsets=(0,) * len(shape), sizes=shape)


def replicated(specs: Mapping[str, torch.Tensor | tuple[Sequence[int], torch.dtype]]) -> DestLayout:
    """Every tensor whole, under the same name as on the trainer (a plain or data-parallel engine).

    ``specs`` maps names to tensors (any device, ``meta`` included) or ``(shape, dtype)`` pairs.
    """
    tensors = []
    for name, spec in specs.items():
        shape, dtype = (
            (tuple(spec.shape), spec.dtype) if isinstance(spec, torch.Tensor) else (tuple(spec[0]), spec[1])
        )
        tensors.append(
            DestTensor(name=name, shape=shape, dtype=dtype_to_str(dtype), pieces=(_whole(name, shape),))
        )
    return DestLayout.of(tensors)


def _tp_range(size: int, tp_size: int, tp_rank: int, what: str) -> tuple[int, int]:
    if size % tp_size:
        raise ValueError(f"{what}: size {size} is not divisible by tensor-parallel size {tp_size}")
    return tp_rank * (size // tp_size), size // tp_size


def tp_shard(
    name: str,
    full_shape: Sequence[int],
    dtype: torch.dtype,
    *,
    dim: int,
    tp_rank: int,
    tp_size: int,
    src_name: str | None = None,
) -> DestTensor:
    """A tensor-parallel shard: the ``tp_rank``-th of ``tp_size`` equal slices of a parameter along ``dim``.

    Column-parallel linear weights ``[out, in]`` shard ``dim=0`` (and their bias), row-parallel ones
    ``dim=1``; vocab-parallel embeddings ``dim=0``. ``src_name`` is the trainer's name if it differs.
    """
    full = tuple(full_shape)
    start, length = _tp_range(full[dim], tp_size, tp_rank, name)
    sizes = tuple(length if d == dim else s for d, s in enumerate(full))
    src_offsets = tuple(start if d == dim else 0 for d in range(len(full)))
    piece = Piece(
        src_name=src_name or name, src_offsets=src_offsets, dst_offsets=(0,) * len(full), sizes=sizes
    )
    return DestTensor(name=name, shape=sizes, dtype=dtype_to_str(dtype), pieces=(piece,))


def fused(
    name: str,
    parts: Sequence[tuple[str, Sequence[int]]],
    dtype: torch.dtype,
    *,
    dim: int = 0,
    tp_rank: int = 0,
    tp_size: int = 1,
) -> DestTensor:
    """A fused parameter: the concatenation along ``dim`` of each part's tensor-parallel shard along ``dim``.

    ``parts`` lists ``(trainer_name, full_shape)`` in fused order, e.g. qkv:
    ``[("q_proj.weight", [Hq*D, H]), ("k_proj.weight", [Hkv*D, H]), ("v_proj.weight", [Hkv*D, H])]``
    or gate_up: ``[("gate_proj.weight", [I, H]), ("up_proj.weight", [I, H])]``. With ``tp_size > 1``
    each rank holds ``cat(q_r, k_r, v_r)``, the layout vLLM's ``QKVParallelLinear`` uses.
    """
    pieces = []
    offset = 0
    other: Shape | None = None
    for src_name, full_shape in parts:
        full = tuple(full_shape)
        rest = full[:dim] + full[dim + 1 :]
        if other is not None and rest != other:
            raise ValueError(f"{name}: part {src_name} has shape {full}, incompatible with the others")
        other = rest
        start, length = _tp_range(full[dim], tp_size, tp_rank, f"{name}/{src_name}")
        sizes = tuple(length if d == dim else s for d, s in enumerate(full))
        pieces.append(
            Piece(
                src_name=src_name,
                src_offsets=tuple(start if d == dim else 0 for d in range(len(full))),
                dst_offsets=tuple(offset if d == dim else 0 for d in range(len(full))),
                sizes=sizes,
            )
        )
        offset += length
    assert other is not None, "fused() needs at least one part"
    shape = (*other[:dim], offset, *other[dim:])
    return DestTensor(name=name, shape=shape, dtype=dtype_to_str(dtype), pieces=tuple(pieces))
