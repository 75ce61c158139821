"""Rank placement on GPUs, proven over made-up GPU counts (no GPU here): which rank computes on which
GPU with which memory cap, which GPU and settings each vLLM engine gets; one-line errors for layouts that
do not fit; and the trainer group's backend routing CPU tensors to gloo and GPU tensors to another
backend (NCCL on a GPU machine; here torch's fake backend stands in for it, since NCCL cannot start
without a GPU)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from llamarl.comm.testing import run_distributed
from llamarl.control.config import ConfigError, RunConfig
from llamarl.control.launch.devices import (
    CUDA_GROUP_BACKEND,
    changed_only_syncs,
    check_placement,
    group_backend,
    place_rank,
    uses_cuda,
    weight_sync_backend,
)
from llamarl.exec.config import SamplingConfig
from llamarl.exec.generate.vllm.env import engine_env
from llamarl.exec.generate.vllm.generator import VLLMGenerator
from llamarl.exec.generate.vllm.server import llm_kwargs, parse_args


def config(**sections) -> RunConfig:
    return RunConfig(task="gsm8k", **sections)


def placements(cfg: RunConfig, *, cuda_devices: int) -> list[tuple[str, bool, float | None]]:
    """(device, pinned, memory cap) of every rank, the ranks spread over launch.nnodes machines."""
    per_node = cfg.world_size // cfg.launch.nnodes
    check_placement(cfg, ranks_per_node=per_node, cuda_devices=cuda_devices)
    out = []
    for rank in range(cfg.world_size):
        p = place_rank(cfg, rank=rank, local_rank=rank % per_node, cuda_devices=cuda_devices)
        out.append((str(p.device), p.pin, p.memory_fraction))
    return out


def test_every_rank_gets_the_gpu_of_its_local_rank():
    cfg = config(ranks={"num_trainers": 2, "num_generators": 2}, schedule={"prompts_per_step": 4})
    assert placements(cfg, cuda_devices=4) == [
        ("cuda:0", True, None),
        ("cuda:1", True, None),
        ("cuda:2", True, 0.9),  # an hf generator rank computes on its GPU, capped
        ("cuda:3", True, 0.9),
    ]
    # Two machines of 2 GPUs: the trainers on the first, the generators on the second, GPUs 0 and 1.
    two = config(
        ranks={"num_trainers": 2, "num_generators": 2},
        schedule={"prompts_per_step": 4},
        launch={"nnodes": 2, "rdzv_endpoint": "node0:29500"},
    )
    assert [d for d, _, _ in placements(two, cuda_devices=2)] == ["cuda:0", "cuda:1", "cuda:0", "cuda:1"]


def test_a_reward_rank_computes_on_a_gpu_of_its_own_uncapped_beside_either_generator():
    for backend, generator_place in (("hf", ("cuda:2", True, 0.9)), ("vllm", ("cuda:2", False, None))):
        cfg = config(
            ranks={"num_trainers": 2, "num_generators": 1, "num_reward_ranks": 1},
            generator={"backend": backend},
            reward_model={"path": "some/reward_model"},
        )
        assert cfg.role_of(3) == "reward"
        assert placements(cfg, cuda_devices=4) == [
            ("cuda:0", True, None),
            ("cuda:1", True, None),
            generator_place,
            ("cuda:3", True, None),  # not the generators' cap: the reward model has the GPU to itself
        ]
        with pytest.raises(
            ConfigError, match=r"^4 ranks per machine need a GPU each .*; this machine shows 3$"
        ):
            placements(cfg, cuda_devices=3)


def test_reward_ranks_are_refused_beside_colocated_ranks_in_one_line():
    cfg = config(
        ranks={"num_trainers": 1, "num_generators": 1, "num_reward_ranks": 1, "colocate": True,
               "trainer_memory_fraction": 0.45},
        generator={"gpu_memory_utilization": 0.45},
        reward_model={"path": "some/reward_model"},
    )  # fmt: skip
    with pytest.raises(ConfigError, match=r"reward ranks \(--num-reward-ranks\) need GPUs of their own"):
        placements(cfg, cuda_devices=2)
    assert placements(cfg, cuda_devices=0) == [("cpu", False, None)] * 3  # the CPU: nothing to share


def test_changed_only_syncs_where_bytes_cost_more_than_encoding_them():
    # auto: llamarl.comm's own rule (None: on for bf16 or fp8 on the wire) across machines or between
    # GPUs; off on one CPU machine (loopback is memory speed); on and off as set, anywhere.
    assert changed_only_syncs(config(), cuda_devices=0) is False
    assert changed_only_syncs(config(), cuda_devices=1) is None
    two_machines = config(launch={"nnodes": 2, "rdzv_endpoint": "10.0.0.1:29400"})
    assert changed_only_syncs(two_machines, cuda_devices=0) is None
    assert changed_only_syncs(config(weight_sync={"delta": "on"}), cuda_devices=0) is True
    assert changed_only_syncs(config(weight_sync={"delta": "off"}), cuda_devices=8) is False


def test_the_weight_sync_group_is_nccl_only_where_every_rank_has_a_gpu_of_its_own():
    two = {"num_trainers": 2, "num_generators": 2}
    assert weight_sync_backend(config(ranks=two), cuda_devices=4) == "nccl"
    assert weight_sync_backend(config(ranks={**two, "device": "cuda"}), cuda_devices=4) == "nccl"
    assert weight_sync_backend(config(ranks=two), cuda_devices=0) == "gloo"  # the CPU
    assert weight_sync_backend(config(ranks={**two, "device": "cpu"}), cuda_devices=4) == "gloo"
    # Trainer i and generator i on one GPU: NCCL refuses two members on one device, so gloo.
    colocated = config(
        ranks={**two, "colocate": True, "trainer_memory_fraction": 0.45},
        generator={"gpu_memory_utilization": 0.45},
    )
    assert weight_sync_backend(colocated, cuda_devices=2) == "gloo"


def test_a_vllm_generator_rank_leaves_its_gpu_to_its_engine():
    cfg = config(
        ranks={"num_trainers": 1, "num_generators": 3},
        schedule={"prompts_per_step": 3},
        generator={"backend": "vllm", "gpu_memory_utilization": 0.8},
        sampling={"samples_per_prompt": 8},
    )
    assert placements(cfg, cuda_devices=4) == [
        ("cuda:0", True, None),
        ("cuda:1", False, None),  # no CUDA context in the rank: the memory is the engine's
        ("cuda:2", False, None),
        ("cuda:3", False, None),
    ]
    # Each engine child sees its rank's GPU alone, and is built with the config's settings.
    for rank, expected in ((1, "1"), (3, "3")):
        device = str(place_rank(cfg, rank=rank, local_rank=rank, cuda_devices=4).device)
        generator = VLLMGenerator(
            "/models/m", SamplingConfig(), cfg.generator, device=device, batch_sequences=cfg.request_sequences
        )
        assert engine_env(num_threads=1, device=device)["CUDA_VISIBLE_DEVICES"] == expected
        kwargs = llm_kwargs(parse_args(["--fd", "3", *generator.server_args()]), worker_extension_cls="x")
        assert kwargs["gpu_memory_utilization"] == 0.8
        assert kwargs["max_num_seqs"] == 8  # one prompt of the 3 per step x 8 samples, per generator


def test_colocated_trainer_and_engine_share_a_gpu_with_explicit_fractions():
    cfg = config(
        ranks={"num_trainers": 2, "num_generators": 2, "colocate": True, "trainer_memory_fraction": 0.5},
        generator={"gpu_memory_utilization": 0.45},
        schedule={"prompts_per_step": 4},
    )
    assert placements(cfg, cuda_devices=2) == [
        ("cuda:0", True, 0.5),
        ("cuda:1", True, 0.5),
        ("cuda:0", True, 0.45),
        ("cuda:1", True, 0.45),
    ]


@pytest.mark.parametrize(
    ("ranks", "extra", "cuda_devices", "message"),
    [
        ({"device": "cuda"}, {}, 0, "ranks.device (--device) is cuda, but no CUDA device is visible"),
        ({}, {}, 1, "2 ranks per machine need a GPU each (share GPUs with --ranks.colocate"),
        ({"colocate": True, "trainer_memory_fraction": 0.5}, {}, 1, None),
        (
            {"num_trainers": 2, "num_generators": 2, "colocate": True, "trainer_memory_fraction": 0.5},
            {"schedule": {"prompts_per_step": 2}},
            1,
            "ranks.colocate puts 2 trainer/generator pairs on as many GPUs; this machine shows 1",
        ),
    ],
)
def test_layouts_that_do_not_fit_the_gpus_are_one_line_errors(ranks, extra, cuda_devices, message):
    generator = {"gpu_memory_utilization": 0.45} if ranks.get("colocate") else {}
    cfg = config(ranks=ranks, generator=generator, **extra)
    if message is None:  # one GPU, one trainer and one generator sharing it: the GPU recipe's layout
        check_placement(cfg, ranks_per_node=cfg.world_size, cuda_devices=cuda_devices)
        return
    with pytest.raises(ConfigError) as error:
        check_placement(cfg, ranks_per_node=cfg.world_size, cuda_devices=cuda_devices)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_on_the_cpu_nothing_is_pinned():
    assert not uses_cuda(config(), cuda_devices=0)
    assert placements(config(ranks={"device": "cpu"}), cuda_devices=8) == [("cpu", False, None)] * 2
    assert group_backend(torch.device("cpu")) == "gloo"
    assert group_backend(torch.device("cuda", 3)) == CUDA_GROUP_BACKEND == "cpu:gloo,cuda:nccl"


def _trainer_group_routes_by_device(rank: int, world_size: int, rendezvous) -> dict:
    # Registers the "fake" backend.
    import torch.testing._internal.distributed.fake_pg

    dist.init_process_group("gloo", init_method=rendezvous.init_method, rank=rank, world_size=world_size)
    # The backend string the trainer group gets on CUDA, its NCCL part replaced by torch's fake backend
    # (NCCL aborts without a GPU); every rank takes part in creating it, the generator (rank 2) too.
    backend = group_backend(torch.device("cuda", 0)).replace("nccl", "fake")
    group = dist.new_group([0, 1], backend=backend)
    if rank == 2:
        non_member = group == dist.GroupMember.NON_GROUP_MEMBER
        # Gloo's full mesh can be connected on this side before a peer finished its handshake:
        # tearing the default group down now would close that peer's socket mid-connect.
        dist.barrier()
        return {"non_member": non_member}
    from torch.distributed.distributed_c10d import _get_object_coll_device

    counts = torch.tensor([rank + 1.0], dtype=torch.float64)  # a CPU bookkeeping tensor (token counts)
    dist.all_reduce(counts, group=group)
    objects: list = [None, None]
    dist.all_gather_object(objects, {"rank": rank}, group=group)  # what checkpoints' planners do
    dist.barrier()
    return {
        "sum": counts.item(),
        "objects": objects,
        "object_device": _get_object_coll_device(group),
        "cpu": type(group._get_backend(torch.device("cpu"))).__name__,
        "cuda": type(group._get_backend(torch.device("cuda"))).__name__,
    }


@pytest.mark.timeout(120)
def test_the_trainer_group_routes_cpu_tensors_to_gloo_and_gpu_tensors_to_its_gpu_backend():
    results = run_distributed(_trainer_group_routes_by_device, 3, timeout_s=100)
    assert results[2] == {"non_member": True}
    for r in (0, 1):
        assert results[r]["sum"] == 3.0  # computed by gloo, for real
        assert results[r]["objects"] == [{"rank": 0}, {"rank": 1}]
        assert results[r]["object_device"] == "cpu"  # object collectives stay on gloo
        assert results[r]["cpu"] == "ProcessGroupGloo"
        assert results[r]["cuda"] == "FakeProcessGroup"  # NCCL's place: every GPU tensor goes there
