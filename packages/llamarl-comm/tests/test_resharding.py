"""Multi-process, gloo: an FSDP2 trainer (DTensor Shard(0) parameters over 2 ranks) sends straight to a
tensor-parallel engine of 2 ranks with fused qkv and gate_up, and the engine holds bitwise the right
shards; a replicated 2-rank trainer reshards to the same engine."""

from __future__ import annotations

import pytest
import torch

from llamarl.comm import (
    DestLayout,
    WeightReceiver,
    WeightSender,
    WeightSyncEndpoint,
    WeightSyncGroup,
    fused,
    tp_shard,
)
from llamarl.comm.testing import TRANSPORTS, run_distributed, transport_kwargs

pytestmark = pytest.mark.timeout(180)

H, D, HQ, HKV, INTER = 8, 2, 4, 2, 12  # hidden, head dim, query heads, kv heads, mlp width
TP = 2


class Block(torch.nn.Module):
    """A Llama-ish block under trainer (Hugging Face-like) names, plus an odd-sized tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.q = torch.nn.Linear(H, HQ * D, bias=False)
        self.k = torch.nn.Linear(H, HKV * D, bias=False)
        self.v = torch.nn.Linear(H, HKV * D, bias=False)
        self.gate = torch.nn.Linear(H, INTER, bias=False)
        self.up = torch.nn.Linear(H, INTER, bias=False)
        self.down = torch.nn.Linear(INTER, H, bias=False)
        self.norm = torch.nn.Parameter(torch.randn(H))
        self.odd = torch.nn.Parameter(torch.randn(5, 3))  # 5 rows over 2 FSDP ranks: 3 + 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        attn = torch.cat([self.q(x), self.k(x), self.v(x)], dim=-1).sum(-1, keepdim=True)
        mlp = self.down(torch.nn.functional.silu(self.gate(x)) * self.up(x))
        return (x + attn + mlp) * self.norm + self.odd.sum()


def engine_layout(tp_rank: int, dtype: torch.dtype = torch.float32) -> DestLayout:
    """The engine's view (vLLM-like names): fused column-parallel qkv / gate_up, row-parallel down."""
    f32 = dtype
    return DestLayout.of(
        [
            fused(
                "attn.qkv_proj.weight",
                [("q.weight", (HQ * D, H)), ("k.weight", (HKV * D, H)), ("v.weight", (HKV * D, H))],
                f32,
                tp_rank=tp_rank,
                tp_size=TP,
            ),
            fused(
                "mlp.gate_up_proj.weight",
                [("gate.weight", (INTER, H)), ("up.weight", (INTER, H))],
                f32,
                tp_rank=tp_rank,
                tp_size=TP,
            ),
            tp_shard(
                "mlp.down_proj.weight",
                (H, INTER),
                f32,
                dim=1,
                tp_rank=tp_rank,
                tp_size=TP,
                src_name="down.weight",
            ),
            tp_shard("norm.weight", (H,), f32, dim=0, tp_rank=0, tp_size=1, src_name="norm"),
            tp_shard("odd", (5, 3), f32, dim=0, tp_rank=0, tp_size=1),
        ]
    )


def expected_shards(full: dict[str, torch.Tensor], tp_rank: int) -> dict[str, torch.Tensor]:
    def rows(name: str) -> torch.Tensor:
        return full[name].chunk(TP, dim=0)[tp_rank]

    return {
        "attn.qkv_proj.weight": torch.cat([rows("q.weight"), rows("k.weight"), rows("v.weight")]),
        "mlp.gate_up_proj.weight": torch.cat([rows("gate.weight"), rows("up.weight")]),
        "mlp.down_proj.weight": full["down.weight"].chunk(TP, dim=1)[tp_rank],
        "norm.weight": full["norm"],
        "odd": full["odd"],
    }


def _sync_group(rank: int, world_size: int, rdv, transport: str) -> WeightSyncGroup:
    return WeightSyncGroup(
        WeightSyncEndpoint(host=rdv.host, port=rdv.port, rank=rank, world_size=world_size, timeout_s=60),
        **transport_kwargs(transport),
    )


