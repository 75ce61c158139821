"""TRL's GRPOTrainer, its whole training loop, on the work tools/bench_modes.py gives llamarl: the same
model, GSM8K prompts in the same chat template, samples per prompt, completion length, temperature,
learning rate and number of optimizer steps; one JSON line of figures on stdout's last line.

TRL is not a project dependency; run it with it added for the one command:

    uv run --with trl==1.16.0 tools/bench_trl.py --precision bf16 --steps 6 [--json out.json]

What each step does there: generate 4 prompts x 4 samples with transformers' generate, score them with
llamarl's GSM8K checker (the same rule), then one optimizer step over the 16 completions (TRL's
defaults otherwise: DAPO loss, no KL, activation checkpointing on). `--precision bf16` is TRL's default
(`bf16=True`: autocast over float32 weights), `fp32` turns it off; `--no-gradient-checkpointing` turns off
TRL's activation checkpointing (faster, more memory). Figures: the training loop's wall
time (`trainer.train()`, after the model is loaded), completion tokens generated per second over it (the
completions' mean length from TRL's own per-step log), and the peak RSS of every process of the run
(llamarl.control.launch.memory, as llamarl's runs count theirs).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--precision", choices=["fp32", "bf16"], default="bf16")
    p.add_argument("--no-gradient-checkpointing", dest="checkpointing", action="store_false")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--prompts-per-step", type=int, default=4)
    p.add_argument("--samples-per-prompt", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=3e-6, help="llamarl's default")
    p.add_argument("--model", help="model folder (default: SmolLM2-135M-Instruct, as llamarl's CPU default)")
    p.add_argument("--data", help="GSM8K folder (default: the copy shipped in apps/data)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="also write the figures here")
    args = p.parse_args()

    from llamarl.control.launch.memory import ProcessTreeMemory, memory_summary

    memory = ProcessTreeMemory("trl trainer", at_once=True).start()  # before anything is loaded
    try:
        from datasets import Dataset
        from trl import GRPOConfig, GRPOTrainer
    except ImportError as error:
        raise SystemExit("TRL is needed: uv run --with trl==1.16.0 tools/bench_trl.py ...") from error

    from llamarl.control.tasks import load_rows
    from llamarl.control.tasks.registry import TASKS
    from llamarl.exec import gsm8k_reward, smollm2_path

    task = TASKS["gsm8k"]
    data = args.data or str(Path(__file__).resolve().parents[1] / "apps" / "data" / "gsm8k")
    rows = load_rows(task, data, "train")
    count = args.steps * args.prompts_per_step
    dataset = Dataset.from_list(
        [{"prompt": task.messages(r), "reference": r["answer"]} for r in rows[: max(count * 4, 64)]]
    )

    def reward(completions, reference, **_) -> list[float]:
        return [gsm8k_reward(c[-1]["content"], r) for c, r in zip(completions, reference, strict=True)]

    sequences = args.prompts_per_step * args.samples_per_prompt
    with tempfile.TemporaryDirectory() as output_dir:
        config = GRPOConfig(
            output_dir=output_dir,
            use_cpu=True,
            bf16=args.precision == "bf16",
            gradient_checkpointing=args.checkpointing,
            per_device_train_batch_size=args.samples_per_prompt,
            gradient_accumulation_steps=args.prompts_per_step,  # one optimizer step per 16 completions
            num_generations=args.samples_per_prompt,
            max_completion_length=args.max_new_tokens,
            temperature=args.temperature,
            learning_rate=args.lr,
            max_steps=args.steps,
            logging_steps=1,
            save_strategy="no",
            report_to="none",
            seed=args.seed,
            disable_tqdm=True,
        )
        trainer = GRPOTrainer(
            model=args.model or str(smollm2_path()), reward_funcs=reward, args=config, train_dataset=dataset
        )
        start = time.perf_counter()
        trainer.train()
        loop_s = time.perf_counter() - start
        logs = [r for r in trainer.state.log_history if "completions/mean_length" in r]
    memory.stop()
    tokens = sum(r["completions/mean_length"] for r in logs) * sequences
    figures = {
        "framework": "trl",
        "precision": args.precision,
        "gradient_checkpointing": args.checkpointing,
        "steps": len(logs),
        "loop_s": loop_s,
        "step_s": loop_s / max(len(logs), 1),
        "num_completion_tokens": tokens,
        "gen_tokens_per_s": tokens / loop_s,
        "reward_mean": [r.get("reward", float("nan")) for r in logs],
        "load_avg": os.getloadavg(),
        **memory_summary(memory.processes(), memory.at_once.peak_mb),
    }
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
