"""Model rewards: a sequence-classification reward model and an LLM judge, behind one small Protocol.

Both take the question of each sample (the task's prompt text, without the policy's chat template), the
completion text and the reference answer, and return one float per sample:

- `RewardModelScorer` (kind "classifier"): a transformers `AutoModelForSequenceClassification` with one
  label; the text is the conversation [user: question, assistant: completion] through the reward
  model's own chat template (plain "question\\n\\ncompletion" without one), the score its logit (or the
  logit's sigmoid with `squash`). With `with_reference` the user turn also shows the reference answer.
- `LLMJudge` (kind "judge"): a generative model asked whether the answer is right; the score is
  P(yes) / (P(yes) + P(no)) of its next token.

Both implement `llamarl.exec.types.ModelRewarder`. The weights are the model's own: they never come
from the trainer. A score that is NaN or infinite costs its sample what a failing reward function
costs: the model's score is 0 for it, it is counted (`num_failures`) and one line names the model and
the sample; the batch's other samples keep their scores (one NaN would otherwise spread to every
advantage of its group).

Shape legend: N texts in a forward pass, L their padded token length.
"""

from __future__ import annotations

import logging
import math

import torch

from llamarl.exec.config import RewardModelConfig
from llamarl.exec.reward.functions import one_line
from llamarl.exec.types import ModelRewarder

__all__ = [
    "LLMJudge",
    "ModelRewarder",
    "RewardModelError",
    "RewardModelScorer",
    "build_model_rewarder",
    "combine_rewards",
    "reference_guided",
]

log = logging.getLogger(__name__)

JUDGE_PROMPT = (
    "Here is a question and an answer to it.\n\nQuestion: {question}\n\nAnswer: {completion}\n\n"
    "{reference}Is the answer correct? Reply with yes or no."
)


def reference_guided(question: str, reference: str) -> str:
    """The user turn a reference-guided classifier reads (`with_reference`): the question, then the
    reference answer."""
    return f"{question}\n\nReference answer: {reference}"


class RewardModelError(RuntimeError):
    """A reward model that does not fit its kind (a classifier with several labels, a judge without a
    token for yes or no); the message is one line."""


def resolve_device_and_dtype(config: RewardModelConfig, rank_device: str = "cpu") -> tuple[str, torch.dtype]:
    """The reward model's device (its own setting, else the rank's) and dtype (bf16 on CUDA under "auto")."""
    device = rank_device if config.device == "auto" else config.device
    if config.precision == "auto":
        dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    else:
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[config.precision]
    return device, dtype


class _HFScorer:
    """What both kinds share: the model and its tokenizer, the batching and the NaN check."""

    def __init__(self, config: RewardModelConfig, *, device: str = "cpu", dtype: torch.dtype = torch.float32):
        if config.path is None:
            raise ValueError("reward_model.path is unset: no reward model to load")
        self.config = config
        self.device = device
        self.dtype = dtype
        self.model = None
        self.tokenizer = None
        self.num_failures = 0  # samples scored 0 because the model's score was NaN or infinite

    def _load_model(self):
        raise NotImplementedError

    def setup(self) -> None:
        """Loads the model and its tokenizer (local files only: nothing is downloaded at run time)."""
        if self.model is not None:
            return
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(self.config.path)
        # Completions end where the answer is: a text too long loses its start, never its end.
        self.tokenizer.truncation_side = "left"
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = self._load_model().to(self.device).eval()

    def close(self) -> None:
        self.model = None
        self.tokenizer = None

    def __enter__(self):
        self.setup()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _chat(self, messages: list[dict[str, str]], *, generation_prompt: bool) -> str:
        """The conversation through the reward model's chat template (plain text without one)."""
        if self.tokenizer.chat_template:
            return self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=generation_prompt
            )
        return "\n\n".join(m["content"] for m in messages) + ("\n\n" if generation_prompt else "")

    def texts(self, questions: list[str], completions: list[str], references: list[str]) -> list[str]:
        """The text the model reads for each sample."""
        raise NotImplementedError

    def _forward(self, texts: list[str]) -> torch.Tensor:
        """Scores of one batch of texts, float32 [N]."""
        raise NotImplementedError

    def score(self, questions: list[str], completions: list[str], references: list[str]) -> list[float]:
        """One score per sample, in order; 0.0 (counted, reported) for a sample the model scored NaN or
        infinite."""
        if not len(questions) == len(completions) == len(references):
            raise ValueError(
                f"{len(questions)} questions, {len(completions)} completions, {len(references)} references"
            )
        self.setup()
        texts = self.texts(questions, completions, references)
        scores: list[float] = []
        size = self.config.batch_size
        with torch.inference_mode():
            for first in range(0, len(texts), size):
                scores += self._forward(texts[first : first + size]).tolist()
        broken = [i for i, value in enumerate(scores) if not math.isfinite(value)]
        if broken:
            first = broken[0]
            more = f" (and {len(broken) - 1} more samples of this batch)" if len(broken) > 1 else ""
            log.warning(
                "the reward model %s scored sample %d %s, not a finite number (question %r, completion "
                "%r); scored 0%s",
                self.config.path,
                first,
                scores[first],
                one_line(questions[first], 60),
                one_line(completions[first], 60),
                more,
            )
            self.num_failures += len(broken)
            for i in broken:
                scores[i] = 0.0
        return scores