def _fsdp2(model: torch.nn.Module, rank: int, num_src: int, rdv) -> None:
    """Shard ``model`` with FSDP2 over the trainer ranks' own default group (never the sync group)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    dist.init_process_group("gloo", init_method=f"file://{rdv.tmpdir}/fsdp", rank=rank, world_size=num_src)
    fully_shard(model, mesh=init_device_mesh("cpu", (num_src,)))
    assert all(isinstance(p, DTensor) for p in model.parameters())


def _optimizer_step(model: torch.nn.Module) -> None:
    """Stands in for an optimizer step: in place on the local shards."""
    with torch.no_grad():
        for p in model.parameters():
            (p.to_local() if hasattr(p, "to_local") else p).mul_(-0.5).add_(0.25)


def _full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        name: p.full_tensor() if hasattr(p, "full_tensor") else p.detach().clone()
        for name, p in model.named_parameters()
    }


def _worker(rank: int, world_size: int, rdv, transport: str, source_kind: str, direct_min_bytes: int):
    num_src = 2
    group = _sync_group(rank, world_size, rdv, transport)
    if rank < num_src:
        torch.manual_seed(0)  # same initial weights on both trainer ranks
        model = Block()
        if source_kind == "fsdp2":
            _fsdp2(model, rank, num_src, rdv)
        # Several buckets per stream; with direct_min_bytes=0 every slice lands in place (row slices sent
        # from the shard's memory, column slices packed first), with >=2 buckets to a staging slot.
        sender = WeightSender(group, model, bucket_bytes=160, direct_min_bytes=direct_min_bytes)
        if source_kind == "fsdp2":
            # Sync after FSDP2's lazy init (its first forward), as a trainer does; uneven shards ("odd":
            # 3 + 2 rows) are views of padded storage by then.
            model(torch.randn(2, H))
            model.reshard()  # the root keeps its parameters gathered after forward until told
        fulls = []
        for version in (1, 2):
            sender.send(version)
            fulls.append(_full_state(model))
            _optimizer_step(model)
        group.get("test/done/2", timeout_s=60)
        group.get("test/done/3", timeout_s=60)
        kinds = {(b.direct, b.src_copy) for st in sender.plan.streams for b in st.buckets}
        return {"fulls": fulls, "sent": sender.plan.bytes_sent_by()[rank], "kinds": kinds}
    tp_rank = rank - num_src
    layout = engine_layout(tp_rank)
    tensors = {name: torch.zeros(t.shape) for name, t in layout.tensors.items()}
    receiver = WeightReceiver(group, tensors, layout=layout)
    got = []
    for version in (1, 2):
        assert receiver.receive() == version
        got.append({n: t.clone() for n, t in tensors.items()})
    group.put(f"test/done/{rank}", True)
    return got


@pytest.mark.parametrize("direct_min_bytes", [0, 256 << 10])
@pytest.mark.parametrize("source_kind", ["fsdp2", "replicated"])
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_trainer_to_tp_engine_with_fused_qkv_bitwise(
    transport: str, source_kind: str, direct_min_bytes: int
) -> None:
    results = run_distributed(_worker, 4, transport, source_kind, direct_min_bytes, timeout_s=150)
    kinds = results[0]["kinds"]
    assert kinds == ({(True, False), (True, True)} if direct_min_bytes == 0 else {(False, False)}), kinds
    fulls = results[0]["fulls"]
    for version_i in range(2):
        for tp_rank in range(TP):
            got = results[2 + tp_rank][version_i]
            for name, want in expected_shards(fulls[version_i], tp_rank).items():
                assert torch.equal(got[name], want), (source_kind, version_i, tp_rank, name)
    # Both trainer ranks sent (no gather on one rank), roughly half each.
    sent = [results[0]["sent"], results[1]["sent"]]
    assert min(sent) > 0.3 * sum(sent), sent


def _replicas_worker(rank: int, world_size: int, rdv, transport: str, num_src: int, direct_min_bytes: int):
    """``num_src`` FSDP2 trainer ranks send to replicated generators, each stream relayed along a chain
    that starts at a different generator: pairs of generators carry several streams, in both
    directions when there are two of them."""
    group = _sync_group(rank, world_size, rdv, transport)
    if rank < num_src:
        torch.manual_seed(0)
        model = Block()
        _fsdp2(model, rank, num_src, rdv)
        sender = WeightSender(group, model, bucket_bytes=160, direct_min_bytes=direct_min_bytes)
        model(torch.randn(2, H))  # FSDP2's lazy init, as a trainer's first step does
        model.reshard()
        fulls = []
        for version in (1, 2):
            sender.send(version)
            fulls.append(_full_state(model))
            _optimizer_step(model)
        for r in range(num_src, world_size):
            group.get(f"test/done/{r}", timeout_s=60)
        chains = [s.chain for s in sender.plan.streams]
        kinds = {b.direct for s in sender.plan.streams for b in s.buckets}
        return {"fulls": fulls, "chains": chains, "kinds": kinds}
    torch.manual_seed(100 + rank)
    model = Block()  # other weights: all must be overwritten
    receiver = WeightReceiver(group, model)
    got = []
    for version in (1, 2):
        assert receiver.receive() == version
        got.append({n: p.detach().clone() for n, p in model.named_parameters()})
    group.put(f"test/done/{rank}", True)
    return got


@pytest.mark.parametrize(
    ("num_src", "num_dst", "direct_min_bytes"),
    [(2, 2, 0), (3, 2, 100), (2, 3, 100)],
    ids=["2-to-2-in-place", "3-to-2-mixed", "2-to-3-mixed"],
)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_fsdp2_trainer_to_replicated_generators_through_relays_bitwise(
    transport: str, num_src: int, num_dst: int, direct_min_bytes: int
) -> None:
    results = run_distributed(
        _replicas_worker, num_src + num_dst, transport, num_src, direct_min_bytes, timeout_s=150
    )
    trainer = results[0]
    assert len({chain[0] for chain in trainer["chains"]}) > 1, trainer["chains"]  # relays rotate
    assert trainer["kinds"] == ({True} if direct_min_bytes == 0 else {True, False}), trainer["kinds"]
    for version_i in range(2):
        for got in results[num_src:]:
            for name, want in trainer["fulls"][version_i].items():
                assert torch.equal(got[version_i][name], want), (version_i, name)


DELTA_SYNCS = 50


def _sparse_step(model: torch.nn.Module, rank: int, sync: int) -> None:
    """A random share of each local shard's elements moved (none to all, cycling), in place."""
    g = torch.Generator().manual_seed(100 * sync + rank)
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            local = p.to_local() if hasattr(p, "to_local") else p
            density = (0.0, 0.01, 0.05, 0.5, 1.0)[(sync + i) % 5]
            mask = torch.rand(local.shape, generator=g) < density
            local.add_((torch.randn(local.shape, generator=g) * 0.01 * mask).to(local.dtype))


