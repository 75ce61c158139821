"""The `vllm` generator: sampling in a real vLLM engine that runs as a child process of this rank.

Shape legend:
    B  sequences (num_prompts x samples_per_prompt, the samples of one prompt contiguous)
    P  prompt length (left-padded), C  completion length (right-padded)

`VLLMGenerator` is a thin client. `setup()` starts the engine (`llamarl.exec.vllm_server`) in the vLLM
environment (`llamarl.exec.vllm_env`) with one end of a socket pair; every request and every wait on
the engine has a deadline, and an engine that dies is reported with the tail of its log. The engine
runs in a child process, not in this one, for two reasons: vLLM pins its own torch, and an in-process
engine would adopt the launcher's default process group.

Weights never pass through this process: `connect_weight_sync` makes the engine's worker join the
trainer's weight-sync group (llamarl.comm's vLLM worker extension) as this rank, and each
`receive_weights` has it receive the trainer's tensors directly (DDMA), load them with vLLM's own
loaders and reset the prefix cache.

In-flight updates (stream mode): the engine steps its requests itself and, between two steps, answers
a `receive_weights` sent while a `generate` waits (from its `between_steps`). The requests stay in
flight with their KV cache from the old weights (partial rollouts, as in PipelineRL / AReaL), later
tokens are sampled by the new weights, every token is stamped with the version that sampled it
(`token_version_BC`), and the prefix-cache reset waits until the generate's requests are done.

An engine that dies (crash, out of memory, kill -9) is an `EngineLost`; `restart_engine()` starts a new
one in its place, which rejoins the weight-sync group under the same rank (llamarl.comm's rejoin: the
trainer's next send fails naming this rank, the send after that re-forms the group and delivers the
latest weights). Until that delivery the new engine serves the checkpoint it started from, not the
policy: `policy_version` is None and `generate` refuses (`WeightsNotSyncedError`).

Behaviour log-probs: the engine runs with `logprobs_mode="processed_logprobs"` and `logprobs=0`, so each
sampled token comes with log softmax(z / T)[token] of the distribution it was drawn from; temperature
is the only sampling knob that is not neutral. Greedy requests (evaluation) skip the temperature in
vLLM, so their log-probs are log softmax(z) (the HF generator scales greedy log-probs by 1/T).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from llamarl.exec.hf_generator import _completion_mask, _left_pad
from llamarl.exec.types import RolloutBatch
from llamarl.exec.vllm_env import engine_env, find_vllm_python

_SERVER = Path(__file__).resolve().with_name("vllm_server.py")

#: How often `generate` calls its `between_steps` while it waits for the engine (seconds).
BETWEEN_STEPS_S = 0.05


@dataclass(kw_only=True)
class VLLMGeneratorConfig:
    """Configuration of `VLLMGenerator`."""

    model: str  # local transformers folder (safetensors) the engine serves; the trainer starts from it
    dtype: str = "float32"  # engine weights and compute dtype; the trainer sends in this dtype
    temperature: float = 1.0  # sampling temperature; the trainer must use the same one
    seed: int | None = None  # engine seed; each generate call derives its request seed from it
    max_model_len: int | None = None  # prompt + completion token limit; None: the model's own limit
    max_num_seqs: int = 64  # sequences the engine schedules at once
    num_threads: int = 1  # CPU threads of the engine process
    kv_cache_gib: int = 1  # CPU KV cache size (VLLM_CPU_KVCACHE_SPACE)
    vllm_python: str | None = None  # interpreter of the vLLM environment; None: see find_vllm_python
    start_timeout_s: float = 300.0  # deadline for the engine to start (imports, model load)
    timeout_s: float = 600.0  # deadline for any other request (a generate call, a weight sync)
    log_path: str | None = None  # where the engine's stdout/stderr go; None: a temporary file
    # How many times restart_engine() may replace a dead engine over this generator's life: an engine
    # that keeps dying (bad model, out of memory) must end the run, not restart forever.
    max_engine_restarts: int = 3


class EngineError(RuntimeError):
    """The engine process failed, died or missed a deadline; the message carries its error or log tail."""


class EngineLost(EngineError):
    """The engine process is gone (it exited, was killed, or closed its connection).

    Restartable: `VLLMGenerator.restart_engine()` starts a new engine in its place. Other `EngineError`s
    (an error raised inside a live engine, a missed deadline) are not this class.

    Attributes:
        exit_code: the engine's exit status (negative: killed by that signal), None if unknown.
    """

    def __init__(self, message: str, *, exit_code: int | None) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class WeightsNotSyncedError(RuntimeError):
    """`generate` was called while the engine holds no synced policy: it was restarted (it serves the
    checkpoint it started from, not the trainer's latest weights) or its last weight sync failed
    (weights partly replaced). A `receive_weights` that succeeds ends this state."""


class VLLMGenerator:
    """Samples completions in a vLLM engine process; implements `llamarl.exec.types.Generator`.

    Attributes:
        policy_version: the version of the weights the engine serves; set by `receive_weights` (or by
            the controller after a sync) and checked against the engine's own report on every generate.
            None while the engine holds no synced weights: after `restart_engine()` and after a failed
            `receive_weights`, until the next successful one; `generate` then raises
            `WeightsNotSyncedError`.
        num_engine_restarts: how many times `restart_engine()` replaced the engine.
        engine_info: what the engine reported on start (vllm and torch versions, start time).
        last_metrics: timings and counts of the latest `generate` call.
    """

    # `generate` takes `between_steps`: stream mode loads new weights into the engine between its steps,
    # with the requests in flight (partial rollouts).
    supports_in_flight_updates = True

    def __init__(self, config: VLLMGeneratorConfig) -> None:
        if config.temperature <= 0:
            raise ValueError(f"temperature must be positive, got {config.temperature}")
        self.config = config
        self.policy_version: int | None = 0
        self.num_engine_restarts = 0
        self.engine_info: dict[str, Any] = {}
        self.last_metrics: dict[str, float] = {}
        self._proc: subprocess.Popen | None = None
        self._conn: Connection | None = None
        self._log_path: Path | None = None
        self._temporary_log = False  # the log is ours to delete after a clean close
        self._num_calls = 0
        # Set while a generate waits for the engine; a reply to it that a nested call reads is kept here.
        self._generating = False
        self._generate_reply: tuple[str, Any] | None = None
        # The weight-sync group this generator joined (connect_weight_sync's arguments): a restarted
        # engine rejoins it under the same rank.
        self._weight_sync: dict[str, Any] | None = None

    # ----------------------------------------------------------------------------------------------
    # lifecycle

    def setup(self) -> None:
        """Starts the engine process and waits (at most start_timeout_s) until it serves."""
        cfg = self.config
        self.eos_token_ids, self.pad_token_id = _special_tokens(Path(cfg.model))
        if cfg.log_path:
            self._log_path = Path(cfg.log_path)
        else:
            fd, name = tempfile.mkstemp(prefix="llamarl-vllm-engine-", suffix=".log")
            os.close(fd)
            self._log_path = Path(name)
            self._temporary_log = True
        self._log_path.parent.mkdir(parents=True, exist_ok=True)
        self._start_engine()

    def _start_engine(self) -> None:
        """Starts an engine process (appending to the log) and waits until it serves."""
        cfg = self.config
        assert self._log_path is not None
        python = find_vllm_python(cfg.vllm_python)
        ours, theirs = socket.socketpair()
        command = [
            python,
            "-P",  # the script's folder (llamarl/exec, with a types.py) must not shadow the stdlib
            str(_SERVER),
            "--fd", str(theirs.fileno()),
            "--model", str(cfg.model),
            "--dtype", cfg.dtype,
            "--max-num-seqs", str(cfg.max_num_seqs),
            "--num-threads", str(cfg.num_threads),
            "--seed", str(cfg.seed or 0),
        ]  # fmt: skip
        if cfg.max_model_len is not None:
            command += ["--max-model-len", str(cfg.max_model_len)]
        with self._log_path.open("ab") as log:
            self._proc = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=engine_env(num_threads=cfg.num_threads, kv_cache_gib=cfg.kv_cache_gib),
                pass_fds=(theirs.fileno(),),
            )
        theirs.close()
        self._conn = Connection(ours.detach())
        status, info = self._receive(cfg.start_timeout_s, what="the engine to start")[:2]
        if status != "ready":
            self._kill()
            raise EngineError(f"the vLLM engine failed to start:\n{info}")
        self.engine_info = info

    def restart_engine(self) -> None:
        """Replaces the engine with a new one, e.g. after an `EngineLost`; the trainer's state is untouched.

        Kills the old engine if it still runs (a timed-out one may be stuck), starts a new engine
        (waiting at most start_timeout_s) and, if `connect_weight_sync` ran before, has it rejoin the
        same weight-sync group under the same rank (waiting at most that call's timeout_s). The new
        engine serves the checkpoint it starts from, so `policy_version` is None until a
        `receive_weights` succeeds: the trainer's first send after the engine died fails (llamarl.comm
        raises `WeightSyncError` naming this rank there), and the one after re-forms the group with the
        new engine and delivers the latest weights. Objects that forward to this generator (the
        controller's weight receiver) keep working.

        Raises EngineError when max_engine_restarts restarts were already made, or when the new engine
        fails to start or to rejoin (the log tail in the message).
        """
        if self._log_path is None:
            raise RuntimeError("restart_engine() called before setup()")
        if self.num_engine_restarts >= self.config.max_engine_restarts:
            raise EngineError(
                f"the vLLM engine was already restarted {self.num_engine_restarts} times "
                f"(max_engine_restarts={self.config.max_engine_restarts}); its log ends:\n{self._log_tail()}"
            )
        self.num_engine_restarts += 1
        self._kill()
        # The new engine's weights are the checkpoint's, whatever the old one served.
        self.policy_version = None
        with self._log_path.open("a") as log:  # where one engine's log ends and the next begins
            log.write(f"\n[llamarl] restarting the vLLM engine (restart {self.num_engine_restarts})\n")
        self._start_engine()
        if self._weight_sync is not None:
            self._join_weight_sync(**self._weight_sync)

    @property
    def engine_pid(self) -> int | None:
        """Process id of the engine (None before setup and after close)."""
        return None if self._proc is None else self._proc.pid

    def engine_alive(self) -> bool:
        """Whether the engine process runs (False before setup, after close and once it died)."""
        return self._proc is not None and self._proc.poll() is None

    def close(self) -> None:
        """Stops the engine process (politely, then by force after a few seconds). Idempotent."""
        if self._proc is None:
            return
        clean = False
        try:
            if self._proc.poll() is None and self._conn is not None:
                self._conn.send(("close", {}))
                clean = self._proc.wait(timeout=15) == 0
        except (OSError, subprocess.TimeoutExpired, EOFError):
            pass
        self._kill()
        # A temporary log is kept when the engine did not end cleanly: it is the only trace of why.
        if clean and self._temporary_log and self._log_path is not None:
            self._log_path.unlink(missing_ok=True)

    def _kill(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait(timeout=30)
        self._proc = None
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    # ----------------------------------------------------------------------------------------------
    # requests

    def _receive(self, timeout_s: float, *, what: str) -> tuple[Any, ...]:
        """The engine's next message, waiting at most timeout_s; fails fast if the engine dies."""
        deadline = time.monotonic() + timeout_s
        while True:
            message = self._next_message(min(1.0, max(0.0, deadline - time.monotonic())), what=what)
            if message is not None:
                return message
            if time.monotonic() >= deadline:
                raise EngineError(
                    f"timed out after {timeout_s:.0f} s waiting for {what}:\n{self._log_tail()}"
                )

    def _next_message(self, wait_s: float, *, what: str) -> tuple[Any, ...] | None:
        """The engine's next message if one comes within wait_s, else None; EngineLost if it is gone."""
        assert self._conn is not None and self._proc is not None
        if not self._conn.poll(wait_s):
            if self._proc.poll() is not None:
                raise EngineLost(
                    f"the vLLM engine exited (code {self._proc.returncode}) while waiting for {what}; "
                    f"its log ends:\n{self._log_tail()}",
                    exit_code=self._proc.returncode,
                )
            return None
        try:
            return self._conn.recv()
        except (EOFError, OSError):  # EOF, or a reset connection: the engine is gone or going
            raise self._lost(f"closed its connection while waiting for {what}") from None

    def _lost(self, what_happened: str) -> EngineLost:
        """An EngineLost for an engine whose connection broke: waits (bounded) for it to exit."""
        assert self._proc is not None
        try:
            exit_code: int | None = self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            # A closed connection but a live process: it cannot serve us any more; do not leave it.
            self._proc.kill()
            exit_code = self._proc.wait(timeout=30)
        return EngineLost(
            f"the vLLM engine {what_happened} (exit code {exit_code}); its log ends:\n{self._log_tail()}",
            exit_code=exit_code,
        )

    def _send(self, method: str, kwargs: dict[str, Any]) -> None:
        if self._conn is None:
            raise RuntimeError("VLLMGenerator used before setup() or after close()")
        try:
            self._conn.send((method, kwargs))
        except OSError:  # broken pipe: the engine died while idle
            raise self._lost(f"was gone when {method} was sent") from None

    def _reply_to(self, method: str, timeout_s: float) -> tuple[str, Any]:
        """(status, value) of the engine's reply to `method`, waiting at most timeout_s in all.

        A request made during a generate (a nested call, from `between_steps`) may see the generate's
        own reply first (the engine finished just as the request was sent): it is kept for `generate`.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            status, value, replied_to = self._receive(max(0.0, deadline - time.monotonic()), what=method)
            if replied_to == method:
                return status, value
            if replied_to == "generate" and self._generate_reply is None and self._generating:
                self._generate_reply = (status, value)
                continue
            raise EngineError(f"the vLLM engine answered {replied_to!r} while {method!r} was awaited")

    def _call(self, method: str, *, deadline_s: float | None = None, **kwargs: Any) -> Any:
        """Runs `method(**kwargs)` in the engine; waits at most deadline_s (default: config.timeout_s).

        May be called during a generate (from its `between_steps`): the engine answers "receive_weights"
        and "weight_version" between two of its steps.
        """
        self._send(method, kwargs)
        status, value = self._reply_to(method, deadline_s or self.config.timeout_s)
        if status != "ok":
            raise EngineError(f"the vLLM engine failed in {method}:\n{value}")
        return value

    def _log_tail(self, num_chars: int = 6000) -> str:
        try:
            return self._log_path.read_text(errors="replace")[-num_chars:] if self._log_path else ""
        except OSError:
            return ""

    # ----------------------------------------------------------------------------------------------
    # weights

    def connect_weight_sync(
        self, *, host: str, port: int, rank: int, world_size: int, timeout_s: float, src_rank: int = 0
    ) -> int:
        """Has the engine's worker join the trainer's weight-sync group as `rank`; returns how many
        tensors it expects. The trainer's `WeightSender` must be built at about the same time.
        `restart_engine()` has a new engine rejoin this group with the same arguments."""
        num_tensors = self._join_weight_sync(
            host=host, port=port, rank=rank, world_size=world_size, timeout_s=timeout_s, src_rank=src_rank
        )
        self._weight_sync = dict(
            host=host, port=port, rank=rank, world_size=world_size, timeout_s=timeout_s, src_rank=src_rank
        )
        return num_tensors

    def _join_weight_sync(
        self, *, host: str, port: int, rank: int, world_size: int, timeout_s: float, src_rank: int
    ) -> int:
        # A fresh engine in a group that already ran rejoins by itself: its WeightReceiver sees the
        # group's first generation done and asks for a new one (llamarl.comm.WeightReceiver).
        return self._call(
            "init_weight_sync",
            deadline_s=timeout_s + 30,  # the engine's own wait has timeout_s; this one must outlast it
            host=host,
            port=port,
            rank=rank,
            world_size=world_size,
            timeout_s=timeout_s,
            src_rank=src_rank,
        )

    def receive_weights(self, timeout_s: float | None = None) -> int:
        """Has the engine receive one sync from the trainer (load, reset the prefix cache); returns and
        adopts its policy_version. On failure `policy_version` is None (the weights may be partly
        replaced) until a later call succeeds."""
        wait_s = timeout_s or self.config.timeout_s
        self.policy_version = None
        # The engine waits at most wait_s for the trainer; this wait outlasts it to get its error.
        self.policy_version = int(self._call("receive_weights", deadline_s=wait_s + 30, timeout_s=wait_s))
        return self.policy_version

    def engine_policy_version(self) -> int | None:
        """The policy_version the engine itself reports (None after a failed sync)."""
        return self._call("weight_version")

    # ----------------------------------------------------------------------------------------------
    # sampling

    def generate(
        self,
        prompts: list[list[int]],
        *,
        samples_per_prompt: int,
        max_new_tokens: int,
        greedy: bool = False,
        between_steps: Callable[[], None] | None = None,
    ) -> RolloutBatch:
        """Samples `samples_per_prompt` completions of every prompt in one engine call.

        Args:
            prompts: token ids of each prompt (chat template already applied), no padding.
            samples_per_prompt: completions per prompt; they are contiguous in the batch.
            max_new_tokens: completion length limit (a completion that hits it has no EOS).
            greedy: argmax decoding for evaluation (log-probs then under softmax(z), see the module doc).
            between_steps: called about every BETWEEN_STEPS_S while the engine samples. It may take new
                weights in flight (`receive_weights`, directly or through the controller's receiver):
                the engine loads them between two of its steps, the requests keep their KV cache and
                later tokens come from the new weights. It may raise to abandon the call (the engine's
                requests are aborted first). Time spent in it does not count against timeout_s: its
                calls have deadlines of their own.

        Returns:
            RolloutBatch with rewards zeros, token_version_BC the version that sampled each token and
            policy_version_B the version of each sequence's first token.

        Raises:
            EngineLost: the engine died (before or during the call); `restart_engine()` replaces it.
            WeightsNotSyncedError: `policy_version` is None (see the class doc).
        """
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        if self.policy_version is None:
            # Rollouts from a restarted engine's checkpoint weights would be stamped as no policy at
            # all; the caller must deliver the latest weights first.
            raise WeightsNotSyncedError(
                "the vLLM engine holds no synced weights (restarted, or its last sync failed): "
                "receive_weights() first"
            )
        start = time.perf_counter()
        version_at_start = self.policy_version
        # A fresh request seed per call (seeded runs stay reproducible, calls do not repeat each other).
        seed = None if self.config.seed is None else self.config.seed * 100_003 + self._num_calls
        self._num_calls += 1
        reply = self._generate(
            dict(
                prompts=[list(map(int, p)) for p in prompts],
                n=samples_per_prompt,
                max_tokens=max_new_tokens,
                temperature=0.0 if greedy else self.config.temperature,
                stop_token_ids=self.eos_token_ids,
                seed=seed,
            ),
            between_steps,
        )
        if reply["policy_version"] != self.policy_version:
            raise EngineError(
                f"the engine serves policy_version {reply['policy_version']}, the generator expects "
                f"{self.policy_version}"
            )
        token_ids, logprobs, versions = reply["token_ids"], reply["logprobs"], reply["token_versions"]
        num_sequences = len(prompts) * samples_per_prompt
        assert len(token_ids) == num_sequences, (len(token_ids), num_sequences)
        prompt_ids_BP, prompt_mask_BP = _left_pad(
            [p for p in prompts for _ in range(samples_per_prompt)], self.pad_token_id
        )
        length = max(len(t) for t in token_ids)
        completion_ids_BC = torch.full((num_sequences, length), self.pad_token_id, dtype=torch.int64)
        behavior_logprobs_BC = torch.zeros((num_sequences, length), dtype=torch.float32)
        token_version_BC = torch.zeros((num_sequences, length), dtype=torch.int64)
        for i, (ids, lps, vs) in enumerate(zip(token_ids, logprobs, versions, strict=True)):
            completion_ids_BC[i, : len(ids)] = torch.tensor(ids, dtype=torch.int64)
            behavior_logprobs_BC[i, : len(lps)] = torch.tensor(lps, dtype=torch.float32)
            # The engine stamps a token None only if sampled after a failed sync, and then fails the
            # call instead of returning it.
            token_version_BC[i, : len(vs)] = torch.tensor(vs, dtype=torch.int64)
        # vLLM stops at the first EOS and keeps it; the mask also stops at the first EOS, so a padding
        # id equal to EOS (SmolLM2) is never mistaken for a sampled token.
        lengths_B = torch.tensor([len(t) for t in token_ids])
        completion_mask_BC = (torch.arange(length)[None, :] < lengths_B[:, None]).long()
        completion_mask_BC &= _completion_mask(completion_ids_BC, self.eos_token_ids)
        behavior_logprobs_BC = behavior_logprobs_BC.masked_fill(completion_mask_BC == 0, 0.0)
        token_version_BC = token_version_BC * completion_mask_BC
        # The version of each sequence's first token (an empty completion: the version at the start).
        policy_version_B = torch.tensor(
            [vs[0] if vs else version_at_start for vs in versions], dtype=torch.int64
        )

        elapsed = time.perf_counter() - start
        num_tokens = int(completion_mask_BC.sum())
        num_updates = max((len(a) for a in reply["version_arrivals"]), default=0)
        self.last_metrics = {
            "generate_s": elapsed,
            "num_sequences": float(num_sequences),
            "num_completion_tokens": float(num_tokens),
            "tokens_per_s": num_tokens / elapsed if elapsed > 0 else float("nan"),
            "in_flight_updates": float(num_updates),
        }
        return RolloutBatch(
            prompt_ids_BP=prompt_ids_BP,
            prompt_mask_BP=prompt_mask_BP,
            completion_ids_BC=completion_ids_BC,
            completion_mask_BC=completion_mask_BC,
            behavior_logprobs_BC=behavior_logprobs_BC,
            rewards_B=torch.zeros(num_sequences, dtype=torch.float32),
            policy_version_B=policy_version_B,
            token_version_BC=token_version_BC,
            group_size=samples_per_prompt,
        )

    def _generate(self, request: dict[str, Any], between_steps: Callable[[], None] | None) -> dict[str, Any]:
        """Sends one generate request and waits for its reply, calling `between_steps` meanwhile.

        The wait is bounded by config.timeout_s of engine time: the time spent inside `between_steps`
        (a weight sync waiting for the trainer, with a deadline of its own) extends it.
        """
        if self._generating:
            raise RuntimeError("VLLMGenerator.generate called from inside a generate (between_steps)")
        self._send("generate", request)
        self._generating, self._generate_reply = True, None
        try:
            deadline = time.monotonic() + self.config.timeout_s
            while self._generate_reply is None:
                wait_s = BETWEEN_STEPS_S if between_steps is not None else 1.0
                message = self._next_message(
                    min(wait_s, max(0.0, deadline - time.monotonic())), what="generate"
                )
                if message is not None:
                    status, value, replied_to = message
                    if replied_to != "generate":
                        raise EngineError(
                            f"the vLLM engine answered {replied_to!r} while generate was awaited"
                        )
                    self._generate_reply = (status, value)
                    break
                if time.monotonic() >= deadline:
                    raise EngineError(
                        f"timed out after {self.config.timeout_s:.0f} s waiting for generate:\n"
                        f"{self._log_tail()}"
                    )
                if between_steps is not None:
                    called = time.monotonic()
                    between_steps()
                    deadline += time.monotonic() - called
        except BaseException as exc:
            # Abandoned (between_steps raised, a deadline passed): the engine's requests must not run on
            # into the next call, nor its late reply be read as the next call's. A lost engine has none.
            if self._generate_reply is None and not isinstance(exc, EngineLost):
                self._abort_generate()
            raise
        finally:
            self._generating = False
        status, value = self._generate_reply
        self._generate_reply = None
        if status != "ok":
            raise EngineError(f"the vLLM engine failed in generate:\n{value}")
        return value

    def _abort_generate(self, timeout_s: float = 30.0) -> None:
        """Has the engine abort the generate in flight and reads both replies (the abort's, the
        generate's), so that the connection is in step for the next call. An engine that does not
        answer within timeout_s is killed: the next call reports it as an `EngineLost`."""
        try:
            self._send("abort", {})
            deadline = time.monotonic() + timeout_s
            abort_answered = False
            while not (abort_answered and self._generate_reply is not None):
                status, value, replied_to = self._receive(max(0.0, deadline - time.monotonic()), what="abort")
                if replied_to == "abort":
                    abort_answered = True
                elif replied_to == "generate":
                    self._generate_reply = (status, value)
                else:
                    raise EngineError(f"the vLLM engine answered {replied_to!r} while abort was awaited")
        except EngineLost:
            pass  # the next call reports it
        except EngineError:
            if self._proc is not None and self._proc.poll() is None:
                self._proc.kill()


def _special_tokens(model_dir: Path) -> tuple[list[int], int]:
    """(eos ids, pad id) from the folder's generation_config.json / config.json, as HFGenerator picks them."""
    if not model_dir.is_dir():
        raise ValueError(f"the vllm generator serves a local model folder; {model_dir} is not one")
    paths = (model_dir / "generation_config.json", model_dir / "config.json")
    configs = [json.loads(p.read_text()) for p in paths if p.is_file()]
    eos = next((c["eos_token_id"] for c in configs if c.get("eos_token_id") is not None), None)
    if eos is None:
        raise ValueError(f"{model_dir}: the model defines no eos token")
    eos_ids = [eos] if isinstance(eos, int) else list(eos)
    pad = next((c["pad_token_id"] for c in configs if c.get("pad_token_id") is not None), None)
    return eos_ids, eos_ids[0] if pad is None else int(pad)
