"""Engine side of tests/test_vllm_adapter.py; runs in the vLLM environment.

Waits for the trainer to write the served model folder, starts a real vLLM engine on it with the
`llamarl` weight-transfer backend (registered by llamarl-comm's vLLM plugin, found through its entry
points) and llamarl's worker extension, generates greedily (old weights), joins the weight-sync group
(`init_weight_transfer`: vLLM's `init_weight_transfer_engine`), receives two syncs (`sync_weights`:
start, update, finish), generating after each, and writes everything the parent test asserts on to
`--result` (JSON): versions reported before/after, token ids and log-probs before/after, and vLLM's own
sha256 of every parameter as the engine holds it after the sync.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

# Before vLLM is imported: in-process engine core (the ~20 s start; collective_rpc calls go straight to
# the worker object), and no OpenMP core binding on a small shared machine.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# vLLM's sampler torch.compile()s a small helper the first time log-probs are requested, even with
# enforce_eager: 5-25 s of inductor work on this CPU for a one-line reduction. Eager is fine here.
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")


def log(msg: str) -> None:
    print(f"[engine {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def wait_for(path: Path, deadline: float) -> None:
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear (the trainer process failed or is too slow)")
        time.sleep(0.2)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--reference", type=Path, required=True)
    parser.add_argument("--result", type=Path, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--timeout-s", type=float, default=90.0)
    args = parser.parse_args()
    deadline = time.monotonic() + args.timeout_s

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from llamarl.comm import WeightSyncEndpoint
    from llamarl.comm.adapters.vllm import WORKER_EXTENSION_CLS, init_weight_transfer, sync_weights

    wait_for(args.model_dir / "READY", deadline)
    t0 = time.monotonic()
    llm = LLM(
        model=str(args.model_dir),
        weight_transfer_config={"backend": "llamarl"},
        worker_extension_cls=WORKER_EXTENSION_CLS,
        enforce_eager=True,
        dtype="float32",  # same dtype as the trainer: the test compares weights bit for bit
        max_model_len=256,
        max_num_seqs=2,
        block_size=32,
        seed=0,
    )
    import torch

    log(f"engine up in {time.monotonic() - t0:.1f}s (torch {torch.__version__})")

    wait_for(args.reference, deadline)
    reference = json.loads(args.reference.read_text())
    prompt = TokensPrompt(prompt_token_ids=reference["prompt_token_ids"])
    params = SamplingParams(temperature=0.0, max_tokens=len(reference["token_ids"]), logprobs=0)

    def generate() -> tuple[list[int], list[float]]:
        completion = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        ids = list(completion.token_ids)
        return ids, [step[t].logprob for step, t in zip(completion.logprobs, ids, strict=True)]

    result: dict = {}
    result["version_before"] = llm.collective_rpc("weight_version")
    result["token_ids_before"], result["logprobs_before"] = generate()
    log(f"before sync: {result['token_ids_before']}")

    t0 = time.monotonic()
    endpoint = WeightSyncEndpoint(
        host=args.host, port=args.port, rank=1, world_size=2, timeout_s=args.timeout_s
    )
    init_weight_transfer(llm, endpoint)
    result["policy_versions"] = [sync_weights(llm)]
    result["sync_s"] = time.monotonic() - t0
    result["version_mid"] = llm.collective_rpc("weight_version")
    result["token_ids_mid"], _ = generate()
    log(f"synced policy_version {result['policy_versions'][0]} in {result['sync_s']:.2f}s (join included)")
    log(f"after sync 1: {result['token_ids_mid']}")

    t0 = time.monotonic()
    result["policy_versions"].append(sync_weights(llm))
    log(f"synced policy_version {result['policy_versions'][1]} in {time.monotonic() - t0:.2f}s")
    result["version_after"] = llm.collective_rpc("weight_version")
    result["token_ids_after"], result["logprobs_after"] = generate()
    log(f"after sync 2: {result['token_ids_after']}")
    # vLLM's own per-parameter digests, in its names (fused qkv_proj / gate_up_proj; kernel-repacked
    # linears hash as empty on the CPU backend) — the test compares the ones that keep checkpoint layout.
    checksums = llm.collective_rpc("compute_weight_checksums")[0]
    result["sha256"] = {name.split(":")[-1]: digest for name, digest in checksums.items()}
    llm.shutdown_weight_transfer_engine()

    args.result.write_text(json.dumps(result))
    log("done")


if __name__ == "__main__":
    try:
        main()
    except BaseException:
        import traceback

        traceback.print_exc()
        sys.stdout.flush()
        # vLLM's in-process engine can leave non-daemon threads behind; do not hang on them.
        os._exit(1)
    sys.stdout.flush()
    os._exit(0)