def _delta_worker(rank: int, world_size: int, rdv, transport: str, case: str):
    """``DELTA_SYNCS`` changed-only syncs from an FSDP2 trainer of 2 ranks: ``tp``, bf16 weights as they
    are to a tensor-parallel engine of 2 ranks with fused qkv, every slice in place (row slices from
    the shards' memory, column slices packed first); ``replicas``, float32 weights as bf16 on the wire to
    two replicas, each stream relayed along a chain (the two chains in opposite directions)."""
    num_src, dtype = 2, torch.bfloat16 if case == "tp" else torch.float32
    group = _sync_group(rank, world_size, rdv, transport)
    if rank < num_src:
        torch.manual_seed(0)
        model = Block().to(dtype)
        _fsdp2(model, rank, num_src, rdv)
        wire = None if case == "tp" else torch.bfloat16
        sender = WeightSender(
            group, model, bucket_bytes=160, direct_min_bytes=0, wire_dtype=wire, anchor_every=16
        )
        model(torch.randn(2, H, dtype=dtype))  # FSDP2's lazy init, as a trainer's first step does
        model.reshard()
        out = {"delta": [], "fulls": []}
        for sync in range(1, DELTA_SYNCS + 1):
            _sparse_step(model, rank, sync)
            out["delta"].append(sender.send(sync).delta)
            out["fulls"].append({n: t.to(torch.bfloat16) for n, t in _full_state(model).items()})
        for r in range(num_src, world_size):
            group.get(f"test/done/{r}", timeout_s=60)
        out["kinds"] = {(b.direct, b.src_copy) for s in sender.plan.streams for b in s.buckets}
        out["chains"] = [s.chain for s in sender.plan.streams]
        return out
    if case == "tp":
        layout = engine_layout(rank - num_src, dtype)
        tensors = {name: torch.zeros(t.shape, dtype=dtype) for name, t in layout.tensors.items()}
        receiver = WeightReceiver(group, tensors, layout=layout)
    else:
        tensors = {n: torch.zeros(p.shape, dtype=torch.bfloat16) for n, p in Block().named_parameters()}
        receiver = WeightReceiver(group, tensors)
    got = []
    for sync in range(1, DELTA_SYNCS + 1):
        assert receiver.receive() == sync
        got.append({n: t.clone() for n, t in tensors.items()})
    group.put(f"test/done/{rank}", True)
    return got


@pytest.mark.parametrize("case", ["tp", "replicas"])
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_delta_syncs_reshard_and_relay_bitwise(transport: str, case: str) -> None:
    results = run_distributed(_delta_worker, 4, transport, case, timeout_s=150)
    trainer = results[0]
    assert trainer["delta"] == [i % 16 != 0 for i in range(DELTA_SYNCS)]
    if case == "tp":
        assert trainer["kinds"] == {(True, False), (True, True)}, trainer["kinds"]
    else:
        assert sorted(trainer["chains"]) == [(2, 3), (3, 2)], trainer["chains"]
    for i, full in enumerate(trainer["fulls"]):
        for rank in (2, 3):
            got = results[rank][i]
            want = expected_shards(full, rank - 2) if case == "tp" else full
            for name, tensor in want.items():
                assert torch.equal(got[name], tensor.to(got[name].dtype)), (i, rank, name)
