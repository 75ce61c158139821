"""The simulator's cost models in cases with exact answers: shapes, decoding, training, weight sync."""

from __future__ import annotations

import subprocess
import sys

import pytest

from llamarl.sim.deployment import Deployment, best_split, price
from llamarl.sim.generation import (
    GeneratorLayout,
    ReplicaCost,
    kv_footprint_tokens,
    replica_generate_s,
    shares,
)
from llamarl.sim.hardware import Efficiency, GpuSpec
from llamarl.sim.memory import kv_budget_per_gpu, trainer_bytes_per_gpu
from llamarl.sim.models import LLAMA3_8B, LLAMA3_70B, LLAMA3_405B, SMOLLM2_135M
from llamarl.sim.training import train_flops, train_s
from llamarl.sim.weight_sync import weight_sync_s
from llamarl.sim.workload import Workload

GPU = GpuSpec()
EFF = Efficiency()


@pytest.mark.parametrize(
    "model,published",
    [(LLAMA3_8B, 8.03e9), (LLAMA3_70B, 70.55e9), (LLAMA3_405B, 405.85e9), (SMOLLM2_135M, 134.5e6)],
)
def test_parameter_counts(model, published: float) -> None:
    assert model.params == pytest.approx(published, rel=0.005)


def test_kv_cache_bytes_per_token() -> None:
    # 2 (K and V) x layers x KV heads x head_dim x 2 bytes.
    assert LLAMA3_8B.kv_bytes_per_token(2) == 2 * 32 * 8 * 128 * 2
    assert LLAMA3_405B.kv_bytes_per_token(1) == 2 * 126 * 8 * 128


def test_training_time_is_flops_over_utilised_peak() -> None:
    lengths = [100, 300]
    flops = sum(3 * (50 + n) * LLAMA3_8B.forward_flops_per_token((50 + n) / 2) for n in lengths)
    assert train_flops(LLAMA3_8B, 50, lengths) == pytest.approx(flops)
    seconds = train_s(LLAMA3_8B, 50, lengths, gpus=4, gpu=GPU, eff=EFF)
    assert seconds == pytest.approx(flops / (4 * 989e12 * EFF.train_mfu))


def test_equal_lengths_decode_in_one_batch() -> None:
    # Every sequence fits at once and all end together: one prefill, then L steps at the mid context.
    cost = ReplicaCost(LLAMA3_8B, GPU, EFF, GeneratorLayout(tp=1), kv_budget_per_gpu=40e9)
    seconds = replica_generate_s([200] * 16, cost, 100, max_batch=64, continuous=True)
    assert seconds == pytest.approx(cost.prefill_s(16, 100) + 200 * cost.step_s(16, 100 + 100))


def test_static_batches_wait_for_their_longest_sequence() -> None:
    cost = ReplicaCost(LLAMA3_8B, GPU, EFF, GeneratorLayout(tp=1, continuous_batching=False), 40e9)
    lengths = [10, 500, 10, 10]
    static = replica_generate_s(lengths, cost, 100, max_batch=2, continuous=False)
    expected = 2 * cost.prefill_s(2, 100) + 500 * cost.step_s(2, 350) + 10 * cost.step_s(2, 105)
    assert static == pytest.approx(expected)
    # Continuous batching refills the slots of the short ones instead: faster.
    assert replica_generate_s(lengths, cost, 100, max_batch=2, continuous=True) < static


def test_the_long_tail_holds_the_step() -> None:
    cost = ReplicaCost(LLAMA3_8B, GPU, EFF, GeneratorLayout(tp=1), 40e9)
    seconds = replica_generate_s([10] * 63 + [2000], cost, 100, max_batch=64, continuous=True)
    assert seconds >= 2000 * cost.step_s(1, 100)


def test_decoding_is_memory_bound_at_batch_one_and_fp8_halves_the_weights() -> None:
    bf16 = ReplicaCost(LLAMA3_70B, GPU, EFF, GeneratorLayout(tp=8, cuda_graphs=True), 20e9)
    weights_s = LLAMA3_70B.matmul_params * 2 / 8 / (GPU.memory_bandwidth * EFF.decode_bandwidth_eff)
    assert bf16.step_s(1, 0) > weights_s
    fp8 = ReplicaCost(LLAMA3_70B, GPU, EFF, GeneratorLayout(tp=8, weight_dtype="fp8"), 20e9)
    overhead = bf16.step_s(1, 0) - weights_s
    assert fp8.step_s(1, 0) == pytest.approx(weights_s / 2 + overhead)


