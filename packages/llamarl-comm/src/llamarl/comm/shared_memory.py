"""Handles to a tensor's memory that another process on the same machine can map, as JSON.

For colocated weight sync (``llamarl.comm.colocated``): the trainer exports a handle per tensor once,
the engine maps the memory and reads the trainer's current values with no copy on the way.

- CUDA tensors: CUDA IPC, through torch's own ``reduce_tensor`` / ``rebuild_cuda_tensor`` (what
  ``torch.multiprocessing`` uses). The other process must run on the same physical GPU (matched by
  UUID: ``CUDA_VISIBLE_DEVICES`` may number it differently there). NOT RUN ON A GPU YET: only the JSON
  round trip of the handle's fields is tested, on the CPU.
- CPU tensors: torch's shared-memory files (the ``file_system`` sharing strategy); exporting moves the
  tensor's storage into shared memory, so export before anything caches its address. Tested across
  processes on the CPU: it stands in for CUDA IPC in the colocated tests.

Handles travel as JSON (bytes in base64), never as pickles: a pickle from a peer could run any code.
The exporter must keep its tensors alive (and in place) while others map them.
"""

from __future__ import annotations

import base64
from typing import Any

import torch

__all__ = [
    "cuda_args_from_json",
    "cuda_args_to_json",
    "export_tensor",
    "gpu_uuid",
    "import_tensor",
    "local_device_index",
]

CUDA_IPC = "cuda-ipc"
CPU_SHM = "cpu-shm"


def _b64(raw: bytes | None) -> str | None:
    return None if raw is None else base64.b64encode(raw).decode()


def _unb64(text: str | None) -> bytes | None:
    return None if text is None else base64.b64decode(text)


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"not a torch dtype: {name!r}")
    return dtype


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def gpu_uuid(device_index: int) -> str:
    """The physical identity of a visible GPU (the same in every process, whatever its numbering)."""
    return str(torch.cuda.get_device_properties(device_index).uuid)


def local_device_index(uuid: str) -> int:
    """This process's index of the GPU with ``uuid``; raises when it cannot see that GPU."""
    for index in range(torch.cuda.device_count()):
        if gpu_uuid(index) == uuid:
            return index
    raise RuntimeError(
        f"GPU {uuid} is not among the {torch.cuda.device_count()} GPUs this process sees: a colocated "
        "engine must run on the trainer's GPU"
    )


# --------------------------------------------------------------------------------------------------
# CUDA IPC: the fields of torch's rebuild_cuda_tensor arguments, as JSON


def cuda_args_to_json(args: tuple[Any, ...], uuid: str) -> dict[str, Any]:
    """``reduce_tensor``'s arguments for ``rebuild_cuda_tensor`` as JSON; classes by kind, the device by
    GPU UUID (its index differs between processes)."""
    (
        _tensor_cls,
        size,
        stride,
        offset,
        _storage_cls,
        dtype,
        _device,
        handle,
        storage_size_bytes,
        storage_offset_bytes,
        _requires_grad,
        ref_counter_handle,
        ref_counter_offset,
        event_handle,
        event_sync_required,
    ) = args
    return {
        "kind": CUDA_IPC,
        "gpu_uuid": uuid,
        "size": list(size),
        "stride": list(stride),
        "offset": int(offset),
        "dtype": _dtype_name(dtype),
        "handle": _b64(handle),
        "storage_size_bytes": int(storage_size_bytes),
        "storage_offset_bytes": int(storage_offset_bytes),
        "ref_counter_handle": _b64(ref_counter_handle),
        "ref_counter_offset": int(ref_counter_offset),
        "event_handle": _b64(event_handle),
        "event_sync_required": bool(event_sync_required),
    }


def cuda_args_from_json(desc: dict[str, Any], device_index: int) -> tuple[Any, ...]:
    """The arguments of ``rebuild_cuda_tensor`` from ``cuda_args_to_json``, for this process's
    ``device_index`` of that GPU. Only plain tensors and typed storages are rebuilt (no class from the
    peer is ever looked up)."""
    return (
        torch.Tensor,
        torch.Size(desc["size"]),
        tuple(desc["stride"]),
        int(desc["offset"]),
        torch.storage.TypedStorage,
        _dtype(desc["dtype"]),
        device_index,
        _unb64(desc["handle"]),
        int(desc["storage_size_bytes"]),
        int(desc["storage_offset_bytes"]),
        False,  # requires_grad: an engine only reads
        _unb64(desc["ref_counter_handle"]),
        int(desc["ref_counter_offset"]),
        _unb64(desc["event_handle"]),
        bool(desc["event_sync_required"]),
    )


# --------------------------------------------------------------------------------------------------


def export_tensor(tensor: torch.Tensor) -> dict[str, Any]:
    """A JSON handle to ``tensor``'s memory (see the module doc). A CPU tensor's storage moves into
    shared memory (its address changes once, its values stay)."""
    tensor = tensor.detach()
    if tensor.device.type == "cuda":  # pragma: no cover - needs CUDA
        from torch.multiprocessing.reductions import reduce_tensor

        _, args = reduce_tensor(tensor)
        return cuda_args_to_json(args, gpu_uuid(tensor.device.index))
    if tensor.device.type != "cpu":
        raise ValueError(f"cannot share {tensor.device} memory with another process")
    storage = tensor.untyped_storage()
    manager, handle, storage_bytes = storage._share_filename_cpu_()
    return {
        "kind": CPU_SHM,
        "manager": _b64(manager),
        "handle": _b64(handle),
        "storage_bytes": int(storage_bytes),
        "size": list(tensor.shape),
        "stride": list(tensor.stride()),
        "offset": int(tensor.storage_offset()),
        "dtype": _dtype_name(tensor.dtype),
    }


def import_tensor(desc: dict[str, Any]) -> torch.Tensor:
    """Map the memory that ``desc`` (from ``export_tensor`` in another process) describes: a tensor
    that aliases the exporter's, with no copy."""
    if desc["kind"] == CUDA_IPC:  # pragma: no cover - needs CUDA
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        return rebuild_cuda_tensor(*cuda_args_from_json(desc, local_device_index(desc["gpu_uuid"])))
    if desc["kind"] != CPU_SHM:
        raise ValueError(f"unknown shared-memory handle kind {desc['kind']!r}")
    storage = torch.UntypedStorage._new_shared_filename_cpu(
        _unb64(desc["manager"]), _unb64(desc["handle"]), int(desc["storage_bytes"])
    )
    out = torch.empty(0, dtype=_dtype(desc["dtype"]))
    return out.set_(storage, int(desc["offset"]), tuple(desc["size"]), tuple(desc["stride"]))
