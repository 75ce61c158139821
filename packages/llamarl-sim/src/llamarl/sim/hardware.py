"""The devices and the efficiency assumptions the simulator prices work with.

`GpuSpec` holds datasheet figures; `Efficiency` holds what a real stack achieves of them. Both are
pydantic models so every figure is named, documented and can be changed from the command line; the
`paper` command prints them one by one.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

DTYPE_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp8": 1.0}


class GpuSpec(BaseModel):
    """One accelerator and the links around it (datasheet values)."""

    name: str = Field("H100 SXM 80GB", description="the device")
    memory_gb: float = Field(80.0, gt=0, description="device memory (GB)")
    memory_bandwidth_tbs: float = Field(3.35, gt=0, description="device memory bandwidth (TB/s)")
    bf16_tflops: float = Field(989.0, gt=0, description="dense bf16 peak (TFLOP/s)")
    fp8_tflops: float = Field(1979.0, gt=0, description="dense fp8 peak (TFLOP/s)")
    gpus_per_node: int = Field(8, ge=1, description="devices joined by NVLink in one node")
    nvlink_gbs: float = Field(450.0, gt=0, description="NVLink bandwidth per device, one direction (GB/s)")
    network_gbs: float = Field(50.0, gt=0, description="network bandwidth per device between nodes (GB/s)")
    host_link_gbs: float = Field(
        25.0,
        gt=0,
        description="device <-> host memory per device, one direction, achieved (GB/s; PCIe 5 x16)",
    )

    def peak_flops(self, dtype: str) -> float:
        """Dense peak FLOP/s for matmuls in `dtype` (fp32 runs at the bf16 rate: TF32 tensor cores)."""
        return (self.fp8_tflops if dtype == "fp8" else self.bf16_tflops) * 1e12

    @property
    def memory_bytes(self) -> float:
        return self.memory_gb * 1e9

    @property
    def memory_bandwidth(self) -> float:
        return self.memory_bandwidth_tbs * 1e12

    def link_bandwidth(self, crosses_nodes: bool) -> float:
        """Bytes/s one device can send (or receive) to a peer, within a node or across nodes."""
        return (self.network_gbs if crosses_nodes else self.nvlink_gbs) * 1e9


# Other devices the out-of-sample cases ran on (datasheet values; `others` cites each case's device).
H800 = GpuSpec(name="H800 SXM 80GB", nvlink_gbs=200.0)  # H100 compute and memory, NVLink cut to 400 GB/s
H20 = GpuSpec(
    name="H20 96GB", memory_gb=96.0, memory_bandwidth_tbs=4.0, bf16_tflops=148.0, fp8_tflops=296.0
)  # Hopper with a fifth of H100's compute and more memory bandwidth
H200 = GpuSpec(name="H200 SXM 141GB", memory_gb=141.0, memory_bandwidth_tbs=4.8)  # H100 compute
GPUS: dict[str, GpuSpec] = {"h100": GpuSpec(), "h200": H200, "h800": H800, "h20": H20}


class Efficiency(BaseModel):
    """What a well-tuned stack achieves of the datasheet: the simulator's stated assumptions."""

    memory_usable_frac: float = Field(
        0.9, gt=0, le=1, description="share of device memory an engine may plan with (allocator slack)"
    )
    runtime_reserve_gb: float = Field(
        4.0, ge=0, description="per device: CUDA context, NCCL buffers, decode activations (GB)"
    )
    decode_bandwidth_eff: float = Field(
        0.75, gt=0, le=1, description="share of memory bandwidth a decoding step achieves (weights + KV)"
    )
    decode_compute_eff: float = Field(
        0.5, gt=0, le=1, description="share of peak FLOP/s a decoding step's matmuls reach when compute-bound"
    )
    prefill_compute_eff: float = Field(0.5, gt=0, le=1, description="share of peak FLOP/s in prefill")
    train_mfu: float = Field(
        0.40, gt=0, le=1, description="model FLOPs utilisation of a training step (6 x params x tokens)"
    )
    layer_overhead_us: float = Field(
        5.0, ge=0, description="per layer and decoding step: kernel launches left with CUDA graphs (us)"
    )
    eager_layer_overhead_us: float = Field(
        200.0, ge=0, description="per layer and decoding step without CUDA graphs: eager launches (us)"
    )
    allreduce_latency_intra_us: float = Field(
        10.0, ge=0, description="latency of a small all-reduce inside a node, NVLink (us)"
    )
    allreduce_latency_inter_us: float = Field(
        30.0, ge=0, description="latency of a small all-reduce across nodes (us)"
    )
    p2p_latency_us: float = Field(15.0, ge=0, description="latency of one point-to-point send (us)")
    link_eff: float = Field(0.8, gt=0, le=1, description="share of link bandwidth a bulk transfer achieves")
    trainer_bytes_per_param: float = Field(
        16.0, gt=0, description="trainer state: bf16 weights and grads, fp32 master weights, Adam m and v"
    )
    train_micro_batch_tokens: int = Field(
        8192,
        ge=1,
        description="tokens of one training micro-batch per device; with activation checkpointing each "
        "layer keeps its input: tokens x hidden x layers x 2 bytes",
    )
    trainer_workspace_gb: float = Field(
        8.0, ge=0, description="per device: one layer's recomputed activations, logits, allocator slack (GB)"
    )
    colocated_train_slowdown: float = Field(
        1.0,
        ge=1,
        description="a colocated trainer's step time over a dedicated one's on as many devices (1: the same "
        "MFU; verl's published phase times imply about 2.3, see `others`)",
    )
    max_seqs_per_replica: int = Field(
        512, ge=1, description="most sequences one generator replica decodes at once (engine limit)"
    )
