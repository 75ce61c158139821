"""The vLLM engine process behind `llamarl.exec.VLLMGenerator`: runs in the vLLM environment.

Started by the generator (`python -P server.py --fd N ...`) with one end of a socket pair; it builds a
`vllm.LLM` with llamarl.comm's `llamarl` weight-transfer backend, sends `protocol.Started`, then answers each
`protocol.Request` with a `protocol.Reply` (`engine.Engine` serves them) until `Close` or until the
parent goes away (end of file on the socket). It imports only the standard library, vLLM, `llamarl.comm`
and this folder's engine modules (`env.engine_import_root` puts them on its path): it runs under the
vLLM environment's torch, never the workspace's, and is run as a file, not imported.

Why a process of its own and not vLLM's own server: the engine steps its requests itself, so that a
weight sync pulled while they run goes in between two steps and every token is stamped with the
version that drew it; the weights reach the engine straight from the trainer over llamarl.comm (vLLM's
weight-transfer API with the `llamarl` backend), and the few calls needed here (generate token ids,
receive a sync, report the version) fit in a socket pair with no HTTP stack.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

from llamarl.comm.adapters.vllm_trainer import BACKEND
from llamarl.exec.generate.vllm import protocol


def log(msg: str) -> None:
    print(f"[vllm engine {os.getpid()} {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def start_engine(args: argparse.Namespace, conn: Connection) -> tuple[Any, dict[str, Any]]:
    """The `engine.Engine` of this script's flags, and what it reports on start (vLLM and torch
    versions, seconds to start)."""
    import torch
    from vllm import LLM

    from llamarl.comm.adapters.vllm import WORKER_EXTENSION_CLS
    from llamarl.exec.generate.vllm.engine import Engine

    torch.set_num_threads(args.num_threads)
    start = time.monotonic()
    llm = LLM(**llm_kwargs(args, worker_extension_cls=WORKER_EXTENSION_CLS))
    engine = Engine(llm, conn, async_scheduling=args.async_scheduling, log=log)
    info = {
        "vllm": __import__("vllm").__version__,
        "torch": torch.__version__,
        "start_s": time.monotonic() - start,
    }
    return engine, info


def llm_kwargs(args: argparse.Namespace, *, worker_extension_cls: str) -> dict[str, Any]:
    """The keyword arguments the engine's `vllm.LLM` is built with, from this script's flags."""
    cuda = args.device == "cuda"
    kwargs: dict[str, Any] = dict(
        model=args.model,
        # Weight syncs go through vLLM's weight-transfer API, with llamarl.comm as its backend (registered
        # by llamarl-comm's vLLM plugin); the extension reports what that API does not (versions, staging).
        weight_transfer_config={"backend": BACKEND},
        worker_extension_cls=worker_extension_cls,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        seed=args.seed,
        # Log-probs of the distribution actually sampled, log softmax(z / T): what AIPO divides by.
        # The default, raw_logprobs, is taken before temperature.
        logprobs_mode="processed_logprobs",
        # CUDA graphs (and vLLM's compilation) on CUDA unless turned off; never on the CPU, where no
        # graph capture or compilation lets the engine start in seconds.
        enforce_eager=not (cuda and args.cuda_graphs),
        # Off, one engine step = one model step whose outputs step() returns: the per-token policy
        # versions stamp a step's tokens with the weights loaded when it ran, which in-flight updates
        # (stream mode) rely on. On only where no weights load mid-generate (lock-step modes, CUDA).
        async_scheduling=cuda and args.async_scheduling,
    )
    if cuda:
        # vLLM's default takes 90% of the GPU and refuses to start when less is free.
        kwargs["gpu_memory_utilization"] = args.gpu_memory_utilization
    elif args.kv_cache_bytes is not None:
        # The CPU engine allocates and touches its whole KV cache at start (vLLM's CPU default: 4 GiB).
        kwargs["kv_cache_memory_bytes"] = args.kv_cache_bytes
    return kwargs


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """This script's flags (what `VLLMGenerator.server_args` passes)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--fd", type=int, required=True, help="this end of the socket pair to the generator")
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-model-len", type=int, default=None, help="default: the model's limit")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--num-threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--cuda-graphs", action="store_true", help="CUDA: no enforce_eager")
    parser.add_argument("--kv-cache-bytes", type=int, default=None, help="CPU: the KV cache's size")
    parser.add_argument("--async-scheduling", action="store_true", help="CUDA, lock-step modes only")
    return parser.parse_args(argv)


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


def serve(conn: Connection, engine: Any) -> None:
    """Answers the generator's requests, one at a time, until `Close` or end of file."""
    from llamarl.exec.generate.vllm.engine import CloseRequested

    while True:
        try:
            request = conn.recv()
        except EOFError:  # the generator went away: nothing left to serve
            return
        try:
            reply = engine.reply_to(request)
        except CloseRequested:  # (during a generate: its requests are aborted, nobody waits for its reply)
            conn.send(protocol.Reply(protocol.Close.method))
            return
        conn.send(reply)


def main() -> None:
    args = parse_args()
    conn = Connection(args.fd)
    exit_with_parent()
    try:
        engine, info = start_engine(args, conn)
    except BaseException:
        conn.send(protocol.Started(None, error=traceback.format_exc()))
        raise
    conn.send(protocol.Started(info))
    log(f"ready: {info}")
    serve(conn, engine)


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
