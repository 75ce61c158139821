"""What routing replay costs on a mixture of experts (prints figures; not a timed test).

On a MoE folder (default: `tools/upcycle_moe.py`'s SmolLM2 upcycle at runs/smollm2-moe), one batch of
the arith recipe's shape (8 prompts x 8 samples x 24 new tokens, bf16 generator, bf16 trainer):

- generate: the hf generator's generate with its routes recorded, and with the recorder off;
- train: one trainer step with the routes replayed (r3), and routing naturally (off: the routes are
  still compared, which is what `routing_mismatch` costs);
- bytes: the routes' size per sample, beside the sample's token ids.

Usage:

    uv run tools/bench_routes.py [--model runs/smollm2-moe] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="runs/smollm2-moe", help="a MoE transformers folder")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a rank's share of the cores)")
    args = parser.parse_args()

    import torch

    from llamarl.exec import HFGenerator, SamplingConfig
    from llamarl.exec.generate.choice import this_hardware
    from llamarl.exec.testing import build_trainer

    torch.set_num_threads(args.threads)
    print(f"{this_hardware(cuda=False).describe()}; {args.threads} thread(s)")
    prompts = [[1, 9690, 198, *range(100 + 10 * i, 130 + 10 * i), 2] for i in range(8)]
    generator = HFGenerator(
        args.model, SamplingConfig(max_new_tokens=24, samples_per_prompt=8), dtype="bfloat16", seed=0
    )
    generator.setup()
    recorder = generator._routes  # (private: the bench switches the recorder off and on)

    def generate_s(recording: bool):
        generator._routes = recorder if recording else None
        start = time.perf_counter()
        batch = generator.generate(prompts, samples_per_prompt=8, max_new_tokens=24)
        return time.perf_counter() - start, batch

    timings = {True: [], False: []}
    for _ in range(args.repeats):
        for recording in (True, False):
            seconds, batch = generate_s(recording)
            timings[recording].append(seconds)
    _, batch = generate_s(True)
    batch.rewards_B = (torch.arange(batch.num_sequences) % 3 == 0).float()
    route_bytes = (
        batch.prompt_routes_BPLK.nbytes + batch.completion_routes_BCLK.nbytes
    ) / batch.num_sequences
    real_tokens = float(batch.prompt_mask_BP.sum() + batch.completion_mask_BC.sum()) / batch.num_sequences
    recording, plain = statistics.median(timings[True]), statistics.median(timings[False])
    print(
        f"generate, {batch.num_sequences} sequences x 24 new tokens: recording routes {recording:.2f} s, "
        f"recorder off {plain:.2f} s (median of {args.repeats})"
    )
    _, positions, layers, top_k = batch.prompt_routes_BPLK.shape
    positions += batch.completion_ids_BC.shape[1]
    print(
        f"routes per sample: {route_bytes:.0f} bytes ({layers} MoE layers x {top_k} experts x {positions} "
        f"positions, uint8; {real_tokens:.0f} real tokens a sample, whose int64 ids alone are "
        f"{8 * real_tokens:.0f} bytes)"
    )
    generator.close()
    for replay in ("r3", "off"):
        trainer = build_trainer(args.model, compute_dtype="bfloat16", routing_replay=replay, seed=0, lr=1e-6)
        trainer.setup()
        steps = [trainer.train_step(batch) for _ in range(args.repeats)]
        seconds = statistics.median(m["train_s"] for m in steps)
        print(
            f"train step, routing replay {replay}: {seconds:.2f} s (median of {args.repeats}); "
            f"routing_mismatch {steps[0]['routing_mismatch']:.3f}, "
            f"|log pi - log mu| {steps[0]['logprob_gap_abs_mean']:.4f}"
        )
        trainer.close()


if __name__ == "__main__":
    main()
