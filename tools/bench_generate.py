"""Generation throughput: plain `model.generate`, `HFGenerator` and `VLLMGenerator` on the same batch.

The batch: the first N GSM8K test questions (chat template applied), one sample each, up to 128 new
tokens, plain temperature sampling (T=1, every other knob neutral, as the generators sample). Each
backend gets one short warm-up call (first-call costs: allocator, kernel selection) and then one timed
run; tokens/s counts completion tokens up to and including EOS.

    uv run tools/bench_generate.py                       # SmolLM2-135M-Instruct, 16 x 128, 2 threads
    uv run tools/bench_generate.py --num-prompts 16 --max-new-tokens 128 --threads 2 --skip vllm

The vLLM engine runs in its own environment (tools/setup_vllm_env.sh builds it) with the same thread
count as the transformers runs.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch


def gsm8k_prompts(tokenizer, num_prompts: int) -> list[list[int]]:
    from llamarl.exec.testing import read_jsonl, shared_data_dir

    rows = read_jsonl(shared_data_dir(__file__) / "gsm8k" / "test.jsonl", num_prompts)
    prompts = []
    for row in rows:
        messages = [{"role": "user", "content": row["question"]}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return prompts


def bench_plain(model_dir: str, prompts: list[list[int]], max_new_tokens: int) -> tuple[int, float]:
    """transformers' generate with the same sampling settings, no log-prob recording."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    from llamarl.exec.padding import completion_mask, left_pad

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    eos = model.generation_config.eos_token_id
    eos_ids = [eos] if isinstance(eos, int) else list(eos)
    pad = model.generation_config.pad_token_id
    pad = eos_ids[0] if pad is None else pad

    def run(batch: list[list[int]], num_tokens: int) -> tuple[int, float]:
        ids_BP, mask_BP = left_pad(batch, pad)
        config = GenerationConfig(
            do_sample=True, temperature=1.0, top_k=0, top_p=1.0, min_p=None, typical_p=1.0,
            repetition_penalty=1.0, max_new_tokens=num_tokens, eos_token_id=eos_ids, pad_token_id=pad,
        )  # fmt: skip
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(input_ids=ids_BP, attention_mask=mask_BP, generation_config=config)
        elapsed = time.perf_counter() - start
        return int(completion_mask(out[:, ids_BP.shape[1] :], eos_ids).sum()), elapsed

    run(prompts[:2], 8)
    return run(prompts, max_new_tokens)


def bench_generator(generator, prompts: list[list[int]], max_new_tokens: int) -> tuple[int, float]:
    generator.setup()
    try:
        generator.generate(prompts[:2], samples_per_prompt=1, max_new_tokens=8)
        start = time.perf_counter()
        batch = generator.generate(prompts, samples_per_prompt=1, max_new_tokens=max_new_tokens)
        return batch.num_completion_tokens, time.perf_counter() - start
    finally:
        generator.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="local model folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--skip", nargs="*", default=[], choices=["plain", "hf", "vllm"])
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from llamarl.exec import GeneratorConfig, HFGenerator, SamplingConfig, VLLMGenerator, smollm2_path

    model_dir = args.model or str(smollm2_path())
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    prompts = gsm8k_prompts(AutoTokenizer.from_pretrained(model_dir), args.num_prompts)
    runs = {
        "plain": lambda: bench_plain(model_dir, prompts, args.max_new_tokens),
        "hf": lambda: bench_generator(
            HFGenerator(model_dir, SamplingConfig(), seed=0),
            prompts,
            args.max_new_tokens,
        ),
        "vllm": lambda: bench_generator(
            VLLMGenerator(model_dir, SamplingConfig(), GeneratorConfig(), seed=0, num_threads=args.threads),
            prompts,
            args.max_new_tokens,
        ),
    }
    names = {"plain": "model.generate", "hf": "HFGenerator", "vllm": "VLLMGenerator"}
    results = {}
    for key, run in runs.items():
        if key in args.skip:
            continue
        tokens, seconds = run()
        results[key] = (tokens, seconds, tokens / seconds)
        print(f"{names[key]}: {tokens} tokens in {seconds:.2f} s = {tokens / seconds:.1f} tok/s", flush=True)

    print(
        f"\n{Path(model_dir).name}, {args.num_prompts} GSM8K prompts x 1 sample x {args.max_new_tokens} new "
        f"tokens, T=1, {args.threads} threads, float32"
    )
    print("| backend | completion tokens | seconds | tokens/s | vs model.generate |")
    print("|---|---|---|---|---|")
    base = results.get("plain", (0, 0, float("nan")))[2]
    for key, (tokens, seconds, rate) in results.items():
        print(f"| {names[key]} | {tokens} | {seconds:.2f} | {rate:.1f} | {rate / base:.2f}x |")


if __name__ == "__main__":
    main()
