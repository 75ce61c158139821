"""Generation time: a roofline of one decoding step, and the batching that strings steps together.

A generator replica is `tp x pp` devices holding the weights in `weight_dtype`. One decoding step
reads every weight once and each running sequence's KV cache (memory-bound at small batches) or is
bound by the matmul FLOPs (large batches), plus per-layer costs that do not shrink with the batch:
kernel launches and two tensor-parallel all-reduces. Pipeline stages run one after the other for a
single micro-batch, so they add memory, not speed.

How many sequences run at once is set by the KV-cache memory left on the devices; a step's sequences
beyond that wait. Continuous batching admits a waiting sequence as soon as one finishes; static
batching (a plain `generate` loop) runs each batch until its longest sequence ends. Either way the
step is not over before its longest completion is: `max_len` decoding steps at least.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

from llamarl.sim import moe
from llamarl.sim.hardware import DTYPE_BYTES, Efficiency, GpuSpec
from llamarl.sim.models import ModelSpec


@dataclass(frozen=True)
class GeneratorLayout:
    """How one generator replica is laid out and run."""

    tp: int = 1  # tensor-parallel devices
    pp: int = 1  # pipeline stages (one micro-batch in flight)
    weight_dtype: str = "bf16"
    kv_dtype: str = "bf16"
    continuous_batching: bool = True  # False: static batches, each waits for its longest sequence
    cuda_graphs: bool = True  # False: every layer of every step pays eager kernel-launch overhead

    @property
    def gpus(self) -> int:
        return self.tp * self.pp

    def describe(self) -> str:
        pp = f" x PP{self.pp}" if self.pp > 1 else ""
        batching = "continuous" if self.continuous_batching else "static"
        launch = "CUDA graphs" if self.cuda_graphs else "eager"
        return f"TP{self.tp}{pp} {self.weight_dtype} weights, {batching} batching, {launch}"


def weight_bytes_per_gpu(model: ModelSpec, layout: GeneratorLayout) -> float:
    """Bytes of weights each device of a replica holds."""
    return model.params * DTYPE_BYTES[layout.weight_dtype] / layout.gpus


class ReplicaCost:
    """Prices the decoding steps of one replica with `kv_budget_per_gpu` bytes for the KV cache."""

    def __init__(
        self,
        model: ModelSpec,
        gpu: GpuSpec,
        eff: Efficiency,
        layout: GeneratorLayout,
        kv_budget_per_gpu: float,
    ) -> None:
        self.model = model
        self.gpu = gpu
        self.eff = eff
        self.layout = layout
        self.kv_budget_per_gpu = kv_budget_per_gpu
        tp, pp = layout.tp, layout.pp
        # KV heads split across tensor-parallel ranks; beyond kv_heads ranks they are replicated.
        self.kv_bytes_per_token_gpu = model.kv_bytes_per_token(DTYPE_BYTES[layout.kv_dtype]) / (
            min(tp, model.kv_heads) * pp
        )
        self._weight_bytes_per_param = DTYPE_BYTES[layout.weight_dtype] / (tp * pp)
        self._stage_weight_bytes = model.matmul_params * self._weight_bytes_per_param
        self._bandwidth = gpu.memory_bandwidth * eff.decode_bandwidth_eff
        self._decode_flops = gpu.peak_flops(layout.weight_dtype) * eff.decode_compute_eff * tp * pp
        self._prefill_flops = gpu.peak_flops(layout.weight_dtype) * eff.prefill_compute_eff * tp
        tp_crosses = tp > gpu.gpus_per_node
        self._allreduce_latency = (
            0.0
            if tp == 1
            else 1e-6 * (eff.allreduce_latency_inter_us if tp_crosses else eff.allreduce_latency_intra_us)
        )
        self._allreduce_bw = gpu.link_bandwidth(tp_crosses) * eff.link_eff
        self._p2p_bw = gpu.link_bandwidth(tp * pp > gpu.gpus_per_node) * eff.link_eff
        overhead_us = eff.layer_overhead_us if layout.cuda_graphs else eff.eager_layer_overhead_us
        self._layer_overhead_s = overhead_us * 1e-6

    def step_s(self, batch: int, context: float) -> float:
        """Seconds of one decoding step of `batch` sequences attending to `context` tokens on average."""
        m, tp, pp = self.model, self.layout.tp, self.layout.pp
        weight_bytes = (
            moe.decode_read_params(m, batch) * self._weight_bytes_per_param
            if m.is_moe
            else self._stage_weight_bytes
        )
        stage_bytes = weight_bytes + batch * context * self.kv_bytes_per_token_gpu
        memory_s = stage_bytes / self._bandwidth
        compute_s = batch * m.forward_flops_per_token(context) / self._decode_flops
        activation_bytes = batch * m.hidden * 2
        allreduce_s = (
            0.0
            if tp == 1
            else self._allreduce_latency + 2 * (tp - 1) / tp * activation_bytes / self._allreduce_bw
        )
        # A MoE layer's experts are spread over the tensor-parallel devices (expert parallelism): its
        # MLP all-reduce becomes a dispatch and combine.
        mlp_s = (
            moe.all_to_all_s(m, batch, tp, self._allreduce_bw, self._allreduce_latency)
            if m.is_moe
            else allreduce_s
        )
        per_layer_s = self._layer_overhead_s + allreduce_s + mlp_s
        stage_s = max(memory_s, compute_s) + m.layers / pp * per_layer_s
        p2p_s = self.eff.p2p_latency_us * 1e-6 + activation_bytes / self._p2p_bw
        return pp * stage_s + (pp - 1) * p2p_s

    def prefill_s(self, sequences: int, prompt_tokens: int) -> float:
        """Seconds to prefill `sequences` prompts of `prompt_tokens` (compute-bound)."""
        flops = sequences * prompt_tokens * self.model.forward_flops_per_token(prompt_tokens / 2)
        return flops / self._prefill_flops

    def max_batch(self, footprint_tokens: float, engine_limit: int) -> int:
        """Sequences that fit at once when each holds `footprint_tokens` of KV cache (0: none fit)."""
        if self.kv_budget_per_gpu <= 0:
            return 0
        fit = int(self.kv_budget_per_gpu / (self.kv_bytes_per_token_gpu * footprint_tokens))
        return min(fit, engine_limit)


def kv_footprint_tokens(lengths: Sequence[int], prompt_tokens: int, *, continuous: bool) -> float:
    """KV tokens one running sequence holds, for admission.

    Static batches reserve prompt + the longest completion for every row. Continuous batching with a
    paged cache holds each sequence's actual tokens: over a sequence's life prompt + L/2, and a
    sequence of length L is running for L steps, so the time-weighted mean is prompt + E[L^2] / 2E[L].
    """
    if not continuous:
        return prompt_tokens + max(lengths)
    return prompt_tokens + sum(x * x for x in lengths) / (2 * sum(lengths))


def replica_generate_s(
    lengths: Sequence[int], cost: ReplicaCost, prompt_tokens: int, max_batch: int, *, continuous: bool
) -> float:
    """Seconds for one replica to finish every sequence of `lengths` (their completion lengths).

    Between two sequence ends the running set is constant, so the steps in between are priced in one
    go at their mid-point context; sequences are admitted in order as slots free up.
    """
    if not lengths:
        return 0.0
    if max_batch < 1:
        return float("inf")
    if not continuous:
        total = 0.0
        for first in range(0, len(lengths), max_batch):
            chunk = lengths[first : first + max_batch]
            longest = max(chunk)
            total += cost.prefill_s(len(chunk), prompt_tokens)
            total += longest * cost.step_s(len(chunk), prompt_tokens + longest / 2)
        return total
    waiting = list(lengths)
    next_waiting = 0
    running: list[int] = []  # heap of the decoding step at which each running sequence ends
    start_sum = 0  # sum of the steps at which running sequences started (their mean age)
    step = 0
    total = 0.0
    ends_started: dict[int, list[int]] = {}
    while next_waiting < len(waiting) or running:
        admitted = 0
        while next_waiting < len(waiting) and len(running) < max_batch:
            end = step + waiting[next_waiting]
            heapq.heappush(running, end)
            ends_started.setdefault(end, []).append(step)
            start_sum += step
            next_waiting += 1
            admitted += 1
        if admitted:
            total += cost.prefill_s(admitted, prompt_tokens)
        end = running[0]
        n_steps = end - step
        batch = len(running)
        mean_age_mid = step + n_steps / 2 - start_sum / batch
        total += n_steps * cost.step_s(batch, prompt_tokens + mean_age_mid)
        step = end
        while running and running[0] == step:
            heapq.heappop(running)
            start_sum -= ends_started[step].pop()
    return total


def streaming_generate_s(
    lengths: Sequence[int], cost: ReplicaCost, prompt_tokens: int, max_batch: int
) -> float:
    """Seconds one replica spends on one step's worth of `lengths` when it never waits for a tail.

    Partial rollouts (AReaL's interruptible generation, verl's fully async mode): sequences still
    running when the step's quota is done carry over to the next step, so in steady state every slot
    is busy and the step costs its tokens at the full batch: sum(L) / batch decoding steps at the
    time-weighted mean context (prompt + E[L^2] / 2 E[L]), plus one prefill per sequence.
    """
    if not lengths:
        return 0.0
    if max_batch < 1:
        return float("inf")
    batch = min(max_batch, len(lengths))
    context = kv_footprint_tokens(lengths, prompt_tokens, continuous=True)
    steps = sum(lengths) / batch
    return cost.prefill_s(len(lengths), prompt_tokens) + steps * cost.step_s(batch, context)


def shares(lengths: Sequence[int], parts: int, group: int = 1) -> list[list[int]]:
    """`lengths` split into `parts` contiguous shares of whole groups (a prompt's samples together)."""
    groups = [list(lengths[i : i + group]) for i in range(0, len(lengths), group)]
    out: list[list[int]] = [[] for _ in range(parts)]
    per, extra = divmod(len(groups), parts)
    g = 0
    for p in range(parts):
        for _ in range(per + (1 if p < extra else 0)):
            out[p].extend(groups[g])
            g += 1
    return out