def test_kv_memory_sets_the_batch() -> None:
    layout = GeneratorLayout(tp=8)
    usable = GPU.memory_bytes * EFF.memory_usable_frac - EFF.runtime_reserve_gb * 1e9
    weights = LLAMA3_70B.params * 2 / 8
    assert kv_budget_per_gpu(LLAMA3_70B, GPU, EFF, layout) == pytest.approx(usable - weights)
    resident = trainer_bytes_per_gpu(LLAMA3_70B, 64, EFF)
    squeezed = kv_budget_per_gpu(LLAMA3_70B, GPU, EFF, layout, resident)
    cost = ReplicaCost(LLAMA3_70B, GPU, EFF, layout, squeezed)
    per_token = LLAMA3_70B.kv_bytes_per_token(2) / 8
    assert cost.max_batch(1000, 10_000) == int(squeezed / (per_token * 1000))
    # Static batches reserve the longest completion; a paged cache what sequences hold on average.
    assert kv_footprint_tokens([100, 300], 50, continuous=False) == 350
    assert kv_footprint_tokens([100, 300], 50, continuous=True) == pytest.approx(50 + (1e4 + 9e4) / 800)


def test_shares_keep_groups_whole() -> None:
    assert shares([1, 2, 3, 4, 5, 6], 2, group=2) == [[1, 2, 3, 4], [5, 6]]
    assert shares([1, 2, 3, 4], 2, group=2) == [[1, 2], [3, 4]]


def test_weight_sync_layouts() -> None:
    kw = {"wire_bytes_per_param": 2, "gpu": GPU, "eff": EFF}
    bandwidth = GPU.network_gbs * 1e9 * EFF.link_eff
    latency = EFF.p2p_latency_us * 1e-6
    model_bytes = LLAMA3_405B.params * 2
    # Shard to shard: each of 8 receiving devices gets 1/8; 64 senders send 2 replicas' worth / 64.
    ddma = weight_sync_s("shard_to_shard", LLAMA3_405B, trainer_gpus=64, replicas=2, replica_gpus=8, **kw)
    assert ddma == pytest.approx(model_bytes / 8 / bandwidth + latency)
    gather = weight_sync_s("gather_broadcast", LLAMA3_405B, trainer_gpus=64, replicas=2, replica_gpus=8, **kw)
    assert gather == pytest.approx(2 * model_bytes / bandwidth + 2 * latency)
    assert gather > 10 * ddma


def test_workload_draw_is_stratified_and_repeatable() -> None:
    wl = Workload(prompts_per_step=64, samples_per_prompt=4, median_output_tokens=300, max_new_tokens=1024)
    a, b = wl.output_lengths(), wl.output_lengths()
    assert a == b and len(a) == 256 and max(a) <= 1024
    assert sorted(a)[128] == pytest.approx(300, rel=0.05)  # the median
    flat = Workload(output_sigma=0, median_output_tokens=100, prompts_per_step=2, samples_per_prompt=2)
    assert flat.output_lengths() == [100] * 4


def test_overlap_alone_gains_at_most_two_and_nothing_over_time_sharing() -> None:
    # Equal lengths and a small engine batch: generation is throughput-bound, so both phases scale
    # with their devices (the derivation in docs/simulator.md).
    wl = Workload(prompts_per_step=512, samples_per_prompt=8, output_sigma=0, median_output_tokens=256)
    eff = EFF.model_copy(update={"max_seqs_per_replica": 64})
    template = Deployment(LLAMA3_8B, 0, 0, GeneratorLayout(tp=1, weight_dtype="bf16"))
    _, times = best_split(template, 64, wl, GPU, eff, tps=(1,), pps=(1,))
    overlap = times.sync_step_s / times.async_step_s  # the same split, taking turns vs at once
    assert 1.0 < overlap <= 2.0
    shared = Deployment(
        LLAMA3_8B, 64, 64, GeneratorLayout(tp=1), colocated=True, trainer_state_resident=False
    )
    time_shared = price(shared, wl, GPU, eff)
    together = time_shared.generate_s + time_shared.train_s
    # Splitting 64 devices in whole nodes and overlapping is no faster than taking turns on all 64.
    assert together / max(times.generate_s, times.train_s) <= 1.0 + 1e-9


def test_the_simulator_imports_without_torch() -> None:
    code = "import sys, llamarl.sim.cli, llamarl.sim.paper; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0
