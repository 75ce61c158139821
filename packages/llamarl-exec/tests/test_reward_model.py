"""The reward-model executors on tiny models built from a config, with SmolLM2's real tokenizer (local).

A score must be the model's own forward pass on the sample's text, whatever else shares its batch; a
NaN costs its sample (scored 0, counted) with a line naming the sample, and never reaches the reward.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from llamarl.exec import (
    LLMJudge,
    RewardModelConfig,
    RewardModelError,
    RewardModelScorer,
    build_model_rewarder,
    smollm2_path,
    tiny_model,
    tiny_reward_model,
)
from llamarl.exec.reward.model import combine_rewards

QUESTIONS = ["What is 2 + 3?", "Add 4 and 4.", "How much is 9 plus 1?", "Compute 7 + 0."]
COMPLETIONS = ["5", "The sum of 4 and 4 is 8, so the answer is 8.", "It is 11.", "7 + 0 = 7"]
REFERENCES = ["5", "8", "10", "7"]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(smollm2_path())


@pytest.fixture(scope="module")
def classifier_dir(tmp_path_factory, tokenizer) -> Path:
    path = tmp_path_factory.mktemp("tiny_rm")
    model = tiny_reward_model(len(tokenizer), pad_token_id=tokenizer.pad_token_id, seed=1)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory, tokenizer) -> Path:
    path = tmp_path_factory.mktemp("tiny_judge")
    model = tiny_model(
        len(tokenizer), pad_token_id=tokenizer.pad_token_id, max_position_embeddings=512, seed=2
    )
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_classifier_scores_are_the_models_own_forward_on_each_text(classifier_dir):
    # batch_size 3: the four samples go as a padded batch of 3 and a batch of 1.
    config = RewardModelConfig(path=str(classifier_dir), batch_size=3)
    with RewardModelScorer(config) as scorer:
        scores = scorer.score(QUESTIONS, COMPLETIONS, REFERENCES)
        texts = scorer.texts(QUESTIONS, COMPLETIONS, REFERENCES)
    assert texts[0].startswith("<|im_start|>") and COMPLETIONS[1] in texts[1]  # through the chat template
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(classifier_dir).eval()
    tok = AutoTokenizer.from_pretrained(classifier_dir)
    with torch.inference_mode():
        expected = [
            float(model(**tok(text, return_tensors="pt", add_special_tokens=False)).logits[0, 0])
            for text in texts
        ]
    assert scores == pytest.approx(expected, abs=1e-5)
    assert len(set(scores)) == len(scores)  # a random model still tells the texts apart
    # squash: the same logits through a sigmoid
    squashed = RewardModelScorer(config.model_copy(update={"squash": True})).score(
        QUESTIONS, COMPLETIONS, REFERENCES
    )
    assert squashed == pytest.approx(torch.sigmoid(torch.tensor(expected)).tolist(), abs=1e-6)


def test_a_nan_score_costs_its_sample_with_one_line_naming_it(tmp_path, classifier_dir, tokenizer, caplog):
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(classifier_dir)
    # A token only the third completion contains ("11") gets a NaN embedding: only that sample breaks.
    poisoned = tokenizer.encode("11", add_special_tokens=False)
    assert all(
        t not in tokenizer.encode(c, add_special_tokens=False) for c in COMPLETIONS[:2] for t in poisoned
    )
    with torch.no_grad():
        model.get_input_embeddings().weight[poisoned] = float("nan")
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    scorer = RewardModelScorer(RewardModelConfig(path=str(tmp_path)))
    clean = RewardModelScorer(RewardModelConfig(path=str(classifier_dir))).score(
        QUESTIONS, COMPLETIONS, REFERENCES
    )
    with caplog.at_level(logging.WARNING, logger="llamarl.exec.reward.model"):
        scores = scorer.score(QUESTIONS, COMPLETIONS, REFERENCES)
    # Only the poisoned sample is lost; the others keep the model's own score.
    assert scores[2] == 0.0 and scores[:2] + scores[3:] == pytest.approx(clean[:2] + clean[3:], abs=1e-5)
    assert scorer.num_failures == 1
    [message] = [r.getMessage() for r in caplog.records]
    assert "\n" not in message
    assert "scored sample 2 nan, not a finite number" in message and "How much is 9 plus 1?" in message, (
        message
    )


def test_a_classifier_must_have_one_label(tmp_path, tokenizer):
    from transformers import LlamaForSequenceClassification

    config = tiny_reward_model(len(tokenizer), pad_token_id=tokenizer.pad_token_id).config
    config.num_labels = 2
    LlamaForSequenceClassification(config).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    with pytest.raises(RewardModelError, match="has 2 labels"):
        RewardModelScorer(RewardModelConfig(path=str(tmp_path))).setup()


def test_judge_scores_p_yes_of_its_own_next_token(judge_dir):
    config = RewardModelConfig(path=str(judge_dir), kind="judge", batch_size=4)
    judge = build_model_rewarder(config)
    assert isinstance(judge, LLMJudge)
    scores = judge.score(QUESTIONS, COMPLETIONS, REFERENCES)
    texts = judge.texts(QUESTIONS, COMPLETIONS, REFERENCES)
    assert "Reference answer: 10" in texts[2] and texts[2].endswith("<|im_start|>assistant\n")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(judge_dir).eval()
    tok = AutoTokenizer.from_pretrained(judge_dir)
    yes, no = tok.encode("yes", add_special_tokens=False)[0], tok.encode("no", add_special_tokens=False)[0]
    expected = []
    with torch.inference_mode():
        for text in texts:  # one at a time: no padding
            logits = model(**tok(text, return_tensors="pt", add_special_tokens=False)).logits[0, -1]
            expected.append(float(torch.softmax(logits[[yes, no]], -1)[0]))
    assert scores == pytest.approx(expected, abs=1e-5)
    assert all(0.0 < s < 1.0 for s in scores)


def test_rule_and_model_rewards_combine_with_their_weights():
    config = RewardModelConfig(path="unused", weight=0.5, rule_weight=2.0)
    combined = combine_rewards(torch.tensor([1.0, 0.0]), torch.tensor([-2.0, 4.0]), config)
    assert combined.dtype == torch.float32 and combined.tolist() == [1.0, 2.0]


def test_a_reference_guided_classifier_reads_the_reference_after_the_question(classifier_dir):
    scorer = RewardModelScorer(RewardModelConfig(path=str(classifier_dir), with_reference=True))
    with scorer:
        texts = scorer.texts(QUESTIONS, COMPLETIONS, REFERENCES)
    assert "How much is 9 plus 1?\n\nReference answer: 10" in texts[2]
