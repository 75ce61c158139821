"""The rollout channel: batches cross process boundaries as tensors, bitwise intact, on gloo."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from llamarl.comm.testing import run_distributed
from llamarl.control.run.channels.rollouts import concat_rollouts, recv_rollouts, send_rollouts
from llamarl.exec.moe.routes import NO_ROUTE, read_routes, route_dtype
from llamarl.exec.types import RolloutBatch


def make_batch(
    seed: int, *, num_sequences: int, prompt_len: int, completion_len: int, experts: int = 0
) -> RolloutBatch:
    """A random batch; with `experts`, a mixture of experts' routes (3 layers, 2 per token) too."""
    g = torch.Generator().manual_seed(seed)
    routes = {}
    if experts:
        dtype = route_dtype(experts)
        for name, length in (("prompt_routes_BPLK", prompt_len), ("completion_routes_BCLK", completion_len)):
            routes[name] = torch.randint(0, experts, (num_sequences, length, 3, 2), generator=g).to(dtype)
    return RolloutBatch(
        **routes,
        prompt_ids_BP=torch.randint(0, 1000, (num_sequences, prompt_len), generator=g),
        prompt_mask_BP=torch.ones(num_sequences, prompt_len, dtype=torch.int64),
        completion_ids_BC=torch.randint(0, 1000, (num_sequences, completion_len), generator=g),
        completion_mask_BC=(torch.rand(num_sequences, completion_len, generator=g) > 0.3).long(),
        behavior_logprobs_BC=-torch.rand(num_sequences, completion_len, generator=g),
        rewards_B=torch.rand(num_sequences, generator=g),
        policy_version_B=torch.full((num_sequences,), 7, dtype=torch.int64),
        group_size=2,
    )


def _exchange(rank: int, world_size: int, rendezvous) -> dict | None:
    dist.init_process_group("gloo", init_method=rendezvous.init_method, rank=rank, world_size=world_size)
    try:
        if rank > 0:
            batch = make_batch(
                rank, num_sequences=4, prompt_len=3 + rank, completion_len=5 * rank, experts=EXPERTS[rank]
            )
            send_rollouts(batch, {"generate_s": 1.5 * rank, "reward_mean": 0.25}, dst=0)
            return None
        received = [recv_rollouts(src=src) for src in (1, 2)]
        return {"batches": [b.tensors() for b, _ in received], "metrics": [m for _, m in received]}
    finally:
        dist.destroy_process_group()


EXPERTS = {1: 0, 2: 300}  # rank 2's batch carries routes (int16: over 255 experts), rank 1's none


def test_rollouts_cross_ranks_bitwise():
    result = run_distributed(_exchange, 3, timeout_s=120)[0]
    for src, tensors, metrics in zip((1, 2), result["batches"], result["metrics"], strict=True):
        expected = make_batch(
            src, num_sequences=4, prompt_len=3 + src, completion_len=5 * src, experts=EXPERTS[src]
        ).tensors()
        assert list(tensors) == list(expected)
        for name, tensor in expected.items():
            assert torch.equal(tensors[name], tensor), name
            assert tensors[name].dtype == tensor.dtype, name
        assert metrics["generate_s"] == 1.5 * src and metrics["reward_mean"] == 0.25
        assert metrics["num_completion_tokens"] != metrics["num_completion_tokens"]  # not sent: NaN


def test_concat_pads_prompts_left_and_completions_right():
    a = make_batch(1, num_sequences=2, prompt_len=3, completion_len=4)
    b = make_batch(2, num_sequences=2, prompt_len=5, completion_len=2)
    joined = concat_rollouts([a, b])
    assert joined.prompt_ids_BP.shape == (4, 5) and joined.completion_ids_BC.shape == (4, 4)
    assert torch.equal(joined.prompt_ids_BP[:2, 2:], a.prompt_ids_BP)  # real tokens stay at the right end
    assert joined.prompt_mask_BP[:2, :2].sum() == 0
    assert torch.equal(joined.completion_ids_BC[2:, :2], b.completion_ids_BC)  # and at the left end here
    assert joined.completion_mask_BC[2:, 2:].sum() == 0
    assert joined.num_completion_tokens == a.num_completion_tokens + b.num_completion_tokens


def test_concat_pads_routes_with_no_route():
    a = make_batch(1, num_sequences=2, prompt_len=3, completion_len=4, experts=8)
    b = make_batch(2, num_sequences=2, prompt_len=5, completion_len=2, experts=8)
    joined = concat_rollouts([a, b])
    assert joined.prompt_routes_BPLK.shape == (4, 5, 3, 2) and joined.prompt_routes_BPLK.dtype == torch.uint8
    assert torch.equal(joined.prompt_routes_BPLK[:2, 2:], a.prompt_routes_BPLK)
    assert (read_routes(joined.prompt_routes_BPLK[:2, :2]) == NO_ROUTE).all()
    assert torch.equal(joined.completion_routes_BCLK[2:, :2], b.completion_routes_BCLK)
    assert (read_routes(joined.completion_routes_BCLK[2:, 2:]) == NO_ROUTE).all()
    with pytest.raises(ValueError, match="carry expert routes and others do not"):
        concat_rollouts([a, make_batch(3, num_sequences=2, prompt_len=3, completion_len=4)])
