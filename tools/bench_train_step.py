"""Times one trainer step on SmolLM2-135M-Instruct at the apps' default shape, with and without sharing
each prompt's forward across its group of samples.

    uv run tools/bench_train_step.py [--threads 2] [--prompts 4] [--samples 4] [--completion-len 128]

Prompts are real GSM8K questions in the chat template; completions are random tokens of a fixed length
(the cost of a training pass does not depend on what the tokens say).
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path

import torch

from llamarl.exec import PolicyTrainer, TrainerConfig, smollm2_path
from llamarl.exec.types import RolloutBatch

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "gsm8k" / "test.jsonl"


def make_batch(tokenizer, *, prompts: int, samples: int, completion_len: int) -> RolloutBatch:
    rows = [json.loads(line) for line in DATA.read_text().splitlines()[:prompts]]
    ids = [
        list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": r["question"]}],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=True,
            )["input_ids"]
        )
        for r in rows
    ]
    width = max(map(len, ids))
    prompt_ids = torch.tensor([[0] * (width - len(p)) + p for p in ids for _ in range(samples)])
    prompt_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ids for _ in range(samples)])
    num = prompts * samples
    g = torch.Generator().manual_seed(0)
    return RolloutBatch(
        prompt_ids_BP=prompt_ids,
        prompt_mask_BP=prompt_mask,
        completion_ids_BC=torch.randint(0, len(tokenizer), (num, completion_len), generator=g),
        completion_mask_BC=torch.ones(num, completion_len, dtype=torch.int64),
        behavior_logprobs_BC=torch.full((num, completion_len), -2.0),
        rewards_B=torch.rand(num, generator=g).round(),
        policy_version_B=torch.zeros(num, dtype=torch.int64),
        group_size=samples,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--completion-len", type=int, default=128)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    model = str(smollm2_path())
    batch = make_batch(
        AutoTokenizer.from_pretrained(model),
        prompts=args.prompts,
        samples=args.samples,
        completion_len=args.completion_len,
    )
    tokens = batch.num_completion_tokens + int(batch.prompt_mask_BP.sum())
    print(
        f"batch: {batch.num_sequences} sequences, prompt {batch.prompt_ids_BP.shape[1]} + completion "
        f"{args.completion_len} tokens ({tokens} tokens), {args.threads} threads"
    )
    for share in (False, True):
        trainer = PolicyTrainer(
            TrainerConfig(model=model, micro_batch_size=args.micro_batch_size, share_prompts=share)
        )
        trainer.setup()
        trainer.train_step(batch)  # warm-up: allocator, optimizer state
        start = time.perf_counter()
        for _ in range(args.repeats):
            trainer.train_step(batch)
        seconds = (time.perf_counter() - start) / args.repeats
        peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(
            f"share_prompts={share!s:5}  {seconds:6.1f} s/step  {batch.num_completion_tokens / seconds:6.1f} "
            f"completion tokens/s  (process peak RSS so far {peak_mb:.0f} MB)"
        )
        trainer.close()


if __name__ == "__main__":
    main()
