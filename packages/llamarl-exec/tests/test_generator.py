"""HFGenerator on a tiny random Llama: shapes, masks, behaviour log-probs, greedy determinism."""

from __future__ import annotations

import time

import pytest
import torch

from llamarl.exec import HFGenerator, SamplingConfig
from llamarl.exec.generate.hf_sampling import draw_tokens
from llamarl.exec.testing import TINY_EOS_TOKEN_ID as EOS_TOKEN_ID
from llamarl.exec.testing import TINY_PAD_TOKEN_ID as PAD_TOKEN_ID
from llamarl.exec.testing import TINY_VOCAB_SIZE as VOCAB_SIZE
from llamarl.exec.testing import build_trainer
from llamarl.exec.types import WeightsNotSyncedError

# Several stop tokens so that some completions of the random model end early and others hit the limit.
STOP_IDS = [EOS_TOKEN_ID, 50, 51]
PROMPTS = [[1, 5, 9, 13, 17], [1, 7], [1, 3, 4, 30, 31, 32, 33, 8]]


@pytest.fixture(scope="module")
def generator(tiny_model_dir):
    gen = HFGenerator(str(tiny_model_dir), SamplingConfig(temperature=0.7), seed=0, eos_token_ids=STOP_IDS)
    gen.setup()
    yield gen
    gen.close()


def test_rollout_batch_shapes_and_masks(generator):
    generator._policy_version = 7  # stands in for a sync of version 7 (read-only from outside)
    batch = generator.generate(PROMPTS, samples_per_prompt=3, max_new_tokens=12)
    num_sequences = len(PROMPTS) * 3
    assert batch.group_size == 3
    assert batch.prompt_ids_BP.shape == (num_sequences, max(map(len, PROMPTS)))
    for i, prompt in enumerate(PROMPTS):
        for row in range(3 * i, 3 * i + 3):  # samples of one prompt are contiguous, left-padded
            assert batch.prompt_ids_BP[row, -len(prompt) :].tolist() == prompt
            assert batch.prompt_mask_BP[row].sum() == len(prompt)
            assert batch.prompt_mask_BP[row, -len(prompt) :].all()
    num_columns = batch.completion_ids_BC.shape[1]
    assert batch.completion_ids_BC.shape == batch.completion_mask_BC.shape == batch.behavior_logprobs_BC.shape
    assert 0 < num_columns <= 12
    lengths = batch.completion_mask_BC.sum(1)
    assert lengths.max() == num_columns
    ended, running = 0, 0
    for row in range(num_sequences):
        length = int(lengths[row])
        mask = batch.completion_mask_BC[row]
        assert mask[:length].all() and not mask[length:].any()  # ones, then zeros
        ids = batch.completion_ids_BC[row]
        if length < 12:  # stopped: the last real token is a stop token, padding follows
            ended += 1
            assert int(ids[length - 1]) in STOP_IDS
            assert (ids[length:] == PAD_TOKEN_ID).all()
        else:
            running += 1
        assert not any(int(t) in STOP_IDS for t in ids[: length - 1])  # stops at the first one
    assert ended and running, "test data should exercise both stopped and length-limited completions"
    logprobs = batch.behavior_logprobs_BC
    assert logprobs.dtype == torch.float32
    assert (logprobs[batch.completion_mask_BC == 1] < 0).all()
    assert (logprobs[batch.completion_mask_BC == 0] == 0).all()
    assert batch.rewards_B.tolist() == [0.0] * num_sequences
    assert batch.policy_version_B.tolist() == [7] * num_sequences
    assert batch.num_completion_tokens == int(lengths.sum())


