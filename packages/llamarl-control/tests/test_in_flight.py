"""A request paused in flight and continued (`InFlightRequest`), on the real HF generator and a tiny model.

Greedy decoding makes the check exact: a request paused after a few decoding steps, saved the way a
checkpoint saves it (torch.save), loaded and continued from `prompt + partial completion`, must end with
the tokens of the same request run in one go, every token keeping the version that drew it.
"""

from __future__ import annotations

import io
from functools import partial

import pytest
import torch

from llamarl.control.run.in_flight import InFlightRequest
from llamarl.exec import HFGenerator, SamplingConfig
from llamarl.exec.models import tiny_model, tiny_moe_model
from llamarl.exec.types import GenerationPaused, PauseGeneration

pytestmark = pytest.mark.timeout(120)

EOS = 2
PROMPTS = [[1, 5, 9, 13, 17], [1, 7], [1, 3, 4, 30, 31, 32, 33, 8]]
STOPS = [EOS, 50, 51]  # several stop tokens: some completions end early, others run to the limit


@pytest.fixture(scope="module", params=["llama", "qwen3_moe"])
def generator(tmp_path_factory, request):
    """The hf generator of a tiny dense model, or of a tiny mixture of experts (its routes recorded)."""
    path = tmp_path_factory.mktemp("tiny")
    build = tiny_model if request.param == "llama" else partial(tiny_moe_model, request.param)
    build(64, eos_token_id=EOS, pad_token_id=0, seed=0).save_pretrained(path)
    gen = HFGenerator(str(path), SamplingConfig(temperature=0.7), seed=0, eos_token_ids=STOPS)
    gen.setup()
    yield gen
    gen.close()


def paused_after(steps: int, generator: HFGenerator, *, new_version: int | None = None):
    """A between_steps that pauses at decoding step `steps`; with `new_version`, the weights of that
    version arrive at the first step (as an in-flight update: the tokens drawn after it carry it)."""
    calls = 0

    def between_steps() -> None:
        nonlocal calls
        calls += 1
        if calls == 1 and new_version is not None:
            generator._policy_version = new_version  # what a sync taken here would set
        if calls == steps:
            raise PauseGeneration

    return between_steps


def test_a_paused_request_saved_and_continued_ends_as_if_never_paused(generator):
    generator._policy_version = 4  # stands in for a sync of version 4 (read-only from outside)
    whole = generator.generate(PROMPTS, samples_per_prompt=2, max_new_tokens=12, greedy=True)
    with pytest.raises(GenerationPaused) as paused:
        generator.generate(
            PROMPTS, samples_per_prompt=2, max_new_tokens=12, greedy=True,
            between_steps=paused_after(5, generator),
        )  # fmt: skip
    request = InFlightRequest.from_paused(paused.value)
    assert request.num_tokens > 0
    assert request.unfinished, "every completion ended within 4 tokens: the test exercises nothing"
    buffer = io.BytesIO()  # what a checkpoint does with it
    torch.save(request.state(), buffer)
    buffer.seek(0)
    restored = InFlightRequest.from_state(torch.load(buffer))
    continued = restored.resume(generator, max_new_tokens=12, between_steps=None, greedy=True)
    mask = whole.completion_mask_BC.bool()
    assert continued.completion_mask_BC.sum(1).tolist() == whole.completion_mask_BC.sum(1).tolist()
    assert (
        continued.completion_ids_BC[:, : mask.shape[1]][mask].tolist()
        == whole.completion_ids_BC[mask].tolist()
    )
    torch.testing.assert_close(
        continued.behavior_logprobs_BC[:, : mask.shape[1]][mask],
        whole.behavior_logprobs_BC[mask],
        atol=1e-4,
        rtol=0,
    )
    assert torch.equal(continued.prompt_ids_BP, whole.prompt_ids_BP)
    # A mixture of experts' routes went with the tokens through the checkpoint: those the continuation
    # forwarded again (same weights) are the ones the uninterrupted request recorded.
    assert continued.has_routes == whole.has_routes
    if whole.has_routes:
        assert torch.equal(continued.prompt_routes_BPLK, whole.prompt_routes_BPLK)
        routes = continued.completion_routes_BCLK[:, : mask.shape[1]]
        assert torch.equal(routes[mask], whole.completion_routes_BCLK[mask])


def test_a_request_paused_twice_keeps_the_version_of_every_token(generator):
    generator.serve_initial_weights()
    with pytest.raises(GenerationPaused) as paused:
        generator.generate(
            PROMPTS, samples_per_prompt=2, max_new_tokens=12, between_steps=paused_after(3, generator)
        )
    request = InFlightRequest.from_paused(paused.value)
    drawn = paused.value.partial.completion_mask_BC.sum(1)
    # New weights arrive in the continuation (version 1), which is paused again; then version 2.
    with pytest.raises(GenerationPaused):
        request.resume(generator, max_new_tokens=12, between_steps=paused_after(3, generator, new_version=1))
    generator._policy_version = 2  # stands in for a sync of version 2
    batch = request.resume(generator, max_new_tokens=12, between_steps=None)
    mask = batch.completion_mask_BC.bool()
    versions = batch.token_version_BC
    assert (versions.diff(dim=1)[mask[:, 1:]] >= 0).all()  # never back in time within a completion
    for row in range(batch.num_sequences):
        n = int(drawn[row])
        assert (versions[row, :n] == 0).all()  # drawn before the first pause: version 0
        assert batch.policy_version_B[row] == 0  # a sequence's version is its first token's
    assert {0, 1, 2} <= set(versions[mask].tolist())
    assert (batch.completion_mask_BC.sum(1) <= 12).all()
