"""The vLLM engine process behind `llamarl.exec.VLLMGenerator`: runs in the vLLM environment.

Started by the generator (`python -P server.py --fd N ...`) with one end of a socket pair; it builds
a `vllm.LLM` with llamarl's weight-sync worker extension, sends ("ready", info), then answers requests
`(method, kwargs)` with `("ok", value, method)` or `("error", traceback text, method)` until "close" or
until the parent goes away (end of file on the socket). It imports only the standard library, vLLM and
`llamarl.comm`: it runs under the vLLM environment's torch, never the workspace's, and is run as a file,
not imported.

In-flight requests: `generate` steps the engine itself and, between two engine steps, answers the few
requests that may arrive while it runs (`NESTED_METHODS`: a weight sync, a version or progress query,
an abort, a pause that ends the generate with what it sampled so far).
Replies name their request because a nested request's reply and the generate's own reply can cross
(the generate may finish just as the client sends a sync); the client sorts them by that name.

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


# Requests the engine answers while a generate is in flight (between two engine steps); any other is an
# error there. "close" ends the generate (its requests aborted) and then the process.
NESTED_METHODS = ("receive_weights", "weight_version", "progress", "abort", "pause", "close")


class GenerateAborted(Exception):
    """The client abandoned the generate in flight ("abort" between two engine steps, or it went away)."""


class GeneratePaused(Exception):
    """The client paused the generate in flight: it ends now and replies with what was sampled so far."""


class CloseRequested(Exception):
    """A "close" arrived while a generate was in flight: its requests are aborted, then the process ends."""


class Engine:
    """The requests the generator sends, each a method of this class."""

    def __init__(self, args: argparse.Namespace, conn: Connection) -> None:
        import torch
        from vllm import LLM

        from llamarl.comm.adapters.vllm import WORKER_EXTENSION_CLS

        torch.set_num_threads(args.num_threads)
        start = time.monotonic()
        self.conn = conn
        self.async_scheduling = args.async_scheduling
        self.llm = LLM(**llm_kwargs(args, worker_extension_cls=WORKER_EXTENSION_CLS))
        self.info = {
            "vllm": __import__("vllm").__version__,
            "torch": torch.__version__,
            "start_s": time.monotonic() - start,
        }
        self._num_generates = 0
        # Set while generate steps the engine: a weight sync then runs with requests in flight.
        self._in_flight = False
        # The policy_version loaded now (None after a failed sync): what stamps each sampled token.
        self._version: int | None = self.weight_version()
        # A sync taken with requests in flight owes a prefix-cache reset: vLLM refuses one while requests
        # run, so it runs once they are done (end of generate).
        self._reset_owed_for: int | None = None
        # Model turns of multi-turn episodes in the engine (turns_add / turns_wait), by request id.
        self._turns: dict[str, dict[str, Any]] = {}
        # The generate in flight's completions: tokens sampled so far and whether each finished.
        self._progress: tuple[list[list[int]], list[bool]] = ([], [])

    def generate(
        self,
        prompts: list[list[int]],
        n: int,
        max_tokens: int,
        temperature: float,
        stop_token_ids: list[int],
        seed: int | None,
    ) -> dict[str, Any]:
        """Samples `n` completions per prompt; returns token ids, the sampled tokens' log-probs and the
        policy_version that sampled each token.

        temperature 0 is greedy. Every other sampling knob is set to its neutral value explicitly: the
        tokens must come from softmax(z / T) alone, which the log-probs describe.

        The engine is stepped here (`LLMEngine.add_request` + `step()`, what `LLM.generate` does inside)
        so that between two steps a nested request can be answered: a weight sync is loaded while the
        requests stay in flight, their KV cache from the old weights kept (partial rollouts, as in
        PipelineRL / AReaL), and later tokens come from the new weights.

        A "pause" between two steps ends the call early: its requests are aborted and the reply holds
        every completion as far as it got, with `finished` saying which are complete.

        Returns:
            token_ids, logprobs, token_versions: one list per completion (len(prompts) * n, the samples
                of one prompt contiguous), each as long as the completion.
            finished: per completion, whether it is complete (always all True unless paused).
            paused: whether a "pause" ended the call.
            version_arrivals: per completion, [(tokens it had, version)] for each version that arrived
                while it was in flight.
            policy_version: the version served at the end.
        """
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

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
            # Each step's new tokens, not the whole completion so far: each gets the version that drew it.
            output_kind=RequestOutputKind.DELTA,
        )
        engine = self.llm.llm_engine
        call = self._num_generates
        self._num_generates += 1
        request_ids = [f"llamarl-{call}-{i}" for i in range(len(prompts))]
        slot = {rid: i for i, rid in enumerate(request_ids)}
        num = len(prompts) * n
        token_ids: list[list[int]] = [[] for _ in range(num)]
        logprobs: list[list[float]] = [[] for _ in range(num)]
        versions: list[list[int | None]] = [[] for _ in range(num)]
        arrivals: list[list[tuple[int, int | None]]] = [[] for _ in range(num)]
        finished = [False] * num
        added: list[str] = []
        paused = False
        self._progress = (token_ids, finished)
        self._in_flight = True
        try:
            raw = [TokensPrompt(prompt_token_ids=p) for p in prompts]
            # Rendered as LLM.generate renders them (vLLM 0.32 deprecates handing raw prompts to the
            # engine); raw where an LLM lacks that private step.
            render = getattr(self.llm, "_preprocess_cmpl", None)
            for rid, prompt in zip(request_ids, raw if render is None else render(raw), strict=True):
                engine.add_request(rid, prompt, params)
                added.append(rid)
            while engine.has_unfinished_requests():
                version_before = self._version
                try:
                    self._serve_nested()  # may load new weights (and raise GenerateAborted)
                except GeneratePaused:
                    paused = True
                    break
                if self._version != version_before:
                    for row in range(num):
                        if not finished[row]:
                            arrivals[row].append((len(token_ids[row]), self._version))
                version = self._version  # the weights this step's forward pass runs with
                for output in engine.step():
                    for completion in output.outputs:
                        row = slot[output.request_id] * n + completion.index
                        ids = list(completion.token_ids)
                        token_ids[row] += ids
                        logprobs[row] += [
                            step[t].logprob for step, t in zip(completion.logprobs, ids, strict=True)
                        ]
                        versions[row] += [version] * len(ids)
                        finished[row] = finished[row] or completion.finished()
            if not paused:
                added = []  # every request finished: nothing to abort
        finally:
            self._in_flight = False
            self._progress = ([], [])
            if added:  # aborted or failed half way: the requests must not run into the next call
                engine.abort_request(added)
            self._reset_owed_prefix_cache()
        if not paused and not all(finished):
            raise RuntimeError(f"the engine ran out of requests with completions unfinished: {finished}")
        return {
            "token_ids": token_ids,
            "logprobs": logprobs,
            "token_versions": versions,
            "finished": finished,
            "paused": paused,
            "version_arrivals": arrivals,
            "policy_version": self.weight_version(),
        }

    # -- model turns of multi-turn episodes: many in flight, each returned as soon as it ends ----------

    def turns_add(
        self, requests: list[list[Any]], temperature: float, stop_token_ids: list[int], seed: int | None
    ) -> None:
        """Starts model turns, each `[key, prompt_ids, max_tokens]`; they run until `turns_wait` returns
        them. Turns of other episodes keep decoding meanwhile (and the prefix cache serves the episode's
        earlier tokens)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        engine = self.llm.llm_engine
        render = getattr(self.llm, "_preprocess_cmpl", None)
        for key, prompt_ids, max_tokens in requests:
            params = SamplingParams(
                n=1, temperature=temperature, top_p=1.0, top_k=0, min_p=0.0, presence_penalty=0.0,
                frequency_penalty=0.0, repetition_penalty=1.0, max_tokens=int(max_tokens), min_tokens=0,
                stop_token_ids=stop_token_ids, logprobs=0,
                seed=None if seed is None else seed + self._num_generates,
                output_kind=RequestOutputKind.DELTA,
            )  # fmt: skip
            request_id = f"llamarl-turn-{self._num_generates}"
            self._num_generates += 1
            raw = [TokensPrompt(prompt_token_ids=list(prompt_ids))]
            (prompt,) = raw if render is None else render(raw)
            engine.add_request(request_id, prompt, params)
            self._turns[request_id] = {"key": key, "token_ids": [], "logprobs": [], "versions": []}
        self._in_flight = bool(self._turns)

    def turns_wait(self, max_s: float) -> list[dict[str, Any]]:
        """Steps the engine (at least once) until a turn ends or `max_s` passed; returns the turns that
        ended: key, token_ids, logprobs and the policy version of each token."""
        engine = self.llm.llm_engine
        deadline = time.monotonic() + max_s
        done: list[dict[str, Any]] = []
        while self._turns and not done:
            version = self._version  # the weights this step's forward pass runs with
            for output in engine.step():
                turn = self._turns.get(output.request_id)
                if turn is None:
                    continue
                for completion in output.outputs:
                    ids = list(completion.token_ids)
                    turn["token_ids"] += ids
                    turn["logprobs"] += [
                        step[t].logprob for step, t in zip(completion.logprobs, ids, strict=True)
                    ]
                    turn["versions"] += [version] * len(ids)
                if output.finished:
                    done.append(self._turns.pop(output.request_id))
            if time.monotonic() >= deadline:
                break
        if not self._turns:
            self._in_flight = False
            self._reset_owed_prefix_cache()
        return done

    def turns_abort(self) -> None:
        """Abandons every turn still running."""
        if self._turns:
            self.llm.llm_engine.abort_request(list(self._turns))
        self._turns = {}
        self._in_flight = False
        self._reset_owed_prefix_cache()

    def _serve_nested(self) -> None:
        """Answers every request waiting on the connection (between two engine steps, never blocking)."""
        while self.conn.poll():
            try:
                method, kwargs = self.conn.recv()
            except EOFError:  # the generator went away mid-generate: nothing left to serve
                raise GenerateAborted("the generator closed its connection") from None
            if method == "abort":
                self.conn.send(("ok", None, method))
                raise GenerateAborted("aborted by the generator")
            if method == "pause":
                self.conn.send(("ok", None, method))
                raise GeneratePaused
            if method == "close":
                raise CloseRequested
            if method not in NESTED_METHODS:
                self.conn.send(("error", f"{method} is not allowed while a generate is in flight", method))
                continue
            if method == "receive_weights" and self.async_scheduling:
                # A step scheduled ahead would run on the new weights with tokens stamped as the old.
                self.conn.send(("error", "weights cannot load mid-generate with async scheduling", method))
                continue
            try:
                reply = ("ok", getattr(self, method)(**kwargs), method)
            except BaseException:
                reply = ("error", traceback.format_exc(), method)
            self.conn.send(reply)
            if method == "receive_weights" and reply[0] == "error":
                # The weights may be partly replaced: tokens sampled on would come from no policy at all.
                raise RuntimeError(
                    "the weight sync taken during this generate failed; its requests were aborted"
                )

    def progress(self) -> dict[str, list]:
        """How far the generate in flight got, as of the last engine step: the tokens each completion
        sampled so far and whether it finished (empty lists outside a generate)."""
        token_ids, finished = self._progress
        return {"tokens": [len(ids) for ids in token_ids], "finished": list(finished)}

    def abort(self) -> None:
        """Abandons a generate in flight; outside one (it finished first) there is nothing to do."""
        return None

    def pause(self) -> None:
        """Ends a generate in flight with what it sampled; outside one (it finished first) nothing to do."""
        return None

    def init_weight_sync(self, **kwargs: Any) -> int:
        return int(self.llm.collective_rpc("init_weight_sync", kwargs=kwargs)[0])

    def receive_weights(self, timeout_s: float | None) -> int:
        """One sync from the trainer into every worker, then the prefix cache reset (checked).

        During a generate the reset is owed instead (vLLM refuses it while requests run) and made when
        the generate ends; the requests in flight keep their KV cache from the old weights.
        """
        from llamarl.comm.adapters.vllm import sync_weights

        start = time.monotonic()
        self._version = None  # until the workers report the new weights loaded
        if self._in_flight:
            versions = self.llm.collective_rpc("receive_weights", kwargs={"timeout_s": timeout_s})
            if len(set(versions)) != 1:
                raise RuntimeError(f"engine workers received different policy versions: {versions}")
            received = int(versions[0])
            self._reset_owed_for = received
        else:
            received = sync_weights(self.llm, timeout_s=timeout_s)  # raises when the reset is refused
        self._version = received
        # The workers' own report, in the log for people and for the app test.
        in_flight = " (requests in flight)" if self._in_flight else ""
        log(f"serves policy_version {self.weight_version()}{in_flight} ({time.monotonic() - start:.2f} s)")
        return received

    def _reset_owed_prefix_cache(self) -> None:
        """The prefix-cache reset a sync during generate deferred; raises if vLLM refuses it."""
        if self._reset_owed_for is None:
            return
        version, self._reset_owed_for = self._reset_owed_for, None
        # Nothing runs now, so a refusal means stale KV would be served: fail the call, as sync_weights does.
        if self.llm.reset_prefix_cache() is False:
            raise RuntimeError(
                f"vLLM refused to reset its prefix cache after loading policy_version {version} during a "
                "generate: its cached KV was computed with the old weights"
            )

    def weight_version(self) -> int | None:
        versions = set(self.llm.collective_rpc("weight_version"))
        if len(versions) != 1:
            raise RuntimeError(f"engine workers serve different policy versions: {versions}")
        return versions.pop()

    def close_weight_sync(self) -> None:
        self.llm.collective_rpc("close_weight_sync")


def llm_kwargs(args: argparse.Namespace, *, worker_extension_cls: str) -> dict[str, Any]:
    """The keyword arguments the engine's `vllm.LLM` is built with, from this script's flags."""
    cuda = args.device == "cuda"
    kwargs: dict[str, Any] = dict(
        model=args.model,
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


def main() -> None:
    args = parse_args()
    conn = Connection(args.fd)
    exit_with_parent()
    try:
        engine = Engine(args, conn)
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
            conn.send(("ok", None, method))
            return
        try:
            reply = ("ok", getattr(engine, method)(**kwargs), method)
        except CloseRequested:  # during a generate: its requests are aborted, nobody waits for its reply
            conn.send(("ok", None, "close"))
            return
        except BaseException:
            reply = ("error", traceback.format_exc(), method)
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