class RewardModelScorer(_HFScorer):
    """A sequence classifier with one label: the score of a sample is its logit (sigmoid with `squash`).

    Texts of a batch are padded on the right and the model pools its last non-pad token, as it does for
    one text alone, so a sample scores the same whatever its batch (`score` equals the model's own
    forward pass on `texts(...)`).
    """

    def _load_model(self):
        from transformers import AutoModelForSequenceClassification

        model = AutoModelForSequenceClassification.from_pretrained(self.config.path, dtype=self.dtype)
        if model.config.num_labels != 1:
            raise RewardModelError(
                f"the reward model {self.config.path} has {model.config.num_labels} labels; a reward model "
                "has one (its logit is the score)"
            )
        if model.config.pad_token_id is None:
            # Batches of more than one text need it to find each text's last token.
            model.config.pad_token_id = self.tokenizer.pad_token_id
        return model

    def texts(self, questions: list[str], completions: list[str], references: list[str]) -> list[str]:
        if self.config.with_reference:
            questions = [reference_guided(q, r) for q, r in zip(questions, references, strict=True)]
        return [
            self._chat(
                [{"role": "user", "content": q}, {"role": "assistant", "content": c}], generation_prompt=False
            )
            for q, c in zip(questions, completions, strict=True)
        ]

    def _forward(self, texts: list[str]) -> torch.Tensor:
        self.tokenizer.padding_side = "right"
        enc = self.tokenizer(
            texts,
            return_tensors="pt",
            padding=True,
            truncation=True,
            max_length=self.config.max_length,
            add_special_tokens=False,  # the chat template wrote them
        ).to(self.device)
        logits_N = self.model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).logits[:, 0]
        logits_N = logits_N.float()
        return torch.sigmoid(logits_N) if self.config.squash else logits_N


class LLMJudge(_HFScorer):
    """A generative model asked "is the answer correct?": score = P(yes) / (P(yes) + P(no)) of the first
    token of its reply (the reference answer is shown to it when the task has one)."""

    def _load_model(self):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(self.config.path, dtype=self.dtype)
        self.yes_id, self.no_id = (self._first_token(word) for word in ("yes", "no"))
        return model

    def _first_token(self, word: str) -> int:
        ids = self.tokenizer.encode(word, add_special_tokens=False)
        if not ids:
            raise RewardModelError(f"the judge's tokenizer has no token for {word!r}")
        return ids[0]

    def texts(self, questions: list[str], completions: list[str], references: list[str]) -> list[str]:
        return [
            self._chat(
                [
                    {
                        "role": "user",
                        "content": JUDGE_PROMPT.format(
                            question=q, completion=c, reference=f"Reference answer: {r}\n\n" if r else ""
                        ),
                    }
                ],
                generation_prompt=True,
            )
            for q, c, r in zip(questions, completions, references, strict=True)
        ]

    def _forward(self, texts: list[str]) -> torch.Tensor:
        # Left padding: every text's next token is read at the last position.
        self.tokenizer.padding_side = "left"
        enc = self.tokenizer(
            texts,
            return_tensors="pt",
            padding=True,
            truncation=True,
            max_length=self.config.max_length,
            add_special_tokens=False,
        ).to(self.device)
        mask_NL = enc["attention_mask"]
        # Positions count real tokens only, so a left-padded text is read as it would be alone.
        position_ids_NL = (mask_NL.cumsum(-1) - 1).clamp(min=0)
        logits_NV = self.model(
            input_ids=enc["input_ids"], attention_mask=mask_NL, position_ids=position_ids_NL
        ).logits[:, -1]
        pair_N2 = logits_NV.float()[:, [self.yes_id, self.no_id]]
        return torch.softmax(pair_N2, dim=-1)[:, 0]


def build_model_rewarder(
    config: RewardModelConfig, *, rank_device: str = "cpu"
) -> RewardModelScorer | LLMJudge:
    """The reward model `config` describes, on its device and in its precision (not set up yet)."""
    device, dtype = resolve_device_and_dtype(config, rank_device)
    kind = RewardModelScorer if config.kind == "classifier" else LLMJudge
    return kind(config, device=device, dtype=dtype)


def combine_rewards(rule_B: torch.Tensor, model_B: torch.Tensor, config: RewardModelConfig) -> torch.Tensor:
    """rule_weight x rule reward + weight x model score, float32 [B]."""
    return (config.rule_weight * rule_B.float() + config.weight * model_B.float()).to(torch.float32)