def test_behavior_logprobs_match_a_separate_forward_pass(generator, tiny_model_dir):
    """The generator's log mu equals the trainer's log pi for the same weights: the AIPO ratio is 1."""
    batch = generator.generate(PROMPTS, samples_per_prompt=2, max_new_tokens=10)
    mask = batch.completion_mask_BC.bool()

    # 1. A plain forward pass of each sequence alone, without padding.
    model = generator.model
    for row in range(batch.num_sequences):
        prompt = batch.prompt_ids_BP[row][batch.prompt_mask_BP[row].bool()]
        completion = batch.completion_ids_BC[row][mask[row]]
        with torch.no_grad():
            logits = model(torch.cat([prompt, completion])[None]).logits[0].float()
        logprobs = torch.log_softmax(logits[len(prompt) - 1 : -1] / 0.7, dim=-1)
        expected = logprobs.gather(-1, completion[:, None]).squeeze(-1)
        torch.testing.assert_close(batch.behavior_logprobs_BC[row][mask[row]], expected, atol=1e-5, rtol=1e-5)

    # 2. The trainer's padded, micro-batched forward pass.
    trainer = build_trainer(str(tiny_model_dir), temperature=0.7)
    trainer.setup()
    trainer_logprobs = trainer.compute_logprobs(batch)
    torch.testing.assert_close(trainer_logprobs, batch.behavior_logprobs_BC, atol=1e-5, rtol=1e-5)


def test_each_prompt_is_forwarded_once_for_all_its_samples(generator, monkeypatch):
    """The prompts' tokens but the last go through the model once per prompt (3 rows), not once per
    sample (6); then every forward pass is one token per row. The log-prob test above shows that the
    repeated cache is each row's own prompt."""
    shapes = []
    forward = generator.model.forward

    def record(*args, **kwargs):
        shapes.append(tuple(kwargs["input_ids"].shape))
        return forward(*args, **kwargs)

    monkeypatch.setattr(generator.model, "forward", record)
    generator.generate(PROMPTS, samples_per_prompt=2, max_new_tokens=4)
    width = max(map(len, PROMPTS))
    assert shapes[0] == (len(PROMPTS), width - 1)
    assert set(shapes[1:]) == {(2 * len(PROMPTS), 1)} and len(shapes) == 1 + 4


def test_greedy_is_deterministic(generator):
    first = generator.generate(PROMPTS, samples_per_prompt=2, max_new_tokens=8, greedy=True)
    second = generator.generate(PROMPTS, samples_per_prompt=2, max_new_tokens=8, greedy=True)
    assert torch.equal(first.completion_ids_BC, second.completion_ids_BC)
    assert torch.equal(first.completion_mask_BC, second.completion_mask_BC)
    ids = first.completion_ids_BC
    assert torch.equal(ids[0::2], ids[1::2])  # both samples of a prompt are the argmax path
    # Greedy picks the most likely token, so its log-prob is the largest of each step: above log(1/V).
    valid = first.completion_mask_BC.bool()
    assert (first.behavior_logprobs_BC[valid] > -torch.log(torch.tensor(VOCAB_SIZE / 0.7))).all()


