"""Mixture-of-experts policies: the hf generator records each token's experts, the trainer replays them.

Tiny random MoEs of each architecture with a route recorder (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE), from
a config. What must hold: replay equals natural routing when the weights agree; replay changes the
routes (and the log-probs) where they do not, the router still getting its gradient; every micro-batch
layout (packed, padded, shared prompts, activation checkpointing) lays the same routes on the same tokens.
"""

from __future__ import annotations

import pytest
import torch

from llamarl.exec import HFGenerator, SamplingConfig
from llamarl.exec.models import TINY_MOE_KINDS, tiny_model, tiny_moe_model
from llamarl.exec.moe.routes import (
    NO_ROUTE,
    RouteReplay,
    check_routing,
    find_routers,
    read_routes,
    route_dtype,
)
from llamarl.exec.moe.upcycle import upcycle
from llamarl.exec.testing import build_trainer

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]  # uneven lengths: left padding in the batch


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    """A saved tiny MoE of each kind (eos 2, pad 0)."""
    dirs = {}
    for kind in TINY_MOE_KINDS:
        path = tmp_path_factory.mktemp(kind)
        tiny_moe_model(kind, 64, seed=0).save_pretrained(path)
        dirs[kind] = str(path)
    return dirs


def _rollout(model_dir: str, *, seed: int = 0, max_new_tokens: int = 8):
    generator = HFGenerator(model_dir, SamplingConfig(), seed=seed, eos_token_ids=[2, 50])
    generator.setup()
    batch = generator.generate(PROMPTS, samples_per_prompt=2, max_new_tokens=max_new_tokens)
    generator.close()
    batch.rewards_B = torch.arange(batch.num_sequences, dtype=torch.float32) % 3
    return batch


def _trainer(model_dir: str, **settings):
    trainer = build_trainer(model_dir, lr=1e-2, seed=0, **settings)
    trainer.setup()
    return trainer


@pytest.mark.parametrize("kind", TINY_MOE_KINDS)
def test_the_generator_records_every_fed_position_and_the_trainer_reproduces_its_logprobs(moe_dirs, kind):
    batch = _rollout(moe_dirs[kind])
    layers = len(find_routers(tiny_moe_model(kind, 64)))
    B, P = batch.prompt_ids_BP.shape
    C = batch.completion_ids_BC.shape[1]
    assert batch.prompt_routes_BPLK.shape == (B, P, layers, 2)
    assert batch.completion_routes_BCLK.shape == (B, C, layers, 2)
    assert batch.prompt_routes_BPLK.dtype == route_dtype(4) == torch.uint8
    prompt = read_routes(batch.prompt_routes_BPLK)
    completion = read_routes(batch.completion_routes_BCLK)
    # Real prompt tokens and every drawn token but the batch's last were fed: routed to two distinct
    # experts; padding has no route, nor has the last token drawn (never fed back).
    fed_prompt = batch.prompt_mask_BP.bool()
    assert ((prompt[fed_prompt] >= 0) & (prompt[fed_prompt] < 4)).all()
    assert (prompt[~fed_prompt] == NO_ROUTE).all()
    lengths = batch.completion_mask_BC.sum(1)
    for row, length in enumerate(lengths.tolist()):
        routed = completion[row, : min(length, C - 1)]
        assert (routed >= 0).all() and (routed[..., 0] != routed[..., 1]).all()
        assert (completion[row, length:] == NO_ROUTE).all()
    assert (completion[lengths == C, C - 1] == NO_ROUTE).all()
    # The samples of one prompt share its prefill: the same prompt routes.
    assert torch.equal(prompt[0], prompt[1])
    # Same weights, float32 on both sides: the trainer's log-probs are the generator's.
    trainer = _trainer(moe_dirs[kind], pack_tokens=2048)
    logprobs = trainer.compute_logprobs(batch)
    mask = batch.completion_mask_BC.bool()
    torch.testing.assert_close(logprobs[mask], batch.behavior_logprobs_BC[mask], atol=1e-5, rtol=0)


