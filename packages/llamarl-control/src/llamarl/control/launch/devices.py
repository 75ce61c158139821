"""Which device each rank computes on, how much of it it may take, over which backend, in which precision.

On CUDA (`ranks.device` "cuda", or "auto" where a GPU is visible) two layouts:

    own GPUs (default)   the rank with local rank l works on GPU l of its machine: L ranks per machine
                         need L GPUs. A vLLM generator rank's engine runs on the rank's GPU (its child
                         process sees only that one); the rank itself does no CUDA work. A reward rank
                         computes on its GPU, uncapped.
    ranks.colocate       one machine; trainer rank i and generator rank i share GPU i, the trainer's
                         allocator capped at ranks.trainer_memory_fraction of it and the generator at
                         generator.gpu_memory_utilization (their sum at most 1).

`place_rank` is the whole decision, a pure function of the config, the rank and the GPU count (tested
with made-up counts); `pin_rank` applies it before any CUDA work: `torch.cuda.set_device` (FSDP2 puts
shards on the *current* device, which is 0 unless set) and the allocator cap.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from llamarl.control.config import ConfigError, RunConfig

# Process groups on CUDA: tensors on a GPU go over NCCL, the small CPU bookkeeping tensors (token counts,
# norms, object collectives of checkpoints) over gloo. A group created with this backend routes each
# collective by its tensors' device.
CUDA_GROUP_BACKEND = "cpu:gloo,cuda:nccl"
CPU_GROUP_BACKEND = "gloo"


@dataclass(frozen=True)
class Placement:
    """Where one rank works."""

    device: torch.device
    """its tensors' device: cuda:<index among the GPUs this process sees>, or cpu (for a vLLM generator
    rank: its engine's GPU)"""
    pin: bool
    """whether the rank itself computes on that GPU (torch.cuda.set_device); not a vLLM generator rank,
    whose CUDA context would only take memory from its engine"""
    memory_fraction: float | None
    """the cap on the rank's CUDA allocator, as a share of its GPU (None: no cap)"""


def uses_cuda(config: RunConfig, cuda_devices: int | None = None) -> bool:
    """Whether the ranks run on CUDA: `ranks.device` "cuda", or "auto" with a GPU visible."""
    count = torch.cuda.device_count() if cuda_devices is None else cuda_devices
    return config.ranks.device == "cuda" or (config.ranks.device == "auto" and count > 0)


def changed_only_syncs(config: RunConfig, cuda_devices: int | None = None) -> bool | None:
    """`weight_sync.delta` as llamarl.comm's `WeightSender` takes it (None: its own rule, on for bf16 or
    fp8 on the wire). auto: that rule where the weights cross machines or travel between GPUs, off on one
    CPU machine, where gloo over loopback moves bytes at memory speed and encoding a delta costs more
    than the bytes it saves (SmolLM2-135M, the arith recipe: 0.50 s a sync with them against 0.17 s,
    steps 15.3 against 15.0 s, on a 2-core AMD EPYC)."""
    setting = config.weight_sync.delta
    if setting != "auto":
        return setting == "on"
    return None if config.launch.nnodes > 1 or uses_cuda(config, cuda_devices) else False


def weight_sync_backend(config: RunConfig, cuda_devices: int | None = None) -> str:
    """The weight-sync group's backend, the same on every trainer and generator rank (and engine):
    "nccl" where every rank computes on a GPU of its own (buckets go GPU to GPU, never through host
    memory); "gloo" on the CPU, and when a trainer and a generator share a GPU (`ranks.colocate`: NCCL
    refuses two members of one group on one device, so buckets are staged through host memory; the
    CUDA IPC path of `llamarl.comm.colocated` is not wired into runs yet)."""
    return "nccl" if uses_cuda(config, cuda_devices) and not config.ranks.colocate else "gloo"


def place_rank(config: RunConfig, *, rank: int, local_rank: int, cuda_devices: int) -> Placement:
    """The placement of global rank `rank` (local rank `local_rank` on its machine) on a machine whose
    process sees `cuda_devices` GPUs. Assumes `check_placement` passed."""
    if not uses_cuda(config, cuda_devices):
        return Placement(torch.device("cpu"), pin=False, memory_fraction=None)
    ranks = config.ranks
    role = config.role_of(rank)
    # Colocated (one machine, so global rank == local rank): trainer i and generator i on GPU i.
    gpu = (rank if role == "trainer" else rank - ranks.num_trainers) if ranks.colocate else local_rank
    device = torch.device("cuda", gpu)
    if role == "trainer":
        fraction = ranks.trainer_memory_fraction
        return Placement(device, pin=True, memory_fraction=fraction if fraction < 1 else None)
    if role == "reward":  # a reward model on a GPU of its own (never colocated: check_placement)
        return Placement(device, pin=True, memory_fraction=None)
    if config.generator.backend == "vllm":  # the engine child takes its share (gpu_memory_utilization)
        return Placement(device, pin=False, memory_fraction=None)
    return Placement(device, pin=True, memory_fraction=config.generator.gpu_memory_utilization)


