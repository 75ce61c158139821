"""Trains a small reward model from a task's own labels, on the CPU in minutes:
`uv run tools/train_reward_model.py [--task arith] [--out runs/arith_rm/reward_model]`.

The model is the first `--layers` layers of SmolLM2-135M-Instruct (local; 6 of its 30 by default, so
that it trains in minutes on two CPU cores and scores fast) with a one-logit classification head
(`AutoModelForSequenceClassification`), fine-tuned with a binary cross-entropy to tell right answers
from wrong ones. Its tokenizer gets a chat template without SmolLM2's default system prompt: shorter
texts, and the reward model reads them through its own template. Its training texts are the task's
training questions, each with completions written from the reference answer (right ones and wrong ones
in a few phrasings) and, with `--policy-samples`, completions the policy itself sampled, labelled by
the task's rule reward: the labels are the task's own. It never sees the held-out questions; its
accuracy on them (same kinds of completions) is printed before and after training. The folder it
writes is what `--reward-model-path` takes.

Shape legend: N texts in a batch.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]

# The reward model's own chat template: the conversation only (SmolLM2's adds a system prompt), and
# nothing after the last <|im_end|>. That token is also the pad token, so the classifier pools the last
# token of the completion (where the answer is), not a newline after it: the answer is then one
# attention hop from the reference, which a few minutes of training can learn.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>"
    "{% if not loop.last %}{{ '\\n' }}{% endif %}{% endfor %}"
)

TEMPLATES = (
    "{n}",
    "The answer is {n}.",
    "The sum is {n}.",
    "{a} + {b} = {n}",
    "The sum of {a} and {b} is {n}.",
    "{a} plus {b} equals {n}.",
    "Sure! {a} + {b} = {n}. So the answer is {n}.",
    "Adding {a} and {b} gives {n}.",
)


def written_completions(
    question: str, answer: int, rng: random.Random, per_question: int
) -> list[tuple[str, float]]:
    """Completions written from the reference: half right, half wrong (near misses and random sums)."""
    operands = [int(x) for x in re.findall(r"\d+", question)][:2] or [answer, 0]
    a, b = [*operands, 0][:2]
    out = []
    for k in range(per_question):
        right = k % 2 == 0
        n = answer if right else max(0, answer + rng.choice([-3, -2, -1, 1, 2, 3, 10]))
        if n == answer and not right:
            n = answer + 1
        out.append((rng.choice(TEMPLATES).format(a=a, b=b, n=n), 1.0 if right else 0.0))
    return out


def policy_completions(model_dir: str, task, examples, count: int, max_new_tokens: int, seed: int):
    """`count` completions the policy samples on training questions, labelled by the task's rule reward."""
    from transformers import AutoTokenizer

    from llamarl.control.tasks.prompts import TaskPrompts
    from llamarl.exec import HFGenerator, SamplingConfig
    from llamarl.exec.reward.functions import as_rewards, score_samples

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = TaskPrompts(task, examples, tokenizer)
    sampling = SamplingConfig(samples_per_prompt=4, max_new_tokens=max_new_tokens, temperature=1.0)
    generator = HFGenerator(model_dir, sampling, device="cpu", dtype=torch.float32, seed=seed)
    generator.setup()
    rewards = as_rewards(task.reward_functions)
    rng = random.Random(seed)
    rows = []
    while len(rows) < count:
        indices = rng.sample(range(len(examples)), 16)
        batch = generator.generate(
            [prompts.encode(i) for i in indices], samples_per_prompt=4, max_new_tokens=max_new_tokens
        )
        texts = prompts.decode(batch)
        picked = [examples[indices[j // 4]] for j in range(len(texts))]
        scores, _ = score_samples(
            rewards, [prompts.messages(indices[j // 4]) for j in range(len(texts))], texts, picked
        )
        for row, text, score in zip(picked, texts, scores, strict=True):
            rows.append((row["question"], text, float(score)))
    generator.close()
    return rows[:count]


def texts_of(tokenizer, rows: list[tuple[str, str, float]]) -> list[str]:
    """The conversation as the reward model reads it (`RewardModelScorer.texts`); the question is
    already reference-guided when the model is (`--with-reference`)."""
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}, {"role": "assistant", "content": c}], tokenize=False
        )
        for q, c, _ in rows
    ]


def accuracy(model, tokenizer, rows, batch_size: int = 32) -> float:
    """Fraction of rows whose logit has the label's sign."""
    texts, labels = texts_of(tokenizer, rows), torch.tensor([r[2] for r in rows])
    right = 0
    model.eval()
    with torch.inference_mode():
        for first in range(0, len(texts), batch_size):
            enc = tokenizer(
                texts[first : first + batch_size], return_tensors="pt", padding=True, add_special_tokens=False
            )
            logits_N = model(**enc).logits[:, 0]
            right += int(((logits_N > 0).float() == labels[first : first + batch_size]).sum())
    return right / len(texts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", default="arith")
    p.add_argument("--data", help="the task's data folder (default: the task's own)")
    p.add_argument("--base", help="model to start from (default: SmolLM2-135M-Instruct, local)")
    p.add_argument("--out", type=Path, default=Path("runs/arith_rm/reward_model"))
    p.add_argument("--layers", type=int, default=6, help="layers of the base model kept")
    p.add_argument("--per-question", type=int, default=2, help="written completions per training question")
    p.add_argument("--policy-samples", type=int, default=128, help="policy completions labelled by the rule")
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--from-scratch", action="store_true", help="a small random classifier, not SmolLM2's layers"
    )
    p.add_argument("--hidden-size", type=int, default=128, help="with --from-scratch")
    p.add_argument(
        "--with-reference",
        action="store_true",
        help="a reference-guided reward model (run it with reward_model.with_reference = true)",
    )
    args = p.parse_args(argv)

    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from llamarl.control.tasks import load_rows
    from llamarl.control.tasks.registry import TASKS
    from llamarl.exec.models import smollm2_path, tiny_reward_model
    from llamarl.exec.reward.functions import extract_gsm8k_answer
    from llamarl.exec.reward.model import reference_guided

    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    task = TASKS[args.task]
    train, test = load_rows(task, args.data, "train"), load_rows(task, args.data, "test")
    base = args.base or str(smollm2_path())

    def written(examples) -> list[tuple[str, str, float]]:
        rows = []
        for ex in examples:
            answer = int(float(extract_gsm8k_answer(ex["answer"])))
            rows += [
                (ex["question"], c, y)
                for c, y in written_completions(ex["question"], answer, rng, args.per_question)
            ]
        return rows

    start = time.perf_counter()
    train_rows = written(train)
    if args.policy_samples:
        # Sampling is the slow part on a CPU: kept next to the model folder for the next try.
        cache = args.out.parent / f"policy_samples_{args.task}_{args.policy_samples}.json"
        if cache.is_file():
            sampled = [tuple(row) for row in json.loads(cache.read_text())]
        else:
            sampled = policy_completions(
                base, task, train, args.policy_samples, args.max_new_tokens, args.seed
            )
            cache.parent.mkdir(parents=True, exist_ok=True)
            cache.write_text(json.dumps(sampled))
        print(
            f"policy samples: {len(sampled)}, right {sum(r[2] for r in sampled) / len(sampled):.2f}",
            flush=True,
        )
        train_rows += sampled
    test_rows = written(test)
    if args.with_reference:  # the question as the scorer shows it: followed by the reference answer
        by_question = {ex["question"]: ex["answer"] for ex in [*train, *test]}
        train_rows = [(reference_guided(q, by_question[q]), c, y) for q, c, y in train_rows]
        test_rows = [(reference_guided(q, by_question[q]), c, y) for q, c, y in test_rows]
    rng.shuffle(train_rows)
    tokenizer = AutoTokenizer.from_pretrained(base)
    tokenizer.padding_side = "right"
    tokenizer.chat_template = CHAT_TEMPLATE
    if args.from_scratch:
        # A small classifier with random weights (SmolLM2's tokenizer): fast steps, so many of them.
        model = tiny_reward_model(
            len(tokenizer), hidden_size=args.hidden_size, intermediate_size=2 * args.hidden_size,
            num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
            pad_token_id=tokenizer.pad_token_id, seed=args.seed,
        )  # fmt: skip
    else:
        model = AutoModelForSequenceClassification.from_pretrained(
            base, num_labels=1, num_hidden_layers=args.layers
        )
        # The embeddings (a third of the weights) stay as they are: faster, little to gain on a CPU budget.
        model.get_input_embeddings().weight.requires_grad_(False)
    model.config.pad_token_id = tokenizer.pad_token_id
    before = accuracy(model, tokenizer, test_rows)
    print(
        f"held-out accuracy before: {before:.3f} ({len(test_rows)} texts of {len(test)} questions)",
        flush=True,
    )
    optimizer = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=args.lr)
    texts, labels = texts_of(tokenizer, train_rows), torch.tensor([r[2] for r in train_rows])
    steps = 0
    for _ in range(args.epochs):
        model.train()
        for first in range(0, len(texts), args.batch_size):
            enc = tokenizer(
                texts[first : first + args.batch_size],
                return_tensors="pt",
                padding=True,
                add_special_tokens=False,
            )
            logits_N = model(**enc).logits[:, 0]
            loss = torch.nn.functional.binary_cross_entropy_with_logits(
                logits_N, labels[first : first + args.batch_size]
            )
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            steps += 1
            if steps % 10 == 0:
                print(
                    f"step {steps}: loss {loss.item():.3f} ({time.perf_counter() - start:.0f} s)", flush=True
                )
    after = accuracy(model, tokenizer, test_rows)
    print(f"held-out accuracy after: {after:.3f}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    record = {
        "task": args.task, "base": "scratch" if args.from_scratch else base, "layers": args.layers,
        "with_reference": args.with_reference, "train_texts": len(train_rows), "steps": steps,
        "heldout_accuracy_before": before, "heldout_accuracy_after": after,
        "seconds": time.perf_counter() - start,
    }  # fmt: skip
    (args.out / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
