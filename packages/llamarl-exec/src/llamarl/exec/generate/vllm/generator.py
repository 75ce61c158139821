"""The `vllm` generator: sampling in a real vLLM engine that runs as a child process of this rank.

Shape legend:
    B  sequences (num_prompts x samples_per_prompt, the samples of one prompt contiguous)
    P  prompt length (left-padded), C  completion length (right-padded)

`VLLMGenerator` turns sampling requests into engine requests (`protocol`) and the engine's replies into
RolloutBatches (`rollouts`); `client.EngineClient` runs the engine process (`server`, in the vLLM
environment) with a deadline on every call. The engine runs in a child process, not in this one, for
two reasons: vLLM pins its own torch, and an in-process engine would adopt the launcher's default
process group.

Weights never pass through this process: `connect_weight_sync` makes the engine's worker join the
trainer's weight-sync group as this rank (vLLM's weight-transfer API, llamarl.comm's `llamarl`
backend), and each `receive_weights` has it receive the trainer's tensors directly (DDMA), load them
with vLLM's own loaders and reset the prefix cache.

In-flight updates (stream mode), pull before pause: a `receive_weights` sent while a `generate` waits
(from its `between_steps`) has the engine pull the sync into its workers' staging while it keeps
stepping the requests, and swap it in between two steps once it is whole: generation pauses for the
swap alone, not for the transfer. The requests stay in flight with their KV cache from the old weights
(partial rollouts, as in PipelineRL / AReaL), later tokens are sampled by the new weights, every token
is stamped with the version that sampled it (`token_version_BC`), and the prefix-cache reset waits
until the generate's requests are done. The call returns once the sync is swapped in.

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

from collections.abc import Callable
from pathlib import Path

import torch

from llamarl.comm import WeightSyncEndpoint
from llamarl.comm.adapters.vllm import INITIAL_POLICY_VERSION
from llamarl.exec.config import GeneratorConfig, SamplingConfig
from llamarl.exec.generate.vllm import protocol as p
from llamarl.exec.generate.vllm.client import EngineClient, EngineError, EngineLost
from llamarl.exec.generate.vllm.engine_args import server_args, special_tokens
from llamarl.exec.generate.vllm.rollouts import EngineTurnSession, rollout_batch
from llamarl.exec.types import GenerationPaused, RolloutBatch, WeightsNotSyncedError, synced_version

__all__ = ["EngineError", "EngineLost", "VLLMGenerator", "WeightsNotSyncedError"]


class VLLMGenerator:
    """Samples completions in a vLLM engine process; implements `llamarl.exec.types.Generator`.

    Attributes:
        policy_version: (read-only) the version of the weights the engine serves; set by
            `receive_weights` and checked against the engine's own report on every generate. None while
            the engine holds no synced weights: after `restart_engine()`, a failed `receive_weights` or
            `mark_weights_lost()`, until the next successful receive (or `serve_initial_weights()`);
            `generate` then raises `WeightsNotSyncedError`.
        num_engine_restarts: how many times `restart_engine()` replaced the engine.
    """

    # `generate` takes `between_steps`: stream mode loads new weights into the engine between its steps,
    # with the requests in flight (partial rollouts).
    supports_in_flight_updates = True
    can_restart_engine = True

    def __init__(
        self,
        model: str,
        sampling: SamplingConfig,
        engine: GeneratorConfig,
        *,
        dtype: str = "float32",
        seed: int | None = None,
        num_threads: int = 1,
        start_timeout_s: float = 300.0,
        timeout_s: float = 600.0,
        log_path: str | None = None,
        device: str = "cpu",
        batch_sequences: int = 64,
        in_flight_updates: bool = True,
    ) -> None:
        """`model`: the local transformers folder (safetensors) the engine serves; the trainer starts
        from it. `dtype`: engine weights and compute (the trainer sends in it). `seed`: the engine's;
        each generate derives its request seed from it. `num_threads`: CPU threads of the engine
        process. `start_timeout_s` bounds the engine's start (imports, model load), `timeout_s` every
        other call (a generate, a weight sync). `log_path`: where the engine's output goes (default: a
        temporary file, deleted after a clean close). `device`: the generator rank's ("cuda:i": the
        engine runs on that GPU alone, with engine.gpu_memory_utilization of it, CUDA graphs and async
        scheduling as `engine` says). `batch_sequences`: the sequences one generate asks for, what
        the engine schedules at once unless engine.max_num_seqs says otherwise. `in_flight_updates`:
        whether weights may load while a generate runs (stream mode); the engine then never schedules
        asynchronously, so that each step's tokens are stamped with the weights that computed them."""
        self.model_name = model
        self.sampling = sampling
        self.engine = engine
        self.device = device
        self.batch_sequences = batch_sequences
        self.supports_in_flight_updates = in_flight_updates
        self.dtype = dtype
        self.seed = seed
        self.num_threads = num_threads
        self.start_timeout_s = start_timeout_s
        self.timeout_s = timeout_s
        self.log_path = log_path
        self._policy_version: int | None = 0
        self.num_engine_restarts = 0
        self._client: EngineClient | None = None
        self._num_calls = 0
        # The weight-sync group this generator joined: a restarted engine rejoins it under the same rank.
        self._endpoint: WeightSyncEndpoint | None = None

    @property
    def policy_version(self) -> int | None:
        """The version of the weights the engine serves (None: no synced policy; see the class doc)."""
        return self._policy_version

    # ----------------------------------------------------------------------------------------------
    # lifecycle

    def setup(self) -> None:
        """Starts the engine process and waits (at most start_timeout_s) until it serves."""
        self.eos_token_ids, self.pad_token_id = special_tokens(Path(self.model_name))
        self._client = EngineClient(
            server_args=self.server_args(),
            vllm_python=self.engine.vllm_python,
            num_threads=self.num_threads,
            log_path=Path(self.log_path) if self.log_path else None,
            start_timeout_s=self.start_timeout_s,
            timeout_s=self.timeout_s,
            device=self.device,
        )
        self._client.start()

    def server_args(self) -> list[str]:
        """The engine process's flags (`engine_args.server_args`): what the vLLM engine is built with."""
        return server_args(
            model=self.model_name,
            dtype=self.dtype,
            engine=self.engine,
            device=self.device,
            num_threads=self.num_threads,
            seed=self.seed,
            sequences=self.engine.max_num_seqs or self.batch_sequences,
            max_new_tokens=self.sampling.max_new_tokens,
            in_flight_updates=self.supports_in_flight_updates,
        )

    @property
    def engine_pid(self) -> int | None:
        """Process id of the engine (None before setup and after close)."""
        return None if self._client is None else self._client.pid

    def engine_alive(self) -> bool:
        """Whether the engine process runs (False before setup, after close and once it died)."""
        return self._client is not None and self._client.alive()

    def restart_engine(self) -> None:
        """Replaces the engine with a new one, e.g. after an `EngineLost`; the trainer's state is untouched.

        Kills the old engine if it still runs (a timed-out one may be stuck), starts a new engine
        (waiting at most start_timeout_s) and, if `connect_weight_sync` ran before, has it rejoin the
        same weight-sync group with the same endpoint (waiting at most its timeout_s). The new
        engine serves the checkpoint it starts from, so `policy_version` is None until a
        `receive_weights` succeeds: the trainer's first send after the engine died fails (llamarl.comm
        raises `WeightSyncError` naming this rank there), and the one after re-forms the group with the
        new engine and delivers the latest weights.

        Raises EngineError when max_engine_restarts restarts were already made, or when the new engine
        fails to start or to rejoin (the log tail in the message).
        """
        client = self._client_or_raise()
        if self.num_engine_restarts >= self.engine.max_engine_restarts:
            raise EngineError(
                f"the vLLM engine was already restarted {self.num_engine_restarts} times "
                f"(max_engine_restarts={self.engine.max_engine_restarts}); its log ends:\n{client.log_tail()}"
            )
        self.num_engine_restarts += 1
        client.kill()
        # The new engine's weights are the checkpoint's, whatever the old one served.
        self._policy_version = None
        with client.log_path.open("a") as log:  # where one engine's log ends and the next begins
            log.write(f"\n[llamarl] restarting the vLLM engine (restart {self.num_engine_restarts})\n")
        client.start()
        if self._endpoint is not None:
            self._join_weight_sync(self._endpoint)

    def close(self) -> None:
        """Stops the engine process (politely, then by force after a few seconds). Idempotent."""
        if self._client is not None:
            self._client.close()

    def _client_or_raise(self) -> EngineClient:
        if self._client is None:
            raise RuntimeError("VLLMGenerator used before setup()")
        return self._client

    # ----------------------------------------------------------------------------------------------
    # weights

    def connect_weight_sync(self, endpoint: WeightSyncEndpoint) -> int:
        """Has the engine's worker join the trainer's weight-sync group as the member `endpoint`
        describes; returns how many tensors each sync delivers. The trainer's `WeightSender` must be
        built at about the same time. `endpoint.backend` "nccl": the worker receives straight into
        buffers on its GPU. `restart_engine()` has a new engine rejoin with the same endpoint."""
        num_tensors = self._join_weight_sync(endpoint)
        self._endpoint = endpoint
        return num_tensors

    def _join_weight_sync(self, endpoint: WeightSyncEndpoint) -> int:
        # A fresh engine in a group that already ran rejoins by itself: its WeightReceiver sees the
        # group's first generation done and asks for a new one (llamarl.comm.WeightReceiver). The
        # engine's own wait has the endpoint's timeout_s; this one must outlast it.
        request = p.InitWeightSync(endpoint=endpoint, announce_timeout_s=self.timeout_s)
        return self._client_or_raise().call(request, deadline_s=endpoint.timeout_s + 30)

    def receive_weights(self, timeout_s: float | None = None) -> int:
        """Has the engine receive one sync from the trainer (load, reset the prefix cache); returns and
        adopts its policy_version. On failure `policy_version` is None (the weights may be partly
        replaced) until a later call succeeds."""
        wait_s = timeout_s or self.timeout_s
        self._policy_version = None
        # The engine waits at most wait_s for the trainer; this wait outlasts it to get its error.
        received = self._client_or_raise().call(p.ReceiveWeights(timeout_s=wait_s), deadline_s=wait_s + 30)
        self._policy_version = int(received)
        return self._policy_version

    def mark_weights_lost(self) -> None:
        """`policy_version` is None (no generate) until a `receive_weights` succeeds."""
        self._policy_version = None

    def serve_initial_weights(self) -> None:
        """The engine serves the checkpoint it started from (its own report says so, e.g. after a
        restart): that is policy_version 0. Raises EngineError when the engine reports other weights."""
        reported = self.engine_policy_version()
        if reported != INITIAL_POLICY_VERSION:
            raise EngineError(f"the vLLM engine serves policy_version {reported}, not its checkpoint's")
        self._policy_version = INITIAL_POLICY_VERSION

    def open_turns(
        self, *, greedy: bool = False, between_steps: Callable[[], None] | None = None
    ) -> EngineTurnSession:
        """Model turns of multi-turn episodes, all in flight in the engine: each turn is returned as soon
        as it ends, and the episode's next turn starts while the others decode. `between_steps` runs
        between engine calls (new weights taken in flight: later tokens are stamped with their version)."""
        synced_version(self._policy_version, "the vLLM engine")
        return EngineTurnSession(
            self._client_or_raise(),
            temperature=0.0 if greedy else self.sampling.temperature,
            eos_token_ids=self.eos_token_ids,
            seed=self._next_seed(),
            between_steps=between_steps,
        )

    def engine_policy_version(self) -> int | None:
        """The policy_version the engine itself reports (None after a failed sync)."""
        return self._client_or_raise().call(p.WeightVersion())

    def generation_progress(self) -> tuple[list[int], list[bool]]:
        """How far the generate in flight got (callable from its `between_steps`): the tokens each
        completion sampled so far and whether it finished, as of the engine's last step; empty lists
        outside a generate. What waits on sampling progress reads it, never the clock."""
        progress: p.ProgressReply = self._client_or_raise().call(p.Progress())
        return progress.tokens, progress.finished

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
        """Samples `samples_per_prompt` completions of every prompt (token ids, chat template applied, no
        padding; a prompt's completions contiguous) in one engine call. `greedy`: argmax decoding for
        evaluation (log-probs then under softmax(z), see the module doc).

        `between_steps` is called about every BETWEEN_STEPS_S while the engine samples. It may take new
        weights in flight (`receive_weights`, directly or through the controller's receiver): the
        engine loads them between two of its steps, the requests keep their KV cache and later tokens
        come from the new weights. It may raise to abandon the call (the engine's requests are aborted
        first), or raise `PauseGeneration` to end it keeping what was sampled: `GenerationPaused` then
        holds every completion as far as it got. Time spent in it does not count against timeout_s:
        its calls have deadlines of their own.

        Returns a RolloutBatch with rewards zeros, token_version_BC the version that sampled each token
        and policy_version_B that of each sequence's first token. Raises `EngineLost` when the engine
        died (before or during the call; `restart_engine()` replaces it), `WeightsNotSyncedError` while
        `policy_version` is None (see the class doc).
        """
        if not prompts or any(len(prompt) == 0 for prompt in prompts):
            raise ValueError("every prompt needs at least one token")
        version_at_start = synced_version(self._policy_version, "the vLLM engine")
        request = p.Generate(
            prompts=[list(map(int, prompt)) for prompt in prompts],
            n=samples_per_prompt,
            max_tokens=max_new_tokens,
            temperature=0.0 if greedy else self.sampling.temperature,
            stop_token_ids=self.eos_token_ids,
            seed=self._next_seed(),
        )
        reply = self._client_or_raise().generate(request, between_steps)
        _check_served(reply.policy_version, version_at_start, now=self._policy_version)
        batch = rollout_batch(
            reply,
            prompts,
            samples_per_prompt=samples_per_prompt,
            eos_token_ids=self.eos_token_ids,
            pad_token_id=self.pad_token_id,
            version_at_start=version_at_start,
        )
        finished_B = torch.tensor(reply.finished, dtype=torch.bool)
        if reply.paused and not bool(finished_B.all()):
            raise GenerationPaused(batch, finished_B)
        return batch

    def _next_seed(self) -> int | None:
        """A fresh request seed per call: seeded runs stay reproducible, calls do not repeat each other."""
        seed = None if self.seed is None else self.seed * 100_003 + self._num_calls
        self._num_calls += 1
        return seed


def _check_served(served: int | None, version_at_start: int, *, now: int | None) -> None:
    """Raises EngineError unless the version an engine served at the end of a generate is its own: any
    from the call's start (`version_at_start`) to the generator's `now`.

    The generator can hold a newer version than the reply: a sync taken in flight may complete after
    the generate ended (the engine ends the generate, replies, then loads the weights the generator
    asked for meanwhile).
    """
    if served is None or now is None or not version_at_start <= served <= now:
        raise EngineError(
            f"the engine served policy_version {served}, the generator expects {version_at_start}"
            + ("" if now == version_at_start else f" to {now}")
        )