def check_placement(config: RunConfig, *, ranks_per_node: int, cuda_devices: int) -> None:
    """Raises ConfigError (one line) when the ranks cannot be placed on the GPUs this machine shows."""
    if config.ranks.device == "cuda" and cuda_devices == 0:
        raise ConfigError("ranks.device (--device) is cuda, but no CUDA device is visible here")
    if not uses_cuda(config, cuda_devices):
        return
    if config.ranks.colocate and config.ranks.num_reward_ranks:
        raise ConfigError(
            "ranks.colocate shares each GPU between a trainer and a generator; reward ranks "
            "(--num-reward-ranks) need GPUs of their own: set it to 0 to score in the generator ranks"
        )
    needed = config.ranks.num_trainers if config.ranks.colocate else ranks_per_node
    if needed > cuda_devices:
        if config.ranks.colocate:
            what = f"ranks.colocate puts {config.ranks.num_trainers} trainer/generator pairs on as many GPUs"
        else:
            what = (
                f"{ranks_per_node} ranks per machine need a GPU each (share GPUs with --ranks.colocate, or "
                "spread the ranks over machines with --nnodes)"
            )
        raise ConfigError(f"{what}; this machine shows {cuda_devices}")


def this_rank_placement(config: RunConfig) -> Placement:
    """This process's placement, from torch elastic's RANK and LOCAL_RANK."""
    return place_rank(
        config,
        rank=int(os.environ.get("RANK", 0)),
        local_rank=int(os.environ.get("LOCAL_RANK", 0)),
        cuda_devices=torch.cuda.device_count(),
    )


def pin_rank(placement: Placement) -> None:
    """Makes the placement's GPU this process's current device and caps its allocator there. Call it
    before any CUDA work (process groups, models)."""
    if not placement.pin:
        return
    torch.cuda.set_device(placement.device)
    if placement.memory_fraction is not None:
        torch.cuda.set_per_process_memory_fraction(placement.memory_fraction, placement.device)


def rank_device(config: RunConfig) -> torch.device:
    """This rank's device (see `place_rank`)."""
    return this_rank_placement(config).device


def group_backend(device: torch.device) -> str:
    """The backend of the process groups whose collectives carry this device's tensors: NCCL for GPU
    tensors with gloo beside it for CPU ones on CUDA, gloo on the CPU."""
    return CUDA_GROUP_BACKEND if device.type == "cuda" else CPU_GROUP_BACKEND


def bf16_is_fast(device: torch.device) -> bool:
    """Whether `device` computes bf16 matrix products natively: CUDA GPUs with bf16 (Ampere and later),
    CPUs with AVX512-BF16 or AMX (there a bf16 product of a trainer's shapes ran 2.4x the float32 one);
    elsewhere bf16 is emulated, slower than float32."""
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        # Private probes of torch.cpu (present since torch 2.3); a torch without them reports no support.
        probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
        return any(getattr(torch.cpu, probe, lambda: False)() for probe in probes)
    return False


def resolve_precision(precision: str, device: torch.device) -> str:
    """A `precision` setting ("auto", "bf16", "fp32") as a dtype name for `device`: auto is bfloat16 where
    `bf16_is_fast`, else float32."""
    if precision == "auto":
        return "bfloat16" if bf16_is_fast(device) else "float32"
    return {"bf16": "bfloat16", "fp32": "float32"}[precision]


def generation_dtype(precision: str, device: torch.device) -> str:
    """The generators' weights and compute (`generator.precision` resolved for their device)."""
    return resolve_precision(precision, device)


def trainer_compute_dtype(precision: str, device: torch.device) -> str | None:
    """The trainer's forward and backward dtype (`trainer.precision` resolved); None for float32. The
    parameters, gradients and AdamW state stay float32 (master weights) either way."""
    dtype = resolve_precision(precision, device)
    return None if dtype == "float32" else dtype


def weight_wire_dtype(generation: str) -> torch.dtype | None:
    """The dtype weights travel in: bf16 to bf16 generators (cast from the float32 master weights on the
    trainer: half the bytes), else as the trainer holds them."""
    return torch.bfloat16 if generation == "bfloat16" else None