def test_replay_equals_natural_routing_when_the_weights_agree(moe_dirs):
    batch = _rollout(moe_dirs["qwen3_moe"])
    replayed = _trainer(moe_dirs["qwen3_moe"], routing_replay="r3", pack_tokens=2048)
    natural = _trainer(moe_dirs["qwen3_moe"], routing_replay="off", pack_tokens=2048)
    torch.testing.assert_close(
        replayed.compute_logprobs(batch), natural.compute_logprobs(batch), atol=1e-6, rtol=0
    )
    metrics_replayed, metrics_natural = replayed.train_step(batch), natural.train_step(batch)
    assert metrics_replayed["routing_mismatch"] == metrics_natural["routing_mismatch"] == 0.0
    assert metrics_replayed["loss"] == pytest.approx(metrics_natural["loss"], abs=1e-6)
    for a, b in zip(replayed.model.parameters(), natural.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def _shuffled_routes(batch, *, seed: int):
    """`batch` with every recorded route replaced by another pair of experts (what a generator whose
    router differs would have recorded); a prompt's samples keep sharing its routes (one prefill)."""
    generator = torch.Generator().manual_seed(seed)
    for name in ("prompt_routes_BPLK", "completion_routes_BCLK"):
        stored = getattr(batch, name)
        routed = stored != 255
        first = torch.randint(0, 4, stored.shape[:-1], generator=generator)
        second = (first + torch.randint(1, 4, first.shape, generator=generator)) % 4
        other = torch.stack([first, second], -1).to(stored.dtype)
        setattr(batch, name, torch.where(routed, other, stored))
    batch.prompt_routes_BPLK = batch.prompt_routes_BPLK[:: batch.group_size].repeat_interleave(
        batch.group_size, 0
    )
    return batch


def test_replay_uses_the_recorded_experts_where_the_trainer_would_choose_others(moe_dirs):
    batch = _shuffled_routes(_rollout(moe_dirs["qwen3_moe"]), seed=1)
    replayed = _trainer(moe_dirs["qwen3_moe"], routing_replay="r3", pack_tokens=2048)
    natural = _trainer(moe_dirs["qwen3_moe"], routing_replay="off", pack_tokens=2048)
    mask = batch.completion_mask_BC.bool()
    gap = (replayed.compute_logprobs(batch) - natural.compute_logprobs(batch))[mask].abs()
    assert gap.max() > 1e-3  # other experts, other log-probs
    metrics = replayed.train_step(batch)
    # Most sampled tokens now differ somewhere (random pairs of 4 experts, in 2 layers); the count is
    # over sampled tokens with a route (every one but each completion's last).
    assert 0.5 < metrics["routing_mismatch"] <= 1.0
    assert natural.train_step(batch)["routing_mismatch"] == metrics["routing_mismatch"]


def test_the_router_keeps_its_gradient_under_replay(moe_dirs):
    batch = _shuffled_routes(_rollout(moe_dirs["qwen3_moe"]), seed=2)
    trainer = _trainer(moe_dirs["qwen3_moe"], routing_replay="r3", pack_tokens=2048)
    trainer.accumulate_gradients(batch)
    for router in find_routers(trainer.model):
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0


@pytest.mark.parametrize(
    "layout",
    [
        dict(pack_tokens=16, activation_checkpointing=True),  # several packed rows, shared prompts
        dict(pack_tokens=16, share_prompts=False, activation_checkpointing=False),
        dict(pack_tokens=0, micro_batch_size=1, activation_checkpointing=True),
        dict(pack_tokens=0, micro_batch_size=4, activation_checkpointing=False),  # shared-prompt passes
    ],
    ids=["packed-small", "packed-unshared", "padded-one", "padded-shared"],
)
def test_every_micro_batch_layout_replays_the_same_routes_on_the_same_tokens(moe_dirs, layout):
    """Routes that differ from the trainer's own make every mix-up visible: the log-probs and the
    gradients of each layout equal one whole packed row's (activation checkpointing included, whose
    recompute must replay what the forward did)."""
    batch = _shuffled_routes(_rollout(moe_dirs["mixtral"], max_new_tokens=10), seed=3)
    reference = _trainer(
        moe_dirs["mixtral"], routing_replay="r3", pack_tokens=4096, activation_checkpointing=False
    )
    trainer = _trainer(moe_dirs["mixtral"], routing_replay="r3", **layout)
    torch.testing.assert_close(
        trainer.compute_logprobs(batch), reference.compute_logprobs(batch), atol=1e-5, rtol=0
    )
    reference.accumulate_gradients(batch)
    trainer.accumulate_gradients(batch)
    for (name, a), b in zip(trainer.model.named_parameters(), reference.model.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-4, msg=name)


def test_routes_of_another_model_shape_are_refused(moe_dirs):
    model = tiny_moe_model("olmoe", 64)
    replay = RouteReplay(model, replaying=True)
    with pytest.raises(ValueError, match="routes of 3 MoE layers given to a model with 2"):
        replay.set(torch.zeros(4, 3, 2, dtype=torch.long))
    replay.set(torch.zeros(4, 2, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="routes for 4 tokens replayed on a forward of 6"):
        model(torch.ones(1, 6, dtype=torch.long))


def test_routing_settings_that_cannot_work_are_one_line(moe_dirs):
    from transformers import AutoConfig

    dense = tiny_model(64).config
    assert check_routing(dense, "auto", model="dense") is None
    with pytest.raises(ValueError, match="dense is not a mixture of experts"):
        check_routing(dense, "r3", model="dense")
    moe = AutoConfig.from_pretrained(moe_dirs["olmoe"])
    assert check_routing(moe, "auto", model="m") == "r3"
    assert check_routing(moe, "off", model="m") is None
    # A MoE whose router is of another kind (DeepSeek-V3's grouped, biased sigmoid routing).
    deepseek = AutoConfig.for_model(
        "deepseek_v3", n_routed_experts=8, architectures=["DeepseekV3ForCausalLM"]
    )
    with pytest.raises(ValueError, match="DeepseekV3ForCausalLM's router has no route recorder here") as e:
        check_routing(deepseek, "auto", model="ds")
    assert "\n" not in str(e.value) and "--algorithm.routing-replay off" in str(e.value)
    assert check_routing(deepseek, "off", model="ds") is None


def test_an_upcycled_model_computes_what_the_dense_one_does_and_routes_across_experts():
    dense = tiny_model(64, tie_word_embeddings=True, seed=0)
    moe = upcycle(dense, experts=4, top_k=2, seed=0)
    assert type(moe).__name__ == "MixtralForCausalLM" and len(find_routers(moe)) == 2
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(moe(ids).logits, dense(ids).logits, atol=1e-5, rtol=0)
        chosen = moe.model.layers[0].mlp.gate(moe.model.embed_tokens(ids).reshape(-1, 32))[2]
    assert len(chosen.unique()) > 2  # the router spreads tokens, it does not send all to one pair


def test_the_load_balancing_loss_is_transformers_own_and_its_weight_adds_it_to_the_loss(moe_dirs):
    from transformers import AutoModelForCausalLM

    one = _rollout(moe_dirs["mixtral"]).select([0])
    one.group_size = 1
    prompt = one.prompt_ids_BP[0][one.prompt_mask_BP[0].bool()]
    completion = one.completion_ids_BC[0][one.completion_mask_BC[0].bool()]
    model = AutoModelForCausalLM.from_pretrained(moe_dirs["mixtral"])
    with torch.no_grad():
        expected = model(torch.cat([prompt, completion])[None], output_router_logits=True).aux_loss
    plain = _trainer(moe_dirs["mixtral"], routing_replay="off").accumulate_gradients(one)
    assert plain["router_aux_loss"] == pytest.approx(float(expected), rel=1e-5)
    weighted = _trainer(moe_dirs["mixtral"], routing_replay="off", router_aux_coef=0.5).accumulate_gradients(
        one
    )
    assert weighted["router_aux_loss"] == pytest.approx(plain["router_aux_loss"], rel=1e-6)
    assert weighted["loss"] == pytest.approx(plain["loss"] + 0.5 * plain["router_aux_loss"], rel=1e-5)
