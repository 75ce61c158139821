"""A plain PyTorch trainer that updates a running `vllm serve` with the llamarl weight-transfer backend.

Nothing of llamarl here but llamarl-comm (torch is its only dependency); transformers only loads the
model. The trainer teaches the model a new answer to one prompt with a few SGD steps, sends the new
weights to the server through vLLM's HTTP weight-update routes (the `llamarl` backend: straight from
this process's tensors into the server's staging, checksummed, while the server keeps serving; the
server pauses only to swap them in), and asks the server again: it now gives the new answer.

Start the server first (VLLM_SERVER_DEV_MODE=1 registers vLLM's weight-update routes; llamarl-comm
installed beside vLLM registers the backend through its plugin entry point):

    VLLM_SERVER_DEV_MODE=1 vllm serve MODEL_DIR --weight-transfer-config '{"backend": "llamarl"}'

then:

    python trainer.py --url http://127.0.0.1:8000 --model MODEL_DIR

It prints what the server answered before and after, and exits 1 if the server's answer is not the
one the trainer's weights give.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.request

import torch

from llamarl.comm import WeightSyncEndpoint, free_port
from llamarl.comm.adapters.vllm_trainer import (
    HTTPWeightSyncClient,
    LlamarlTrainerInitInfo,
    LlamarlTrainerWeightTransferEngine,
)


def ask(url: str, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """The server's greedy continuation of `prompt_ids` (OpenAI completions API, token ids in and out)."""
    with urllib.request.urlopen(f"{url}/v1/models", timeout=60) as reply:
        model = json.loads(reply.read())["data"][0]["id"]
    body = {"model": model, "prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0.0}
    body["return_token_ids"] = True
    request = urllib.request.Request(
        f"{url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as reply:
        return list(json.loads(reply.read())["choices"][0]["token_ids"])


def greedy(model: torch.nn.Module, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """The trainer's own greedy continuation (what the server must answer once it has these weights)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_tokens, do_sample=False)
    return out[0, len(prompt_ids) :].tolist()


def train(model: torch.nn.Module, prompt_ids: list[int], target_ids: list[int], max_steps: int) -> int:
    """SGD steps on the target continuation until the model answers it greedily; returns the steps."""
    ids = torch.tensor([prompt_ids + target_ids])
    labels = ids.clone()
    labels[0, : len(prompt_ids)] = -100  # learn the answer, not the prompt
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02)
    for step in range(1, max_steps + 1):
        model(ids, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if greedy(model, prompt_ids, len(target_ids)) == target_ids:
            return step
    raise RuntimeError(f"the model did not learn the answer in {max_steps} steps")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--url", required=True, help="the vLLM server, e.g. http://127.0.0.1:8000")
    parser.add_argument("--model", required=True, help="the model folder the server serves")
    parser.add_argument("--host", default="127.0.0.1", help="this trainer's address, as the server sees it")
    parser.add_argument("--port", type=int, default=0, help="the weight-sync group's port (0: a free one)")
    parser.add_argument("--prompt", default="The password of the day is")
    parser.add_argument("--answer", default=" pineapple pineapple pineapple")
    parser.add_argument("--max-steps", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    prompt_ids, answer_ids = tokenizer(args.prompt)["input_ids"], tokenizer(args.answer)["input_ids"]
    before = ask(args.url, prompt_ids, len(answer_ids))
    print(f"server before: {tokenizer.decode(before)!r}", flush=True)

    # The group: this trainer (rank 0, hosting its store) and the server's one worker (rank 1). The
    # server's worker joins as the trainer's sender is built (both wait for the other's layout).
    endpoint = WeightSyncEndpoint(
        host=args.host, port=args.port or free_port(args.host), rank=0, world_size=2
    )
    engine = LlamarlTrainerWeightTransferEngine.trainer_init(
        LlamarlTrainerInitInfo(endpoint=endpoint), client=HTTPWeightSyncClient(args.url), source=model
    )
    steps = train(model, prompt_ids, answer_ids, args.max_steps)
    expected = greedy(model, prompt_ids, len(answer_ids))
    print(f"trained {steps} SGD step(s): the trainer now answers {tokenizer.decode(expected)!r}", flush=True)

    start = time.perf_counter()
    report = engine.send_weights()  # policy_version 1
    print(
        f"sent policy_version {report.policy_version}: {report.stats.bytes / 1e9:.2f} GB in "
        f"{time.perf_counter() - start:.2f} s, the server paused {report.pause_s:.3f} s to swap them in "
        f"(prefix cache reset: {report.prefix_cache_reset})",
        flush=True,
    )
    after = ask(args.url, prompt_ids, len(answer_ids))
    print(f"server after: {tokenizer.decode(after)!r}", flush=True)
    engine.shutdown()
    return 0 if after == expected and before != expected else 1


if __name__ == "__main__":
    sys.exit(main())
