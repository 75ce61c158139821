"""The real SmolLM2-135M-Instruct: GGUF conversion, chat template, greedy answer, log-prob agreement."""

from __future__ import annotations

import pytest
import torch

from llamarl.exec import HFGenerator, SamplingConfig, smollm2_path
from llamarl.exec.models import load_model_and_tokenizer
from llamarl.exec.testing import build_trainer

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]  # a first conversion takes ~1.5 min


@pytest.fixture(scope="module")
def smollm2_dir():
    return smollm2_path()


def test_converted_folder_is_a_plain_safetensors_model(smollm2_dir):
    assert (smollm2_dir / "model.safetensors").is_file()
    model, tokenizer = load_model_and_tokenizer(smollm2_dir)
    assert getattr(model.config, "quantization_config", None) is None
    assert model.config.num_hidden_layers == 30 and model.config.vocab_size == 49152
    assert tokenizer.padding_side == "left" and tokenizer.chat_template
    assert smollm2_path() == smollm2_dir  # converted once: a second call returns the cached folder


def test_greedy_answers_with_the_chat_template(smollm2_dir, shared_rows):
    _, tokenizer = load_model_and_tokenizer(smollm2_dir, with_tokenizer=True)
    question = shared_rows("gsm8k/test.jsonl", 1)[0]["question"]
    chats = [
        [{"role": "user", "content": question}],
        [{"role": "user", "content": "What is 2+3? Answer briefly."}],
    ]
    prompts = [tokenizer.apply_chat_template(c, add_generation_prompt=True, return_dict=False) for c in chats]
    gen = HFGenerator(str(smollm2_dir), SamplingConfig())
    gen.setup()
    assert gen.eos_token_ids == [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    batch = gen.generate(prompts, samples_per_prompt=1, max_new_tokens=12, greedy=True)
    texts = tokenizer.batch_decode(
        [
            ids[mask.bool()]
            for ids, mask in zip(batch.completion_ids_BC, batch.completion_mask_BC, strict=True)
        ],
        skip_special_tokens=True,
    )
    assert len(texts[0].split()) >= 3, texts  # words about the question, not noise
    assert "5" in texts[1], texts  # the short prompt is left-padded in this batch and still answered
    # On the real model too, the behaviour log-probs are the trainer's log-probs of the same tokens.
    sampled = gen.generate(prompts, samples_per_prompt=2, max_new_tokens=8)
    trainer = build_trainer(str(smollm2_dir))
    trainer.setup()
    torch.testing.assert_close(
        trainer.compute_logprobs(sampled), sampled.behavior_logprobs_BC, atol=2e-4, rtol=1e-4
    )
