"""Makes a small real mixture of experts from SmolLM2-135M-Instruct (or another local Llama-architecture
folder) for runs on a CPU machine: each MLP copied into `--experts` experts behind a router that starts
out giving the dense model's output (`llamarl.exec.moe.upcycle`). Nothing is downloaded.

Usage:

    uv run tools/upcycle_moe.py [--out runs/smollm2-moe] [--experts 4] [--top-k 2] [--model FOLDER]

then train it: `uv run apps/arith_rl --model runs/smollm2-moe --generator hf ...`.
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/smollm2-moe", help="folder to write the upcycled model to")
    parser.add_argument("--model", default=None, help="dense Llama folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--experts", type=int, default=4, help="experts per MoE layer")
    parser.add_argument("--top-k", type=int, default=2, help="experts per token")
    parser.add_argument("--seed", type=int, default=0, help="seed of the routers' initial weights")
    parser.add_argument(
        "--expert-noise", type=float, default=0.0,
        help="each copy's weights times 1 + this x N(0, 1): copies differ, so routing matters (0: exact)",
    )  # fmt: skip
    args = parser.parse_args()

    from llamarl.exec.models import load_model_and_tokenizer, smollm2_path
    from llamarl.exec.moe.upcycle import upcycle_folder

    dense = args.model or smollm2_path()
    start = time.perf_counter()
    out = upcycle_folder(
        dense,
        args.out,
        experts=args.experts,
        top_k=args.top_k,
        seed=args.seed,
        expert_noise=args.expert_noise,
    )
    model, _ = load_model_and_tokenizer(out, with_tokenizer=False)
    dense_model, _ = load_model_and_tokenizer(dense, with_tokenizer=False)
    ids = torch.randint(0, model.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        gap = float((model(ids).logits - dense_model(ids).logits).abs().max())
    parameters = sum(p.numel() for p in model.parameters())
    print(
        f"{out}: {type(model).__name__}, {args.experts} experts ({args.top_k} per token) in each of "
        f"{model.config.num_hidden_layers} layers, {parameters / 1e6:.0f}M parameters; largest logit gap to "
        f"the dense model {gap:.1e}; {time.perf_counter() - start:.0f} s"
    )


if __name__ == "__main__":
    main()
