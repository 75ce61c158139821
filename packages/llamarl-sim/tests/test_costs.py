"""The simulator's cost models in cases with exact answers: shapes, decoding, training, weight sync,
mixture-of-experts costs, delta syncs, offloading and failure recovery."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import pytest

from llamarl.sim import moe
from llamarl.sim.deployment import Deployment, best_split, price
from llamarl.sim.generation import (
    GeneratorLayout,
    ReplicaCost,
    kv_footprint_tokens,
    replica_generate_s,
    shares,
    streaming_generate_s,
)
from llamarl.sim.hardware import Efficiency, GpuSpec
from llamarl.sim.memory import kv_budget_per_gpu, trainer_bytes_per_gpu
from llamarl.sim.models import (
    LLAMA3_8B,
    LLAMA3_70B,
    LLAMA3_405B,
    QWEN3_30B_A3B,
    QWEN3_235B_A22B,
    SMOLLM2_135M,
)
from llamarl.sim.recovery import FailureModel, recovery_cost
from llamarl.sim.training import train_flops, train_s
from llamarl.sim.weight_sync import DeltaSync, weight_sync_s
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


def test_moe_counts_every_expert_in_memory_and_the_chosen_ones_in_flops() -> None:
    m = QWEN3_30B_A3B
    assert m.params == pytest.approx(30.5e9, rel=0.01)  # Qwen3-30B-A3B
    assert m.active_matmul_params + m.vocab * m.hidden == pytest.approx(3.3e9, rel=0.05)  # "A3B"
    assert QWEN3_235B_A22B.params == pytest.approx(235e9, rel=0.01)
    assert m.forward_flops_per_token(0) == 2 * m.active_matmul_params
    # One token reads its k experts per layer, a large batch all of them; a dense model always all.
    assert moe.experts_touched(m, 1) == pytest.approx(8)
    assert moe.experts_touched(m, 10_000) == pytest.approx(128)
    one = moe.decode_read_params(m, 1)
    assert one == pytest.approx(m.matmul_params - m.layers * 120 * m.expert_params)
    assert moe.decode_read_params(m, 10_000) == pytest.approx(m.matmul_params)
    assert moe.decode_read_params(LLAMA3_8B, 1) == LLAMA3_8B.matmul_params
    # Routing replay: tokens x layers x top-k ids of one byte (128 experts).
    assert moe.routing_replay_bytes(m, 1000) == 1000 * 48 * 8
    assert moe.routing_replay_bytes(LLAMA3_8B, 1000) == 0


def test_moe_all_to_all_moves_each_token_to_its_experts_and_back() -> None:
    m = QWEN3_30B_A3B
    seconds = moe.all_to_all_s(m, 100, 8, bandwidth=1e11, latency_s=1e-5)
    assert seconds == pytest.approx(2 * (1e-5 + 100 * 8 * m.hidden * 2 * 7 / 8 / 1e11))
    assert moe.all_to_all_s(m, 100, 1, 1e11, 1e-5) == 0.0  # one device: nothing leaves it
    dense = train_s(LLAMA3_8B, 100, [200] * 8, gpus=8, gpu=GPU, eff=EFF)
    assert dense == pytest.approx(train_flops(LLAMA3_8B, 100, [200] * 8) / (8 * 989e12 * EFF.train_mfu))
    sparse = train_s(m, 100, [200] * 8, gpus=8, gpu=GPU, eff=EFF)
    assert sparse > train_flops(m, 100, [200] * 8) / (8 * 989e12 * EFF.train_mfu)  # + the all-to-all


def test_recomputed_log_probs_cost_a_fourth_forward_pass() -> None:
    plain = train_s(LLAMA3_8B, 100, [300] * 4, gpus=4, gpu=GPU, eff=EFF)
    again = train_s(LLAMA3_8B, 100, [300] * 4, gpus=4, gpu=GPU, eff=EFF, recompute_logprobs=True)
    assert again == pytest.approx(plain * 4 / 3)


def test_a_delta_sends_the_changed_weights_as_pairs_or_a_bitmap() -> None:
    d = DeltaSync()  # 1% changed: (4-byte index, 2-byte value) pairs
    assert d.change_density == 0.01 and d.wire_bytes_per_param(2.0) == pytest.approx(0.01 * 6)
    assert DeltaSync(change_density=0.2).wire_bytes_per_param(2.0) == pytest.approx(1 / 8 + 0.2 * 2)
    assert DeltaSync(change_density=1.0).wire_bytes_per_param(2.0) == 2.0  # never more than dense
    anchored = DeltaSync(anchor_every=4).wire_bytes_per_param(2.0)
    assert anchored == pytest.approx((2.0 + 3 * 0.06) / 4)
    assert DeltaSync(anchor_every=1).wire_bytes_per_param(2.0) == 2.0


def test_partial_rollouts_never_wait_for_the_tail() -> None:
    cost = ReplicaCost(LLAMA3_8B, GPU, EFF, GeneratorLayout(tp=1), 40e9)
    even = [100] * 64
    streamed = streaming_generate_s(even, cost, 50, max_batch=64)
    assert streamed == pytest.approx(cost.prefill_s(64, 50) + 100 * cost.step_s(64, 50 + 50))
    skewed = [10] * 63 + [2000]
    tail = replica_generate_s(skewed, cost, 50, 64, continuous=True)
    assert streaming_generate_s(skewed, cost, 50, max_batch=64) < tail / 10


def test_a_colocated_trainer_offloads_its_state_around_generation() -> None:
    wl = Workload(prompts_per_step=64, samples_per_prompt=4)
    base = Deployment(LLAMA3_8B, 8, 8, GeneratorLayout(tp=1), colocated=True, weight_sync="colocated_reshard")
    assert price(base, wl, GPU, EFF).offload_s == 0.0  # resident: nothing moves
    off = replace(base, trainer_state_resident=False)
    state = LLAMA3_8B.params * 16 / 8
    assert price(off, wl, GPU, EFF).offload_s == pytest.approx(2 * state / 25e9)
    slow = EFF.model_copy(update={"colocated_train_slowdown": 2.0})
    assert price(off, wl, GPU, slow).train_s == pytest.approx(2 * price(off, wl, GPU, EFF).train_s)


def test_failures_cost_a_replica_step_instead_of_a_restart() -> None:
    f = FailureModel()
    assert f.per_device_s == pytest.approx(419 / (54 * 86400 * 16384))
    cost = recovery_cost(
        LLAMA3_70B, trainer_gpus=96, generator_gpus=32, trainer_replicas=2, generator_replicas=4,
        step_s=20.0, gpu=GPU, eff=EFF, failures=f,
    )  # fmt: skip
    assert cost.mtbf_s == pytest.approx(1 / (f.per_device_s * 128))
    assert cost.checkpoint_every_s == pytest.approx((2 * 30 * cost.mtbf_s) ** 0.5)  # Young's interval
    assert cost.restart_lost_s == pytest.approx(600 + cost.checkpoint_every_s / 2)
    heal = LLAMA3_70B.params * 16 / 48 / (50e9 * EFF.link_eff)
    assert cost.heal_s == pytest.approx(heal)
    expected = (96 * (20 + 120 + heal) / 2 + 32 * (20 + 120) / 4) / 128
    assert cost.replica_lost_s == pytest.approx(expected)
    assert cost.replica_lost_s < cost.restart_lost_s / 10