def test_sampling_ignores_the_model_generation_defaults(tiny_model_dir, tmp_path):
    """A top_k=1 in the model's generation_config would make sampling greedy; it must be overridden."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model.generation_config.top_k = 1
    model.generation_config.top_p = 0.5
    model.generation_config.do_sample = True
    model.save_pretrained(tmp_path)
    gen = HFGenerator(str(tmp_path), SamplingConfig(), seed=1, eos_token_ids=[EOS_TOKEN_ID])
    gen.setup()
    batch = gen.generate([[1, 5, 9]], samples_per_prompt=6, max_new_tokens=6)
    distinct = {tuple(row.tolist()) for row in batch.completion_ids_BC}
    assert len(distinct) > 1


def test_a_models_min_new_tokens_does_not_hold_back_the_stop_token(tiny_model_dir, tmp_path):
    """A min_new_tokens in the model's generation_config would mask the stop token for the first steps;
    the generator's calls take none of the model's generation defaults."""
    from transformers import AutoModelForCausalLM

    probe = HFGenerator(str(tiny_model_dir), SamplingConfig(), seed=0, eos_token_ids=[])
    probe.setup()
    first = int(
        probe.generate(PROMPTS[:1], samples_per_prompt=1, max_new_tokens=1, greedy=True).completion_ids_BC[
            0, 0
        ]
    )
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model.generation_config.min_new_tokens = 3
    model.save_pretrained(tmp_path)
    gen = HFGenerator(str(tmp_path), SamplingConfig(), seed=0, eos_token_ids=[first])
    gen.setup()
    batch = gen.generate(PROMPTS[:1], samples_per_prompt=1, max_new_tokens=6, greedy=True)
    assert batch.completion_ids_BC[0, :1].tolist() == [first]  # the greedy first token stops it
    assert batch.completion_mask_BC.sum() == 1


def test_the_policy_version_changes_only_through_the_generators_own_methods(generator):
    """Read-only from outside; weights marked lost sample nothing until they are known again, and an
    unsynced generator serves its checkpoint as version 0 (after a sync it refuses to: test_lora)."""
    with pytest.raises(AttributeError):
        generator.policy_version = 3
    generator.serve_initial_weights()
    assert generator.policy_version == 0
    generator.mark_weights_lost()
    assert generator.policy_version is None
    with pytest.raises(WeightsNotSyncedError):
        generator.generate(PROMPTS, samples_per_prompt=1, max_new_tokens=2)
    generator.serve_initial_weights()
    batch = generator.generate(PROMPTS, samples_per_prompt=1, max_new_tokens=2)
    assert batch.policy_version_B.tolist() == [0] * len(PROMPTS)


def test_weights_loaded_between_decoding_steps_take_effect_and_stamp_every_token(tiny_model_dir):
    """An in-flight update (stream mode): new weights loaded by `between_steps` after the 4th token.

    Tokens 0-3 were drawn by version 0 and tokens 4+ by version 1, and say so; the behaviour log-probs
    of tokens 0-3 are those of the old weights, those of later tokens are not (the new weights drew them).
    """
    gen = HFGenerator(str(tiny_model_dir), SamplingConfig(temperature=0.7), seed=0, eos_token_ids=[])
    gen.setup()
    old = {k: v.clone() for k, v in gen.model.state_dict().items()}
    steps = []

    def between_steps() -> None:
        steps.append(gen.policy_version)
        if len(steps) == 4:
            with torch.no_grad():
                for p in gen.model.parameters():
                    p.mul_(1.5)  # a different policy
            gen._policy_version = 1  # what a sync taken here would set

    batch = gen.generate(PROMPTS, samples_per_prompt=2, max_new_tokens=8, between_steps=between_steps)
    assert batch.completion_ids_BC.shape[1] == 8  # no stop tokens: every completion runs to the limit
    assert batch.token_version_BC.tolist() == [[0] * 4 + [1] * 4] * batch.num_sequences
    assert batch.policy_version_B.tolist() == [0] * batch.num_sequences  # its oldest token's version
    gen.model.load_state_dict(old)
    recomputed = build_trainer(str(tiny_model_dir), temperature=0.7)
    recomputed.setup()
    old_logprobs = recomputed.compute_logprobs(batch)
    torch.testing.assert_close(batch.behavior_logprobs_BC[:, :4], old_logprobs[:, :4], atol=1e-5, rtol=1e-5)
    assert (batch.behavior_logprobs_BC[:, 4:] - old_logprobs[:, 4:]).abs().max() > 1e-2


def test_draw_tokens_follows_the_distribution():
    """10 000 draws from [0.5, 0, 0.3, 0.2] and as many from a second row: each token's share within
    0.015 of its probability, the zero-probability one never drawn, each draw's log-prob its token's.
    Blocks of 3 entries (the vocabulary padded to 6) exercise both levels and a padded last block."""
    torch.manual_seed(0)
    probs = torch.tensor([[0.5, 0.0, 0.3, 0.2], [0.2, 0.3, 0.0, 0.5]])
    scaled = (probs.log() + torch.tensor([[1.5], [-3.0]])).repeat(10_000, 1)  # softmax ignores a shift
    tokens, logprobs = draw_tokens(scaled, block=3)
    torch.testing.assert_close(logprobs, probs.repeat(10_000, 1).log().gather(1, tokens[:, None])[:, 0])
    tokens = tokens.view(10_000, 2)
    for row in range(2):
        shares = torch.bincount(tokens[:, row], minlength=4).float() / 10_000
        torch.testing.assert_close(shares, probs[row], rtol=0, atol=0.015)
        assert shares[probs[row] == 0].item() == 0


def test_draw_tokens_never_draws_a_token_of_zero_probability_at_a_block_edge():
    """Rows whose every block but one holds no weight and whose weight sits first in its block: a draw
    at the far end of the block must not spill onto the zero-weight entries after it."""
    torch.manual_seed(1)
    scaled = torch.full((5_000, 64), -float("inf"))
    scaled[:, 17] = 0.0  # block 1 of 16 entries: only its second entry can be drawn
    scaled[::2, 40] = -30.0  # a tiny weight in block 2 for half the rows
    tokens, logprobs = draw_tokens(scaled, block=16)
    assert set(tokens.tolist()) <= {17, 40}
    assert torch.isfinite(logprobs).all()


def test_draw_tokens_refuses_nan_logits():
    with pytest.raises(ValueError, match="logits hold NaN or infinite values"):
        draw_tokens(torch.tensor([[0.0, float("nan")], [-0.7, -0.7]]))


# ---------------------------------------------------------------------------------------------------------
# In-flight syncs over llamarl.comm: pulled into staging while decoding goes on, swapped between two steps.


def _perturbed(model_dir: str, dtype: torch.dtype, versions: int) -> dict[str, torch.Tensor]:
    """The weights the trainer sends as `versions`: the checkpoint plus `versions` seeded steps (the same
    on both ranks, to the bit)."""
    from llamarl.exec.models import load_model_and_tokenizer

    model, _ = load_model_and_tokenizer(
        model_dir, dtype=str(dtype).split(".")[-1], device="cpu", with_tokenizer=False
    )
    weights = {name: p.detach() for name, p in model.named_parameters()}
    for version in range(1, versions + 1):
        g = torch.Generator().manual_seed(version)
        for t in weights.values():
            t.add_(torch.randn(t.shape, generator=g).to(dtype) * 0.5)
    return weights


def _in_flight_ranks(rank: int, world_size: int, rdv, model_dir: str, dtype_name: str) -> dict | None:
    from llamarl.comm import WeightSender, WeightSyncEndpoint, WeightSyncError, WeightSyncGroup
    from llamarl.comm.testing import wait_until

    dtype = getattr(torch, dtype_name)
    endpoint = WeightSyncEndpoint(host=rdv.host, port=rdv.port, rank=rank, world_size=2, timeout_s=20)
    if rank == 0:  # the trainer: versions 1 and 2 in flight (each once told "go"), 3 between generates
        group = WeightSyncGroup(endpoint)
        weights = _perturbed(model_dir, dtype, 0)
        sender = WeightSender(group, weights)
        for version in (1, 2, 3):
            group.get(f"test/go/{version}", peer=1)
            for t, w in zip(weights.values(), _perturbed(model_dir, dtype, version).values(), strict=True):
                t.copy_(w)  # in place: what the sender reads
            sender.send(version)
        group.get("test/done", peer=1)
        group.close()
        return None

    from llamarl.exec.generate.packed_linear import PackedLinear

    repacks = []  # every packing of a weight on the decoding thread (the swap must cause none)
    repack = PackedLinear.repack
    PackedLinear.repack = lambda self: (repacks.append(1), repack(self))[1]  # (this process only)
    gen = HFGenerator(model_dir, SamplingConfig(temperature=0.7), seed=0, eos_token_ids=[], dtype=dtype_name)
    gen.setup()
    gen.connect_weight_sync(endpoint)
    group = gen._weights.group
    out: dict = {"packed_layers": len(gen._weights._packed_layers)}

    def generate_with_sync(version: int) -> dict:
        """A generate that takes `version` in flight after its 3rd step; the trainer sends at the 4th."""
        seen: dict = {"steps": 0}

        def between_steps() -> None:
            seen["steps"] += 1
            if seen["steps"] == 3:
                start = time.perf_counter()
                seen["returned"] = gen.receive_weights(30.0)
                seen["receive_call_s"] = time.perf_counter() - start
                # Decoding now runs on the second buffer, which must hold the version served.
                expected = _perturbed(model_dir, dtype, version - 1)
                seen["serving_the_old_weights"] = all(
                    torch.equal(p, expected[n]) for n, p in gen.model.named_parameters()
                )
            if seen["steps"] == 4:  # the steps go on while the sync arrives
                group.put(f"test/go/{version}", True)
                wait_until(gen._weights.ready, timeout_s=30, what="the pull")
                seen["repacks_before_swap"] = len(repacks)
            if seen["steps"] == 7:  # two forward passes after the swap (at the 5th step's boundary)
                seen["repacks_after_swap"] = len(repacks)

        batch = gen.generate(PROMPTS, samples_per_prompt=2, max_new_tokens=10, between_steps=between_steps)
        expected = _perturbed(model_dir, dtype, version)
        seen["versions"] = batch.token_version_BC[0].tolist()
        seen["policy_version"] = gen.policy_version
        seen["weights_now"] = all(torch.equal(p, expected[n]) for n, p in gen.model.named_parameters())
        seen["pull_s"], seen["swap_s"] = gen._weights.last_pull_s, gen._weights.last_swap_s
        # The packed layers compute with the new weights (no stale oneDNN copy): the same logits as a
        # plain forward of the same weights.
        reference = HFGenerator(model_dir, SamplingConfig(temperature=0.7), dtype=dtype_name)
        reference.setup()
        with torch.no_grad():
            for n, p in reference.model.named_parameters():
                p.copy_(expected[n])
            ids = torch.tensor([PROMPTS[2]])
            seen["logits_match"] = torch.allclose(
                gen.model(ids).logits, reference.model(ids).logits, atol=1e-3, rtol=1e-3
            )
        return seen

    out["first"] = generate_with_sync(1)
    out["second"] = generate_with_sync(2)  # the second buffer was refreshed after the first swap
    group.put("test/go/3", True)
    out["lock_step"] = gen.receive_weights(30.0)
    out["lock_step_weights"] = all(
        torch.equal(p, _perturbed(model_dir, dtype, 3)[n]) for n, p in gen.model.named_parameters()
    )

    def never_sent() -> None:  # a sync the trainer never sends: its pull times out
        if not gen._weights.pulling and gen.policy_version == 3:
            gen.receive_weights(timeout_s=1.0)

    try:
        gen.generate(PROMPTS, samples_per_prompt=1, max_new_tokens=4, between_steps=never_sent)
        out["failed"] = None
    except WeightSyncError as exc:
        out["failed"] = str(exc)
    out["version_after_failure"] = gen.policy_version
    out["weights_after_failure"] = all(
        torch.equal(p, _perturbed(model_dir, dtype, 3)[n]) for n, p in gen.model.named_parameters()
    )
    after = gen.generate(PROMPTS, samples_per_prompt=1, max_new_tokens=3)
    out["versions_after_failure"] = sorted(set(after.token_version_BC.flatten().tolist()))
    group.put("test/done", True)
    time.sleep(0.2)  # the trainer reads "done" before this rank leaves the store it hosts
    gen.close()
    return out


@pytest.mark.timeout(240)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_in_flight_sync_is_pulled_while_decoding_goes_on_and_swapped_between_two_steps(
    tiny_model_dir, dtype
):
    """Pull before pause in the hf generator: `receive_weights` from `between_steps` returns at once,
    decoding goes on (on the second buffer, which holds the weights served), the sync is swapped in at
    the first step boundary after it is whole (tokens 0-4 from the old version, 5+ from the new) by a
    pointer swap, and the model (its packed linears too, in bf16) computes with the new weights. A
    second in-flight sync finds the second buffer refreshed; a sync between generates lands in place;
    a sync that fails in flight fails the generate and leaves the weights served as they were."""
    from llamarl.comm.testing import run_distributed

    _, out = run_distributed(_in_flight_ranks, 2, str(tiny_model_dir), dtype, timeout_s=200)
    for version, seen in ((1, out["first"]), (2, out["second"])):
        assert seen["returned"] == version - 1  # at once, with the version still served
        assert seen["serving_the_old_weights"], version
        assert seen["versions"] == [version - 1] * 5 + [version] * 5, seen["versions"]
        assert seen["policy_version"] == version and seen["weights_now"] and seen["logits_match"]
        assert seen["swap_s"] < 0.05 and seen["pull_s"] > 0, seen
        assert seen["repacks_after_swap"] == seen["repacks_before_swap"]  # packed on the pull's thread
    if dtype == "bfloat16":  # (oneDNN packs bf16 linears on this CPU; float32 packing may be refused)
        assert out["packed_layers"] > 0
    assert out["lock_step"] == 3 and out["lock_step_weights"]
    assert out["failed"] is not None
    assert out["version_after_failure"] == 3 and out["weights_after_failure"]
    assert out["versions_after_failure"] == [3]
