"""The vLLM engine process behind `llamarl.exec.VLLMGenerator`: runs in the vLLM environment.

Started by the generator (`python -P vllm_server.py --fd N ...`) with one end of a socket pair; it builds
a `vllm.LLM` with llamarl's weight-sync worker extension, sends ("ready", info), then answers requests
`(method, kwargs)` with `("ok", value)` or `("error", traceback text)` until "close" or until the parent
goes away (end of file on the socket). It imports only the standard library, vLLM and `llamarl.comm`: it
runs under the vLLM environment's torch, never the workspace's, and is run as a file, not imported.

Why a process of its own and not vLLM's own server: the weights reach the engine straight from the
trainer over llamarl.comm (the worker extension joins the weight-sync group), and the few calls needed
here (generate token ids, receive a sync, report the version) fit in a socket pair with no HTTP stack.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any


def log(msg: str) -> None:
    print(f"[vllm engine {os.getpid()} {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class Engine:
    """The requests the generator sends, each a method of this class."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch
        from vllm import LLM

        from llamarl.comm.adapters.vllm import WORKER_EXTENSION_CLS

        torch.set_num_threads(args.num_threads)
        start = time.monotonic()
        self.llm = LLM(
            model=args.model,
            worker_extension_cls=WORKER_EXTENSION_CLS,
            enforce_eager=True,  # no graph capture / compilation: starts in seconds on the CPU
            dtype=args.dtype,
            max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs,
            seed=args.seed,
            # Log-probs of the distribution actually sampled, log softmax(z / T): what AIPO divides by.
            # The default, raw_logprobs, is taken before temperature.
            logprobs_mode="processed_logprobs",
        )
        self.info = {
            "vllm": __import__("vllm").__version__,
            "torch": torch.__version__,
            "start_s": time.monotonic() - start,
        }

    def generate(
        self,
        prompts: list[list[int]],
        n: int,
        max_tokens: int,
        temperature: float,
        stop_token_ids: list[int],
        seed: int | None,
    ) -> dict[str, Any]:
        """Samples `n` completions per prompt; returns token ids and the sampled tokens' log-probs.

        temperature 0 is greedy. Every other sampling knob is set to its neutral value explicitly: the
        tokens must come from softmax(z / T) alone, which the log-probs describe.
        """
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(
            n=n,
            temperature=temperature,
            top_p=1.0,
            top_k=0,
            min_p=0.0,
            presence_penalty=0.0,
            frequency_penalty=0.0,
            repetition_penalty=1.0,
            max_tokens=max_tokens,
            min_tokens=0,
            stop_token_ids=stop_token_ids,
            logprobs=0,  # only the sampled token's log-prob
            seed=seed,
        )
        outputs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False
        )
        token_ids, logprobs = [], []
        for request in outputs:
            for completion in sorted(request.outputs, key=lambda c: c.index):
                ids = list(completion.token_ids)
                token_ids.append(ids)
                logprobs.append([step[t].logprob for step, t in zip(completion.logprobs, ids, strict=True)])
        return {"token_ids": token_ids, "logprobs": logprobs, "policy_version": self.weight_version()}

    def init_weight_sync(self, **kwargs: Any) -> int:
        return int(self.llm.collective_rpc("init_weight_sync", kwargs=kwargs)[0])

    def receive_weights(self, timeout_s: float | None) -> int:
        """One sync from the trainer into every worker, then the prefix cache reset (checked)."""
        from llamarl.comm.adapters.vllm import sync_weights

        start = time.monotonic()
        received = sync_weights(self.llm, timeout_s=timeout_s)
        # The workers' own report, in the log for people and for the app test.
        log(f"serves policy_version {self.weight_version()} ({time.monotonic() - start:.2f} s)")
        return received

    def weight_version(self) -> int | None:
        versions = set(self.llm.collective_rpc("weight_version"))
        if len(versions) != 1:
            raise RuntimeError(f"engine workers serve different policy versions: {versions}")
        return versions.pop()

    def close_weight_sync(self) -> None:
        self.llm.collective_rpc("close_weight_sync")


def exit_with_parent(poll_s: float = 1.0) -> None:
    """Ends this process when the generator process that started it is gone.

    The main thread may sit in a long vLLM call (a weight sync waits up to the run's timeout for the
    trainer), so it would notice a closed socket only afterwards; a rank killed by the launcher must not
    leave an engine holding memory for minutes.
    """
    import threading

    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        log(f"parent process {parent} is gone: exiting")
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fd", type=int, required=True, help="this end of the socket pair to the generator")
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-model-len", type=int, default=None, help="default: the model's limit")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--num-threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    conn = Connection(args.fd)
    exit_with_parent()
    try:
        engine = Engine(args)
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        raise
    conn.send(("ready", engine.info))
    log(f"ready: {engine.info}")
    while True:
        try:
            method, kwargs = conn.recv()
        except EOFError:  # the generator went away: nothing left to serve
            return
        if method == "close":
            conn.send(("ok", None))
            return
        try:
            reply = ("ok", getattr(engine, method)(**kwargs))
        except BaseException:
            reply = ("error", traceback.format_exc())
        conn.send(reply)


if __name__ == "__main__":
    try:
        main()
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        # vLLM's in-process engine can leave non-daemon threads behind: never hang on them at exit.
        os._exit(1)
    sys.stderr.flush()
    os._exit(0)
