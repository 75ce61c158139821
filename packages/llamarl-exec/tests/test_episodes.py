"""Multi-turn episodes with a real transformers model and SmolLM2's chat template: token-in/token-out
across turns, environment tokens masked out of the loss yet fed to the trainer, behaviour log-probs
equal to the trainer's across turns, limits, a broken environment dropped."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from llamarl.exec.config import SamplingConfig
from llamarl.exec.generate.hf import HFGenerator
from llamarl.exec.multiturn.episodes import ChatGlue, Episode, EpisodeLimits, episodes_to_batch, run_episodes
from llamarl.exec.testing import FeedbackEnvironment, build_trainer, save_tiny_chat_model

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def chat_model_dir(tmp_path_factory) -> Path:
    """A 2-layer random Llama with SmolLM2's real tokenizer and chat template."""
    return save_tiny_chat_model(tmp_path_factory.mktemp("chat_model"))


@pytest.fixture(scope="module")
def tokenizer(chat_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(chat_model_dir)


def _episodes(tokenizer, rows: list[dict], group_size: int) -> list[Episode]:
    episodes = []
    for g, row in enumerate(rows):
        messages = [{"role": "user", "content": f"Question {g}?"}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        for _ in range(group_size):
            episodes.append(
                Episode(group=g, row=row, prompt_ids=ids, prompt_messages=messages, env=FeedbackEnvironment())
            )
    return episodes


def test_the_glue_lays_the_environment_reply_as_the_template_does(tokenizer):
    glue = ChatGlue(tokenizer)
    reply = [{"role": "tool", "content": "42"}]
    ids = glue.reply_ids(reply, ended_with_eos=True)
    assert tokenizer.decode(ids) == "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"
    # A turn cut at its token limit never wrote its end-of-turn token: the environment's part adds it.
    cut = glue.reply_ids(reply, ended_with_eos=False)
    assert tokenizer.decode(cut).startswith("<|im_end|>\n<|im_start|>tool")
    # Laid after a whole conversation, it is the template's own rendering, token for token.
    history = [{"role": "user", "content": "Q?"}, {"role": "assistant", "content": "A"}]
    prefix = tokenizer.apply_chat_template(history[:1], add_generation_prompt=True, tokenize=False)
    model_turn = tokenizer("A", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    laid = tokenizer(prefix, add_special_tokens=False)["input_ids"] + model_turn + ids
    rendered = tokenizer.apply_chat_template([*history, *reply], add_generation_prompt=True, tokenize=False)
    assert laid == tokenizer(rendered, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("pack_tokens", [2048, 0])
def test_episodes_are_token_in_token_out_and_train_on_model_tokens_only(
    chat_model_dir, tokenizer, pack_tokens
):
    torch.manual_seed(0)
    generator = HFGenerator(str(chat_model_dir), SamplingConfig(temperature=1.0), seed=0)
    generator.setup()
    rows = [{"turns": 3}, {"turns": 2}]
    episodes = _episodes(tokenizer, rows, group_size=2)
    limits = EpisodeLimits(max_turns=4, max_new_tokens=6, max_episode_tokens=200)
    session = generator.open_turns()
    run_episodes(episodes, session, tokenizer=tokenizer, glue=ChatGlue(tokenizer), limits=limits)
    assert [e.turns for e in episodes] == [3, 3, 2, 2]
    assert all(e.finished and e.reward == 1.0 and not e.dropped for e in episodes)
    batch = episodes_to_batch(episodes, group_size=2, pad_token_id=generator.pad_token_id, policy_version=0)
    for b, e in enumerate(episodes):
        # Model turns and replies alternate, ending with a model turn; the replies say what the
        # environment said, the model's tokens are those sampled (never re-tokenised).
        mask = batch.completion_mask_BC[b, : len(e.ids)].tolist()
        runs = [mask[0]] + [m for prev, m in itertools.pairwise(mask) if m != prev]
        assert runs == [1, 0, 1, 0, 1][: 2 * e.turns - 1] and mask[-1] == 1
        env_text = tokenizer.decode([t for t, m in zip(e.ids, e.mask, strict=True) if not m])
        assert "Try again (1)." in env_text and "<|im_start|>assistant" in env_text
        assert (batch.behavior_logprobs_BC[b][batch.completion_mask_BC[b] == 0] == 0).all()
        assert (batch.token_version_BC[b][batch.completion_mask_BC[b] == 0] == 0).all()

    trainer = build_trainer(str(chat_model_dir), lr=0.0, pack_tokens=pack_tokens, micro_batch_size=2, seed=0)
    trainer.setup()
    mask_BC = batch.completion_mask_BC.bool()
    # The trainer sees the environment's tokens as input: its log-probs of the model's tokens, in every
    # turn, are the behaviour log-probs the generator recorded (same weights).
    logprobs_BC = trainer.compute_logprobs(batch)
    torch.testing.assert_close(logprobs_BC[mask_BC], batch.behavior_logprobs_BC[mask_BC], atol=2e-4, rtol=0)

    # Environment tokens get no gradient: the loss's gradient w.r.t. their log-probs is zero.
    batch.rewards_B = torch.tensor([1.0, 0.0, 0.0, 1.0])
    advantages_B = trainer.advantage_fn(batch.rewards_B, batch.group_size)
    for rows in trainer.forward.micro_batches(batch):
        logprobs_MC, _, loss_mask_MC = trainer.forward.logprobs(
            trainer.model, batch, rows, torch.device("cpu")
        )
        logprobs_MC.retain_grad()
        length = loss_mask_MC.shape[1]
        loss, _ = trainer.loss_fn(
            logprobs_MC,
            batch.behavior_logprobs_BC[rows, :length],
            advantages_B[rows],
            loss_mask_MC,
            num_valid_tokens=int(mask_BC.sum()),
            num_sequences=batch.num_sequences,
        )
        loss.backward()
        grad_MC = logprobs_MC.grad
        env_MC = (loss_mask_MC == 0) & (
            torch.arange(length)[None, :] < torch.tensor([len(e.ids) for e in episodes])[rows, None]
        )
        assert env_MC.any()
        assert (grad_MC[env_MC] == 0).all()
        assert (grad_MC[loss_mask_MC.bool()] != 0).any()
    generator.close()
    trainer.close()


def test_limits_and_a_broken_environment(chat_model_dir, tokenizer):
    generator = HFGenerator(str(chat_model_dir), SamplingConfig(), seed=1)
    generator.setup()
    episodes = _episodes(tokenizer, [{"turns": 10}, {"broken": True}], group_size=2)
    limits = EpisodeLimits(max_turns=2, max_new_tokens=5, max_episode_tokens=60)
    run_episodes(
        episodes, generator.open_turns(), tokenizer=tokenizer, glue=ChatGlue(tokenizer), limits=limits
    )
    for e in episodes[:2]:  # cut at the turn limit, never finished by the environment
        assert e.turns == 2 and not e.finished and e.reward is None and not e.dropped
        assert len(e.ids) <= 60
    for e in episodes[2:]:  # the environment raised: dropped, nothing left to train on
        assert e.dropped and "RuntimeError: environment bug" in e.error and e.ids == []
    batch = episodes_to_batch(episodes, group_size=2, pad_token_id=generator.pad_token_id, policy_version=0)
    assert batch.completion_mask_BC[2:].sum() == 0
    short = EpisodeLimits(max_turns=5, max_new_tokens=5, max_episode_tokens=12)
    episodes = _episodes(tokenizer, [{"turns": 10}], group_size=1)
    run_episodes(
        episodes, generator.open_turns(), tokenizer=tokenizer, glue=ChatGlue(tokenizer), limits=short
    )
    assert len(episodes[0].ids) <= 12 and episodes[0].mask[-1] == 1  # the token limit, ending on a model turn
    generator.close()


def test_an_environment_reward_that_is_not_a_finite_number_drops_its_episode(chat_model_dir, tokenizer):
    generator = HFGenerator(str(chat_model_dir), SamplingConfig(), seed=1)
    generator.setup()
    rows = [{"turns": 1, "reward": float("nan")}, {"turns": 1, "reward": "1"}, {"turns": 1, "reward": 0.5}]
    episodes = _episodes(tokenizer, rows, group_size=1)
    limits = EpisodeLimits(max_turns=2, max_new_tokens=4, max_episode_tokens=60)
    run_episodes(
        episodes, generator.open_turns(), tokenizer=tokenizer, glue=ChatGlue(tokenizer), limits=limits
    )
    nan, text, fine = episodes
    assert nan.dropped and nan.error == "environment step() returned Finish(reward=nan), not a finite number"
    assert (
        text.dropped and text.error == "environment step() returned Finish(reward='1'), not a finite number"
    )
    assert nan.ids == [] and text.ids == []  # nothing of them is trained on
    assert fine.finished and fine.reward == 0.5 and not fine.dropped
    generator.close()
