"""Multi-process, gloo: an FSDP2 trainer (DTensor Shard(0) parameters over 2 ranks) sends straight to a
tensor-parallel engine of 2 ranks with fused qkv and gate_up, and the engine holds bitwise the right
shards; a replicated 2-rank trainer reshards to the same engine."""

from __future__ import annotations

import pytest
import torch

from llamarl.comm import DestLayout, WeightReceiver, WeightSender, WeightSyncGroup, fused, tp_shard
from llamarl.comm.testing import run_distributed

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


def engine_layout(tp_rank: int) -> DestLayout:
    """The engine's view (vLLM-like names): fused column-parallel qkv / gate_up, row-parallel down."""
    f32 = torch.float32
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


def _worker(rank: int, world_size: int, rdv, source_kind: str, direct_min_bytes: int):
    num_src = 2
    group = WeightSyncGroup(host=rdv.host, port=rdv.port, rank=rank, world_size=world_size, timeout_s=60)
    if rank < num_src:
        torch.manual_seed(0)  # same initial weights on both trainer ranks
        model = Block()
        if source_kind == "fsdp2":
            import torch.distributed as dist
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard
            from torch.distributed.tensor import DTensor

            # The trainer's own default group (the sync group never uses it).
            dist.init_process_group(
                "gloo", init_method=f"file://{rdv.tmpdir}/fsdp", rank=rank, world_size=num_src
            )
            fully_shard(model, mesh=init_device_mesh("cpu", (num_src,)))
            assert all(isinstance(p, DTensor) for p in model.parameters())
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
            state = {}
            for name, p in model.named_parameters():
                state[name] = p.full_tensor() if hasattr(p, "full_tensor") else p.detach().clone()
            fulls.append(state)
            with torch.no_grad():  # an optimizer step, in place on the local shards
                for p in model.parameters():
                    (p.to_local() if hasattr(p, "to_local") else p).mul_(-0.5).add_(0.25)
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
def test_trainer_to_tp_engine_with_fused_qkv_bitwise(source_kind: str, direct_min_bytes: int) -> None:
    results = run_distributed(_worker, 4, source_kind, direct_min_bytes, timeout_s=150)
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
