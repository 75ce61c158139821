"""The `vllm` generator: sampling in a real vLLM engine that runs as a child process of this rank.

Shape legend:
    B  sequences (num_prompts x samples_per_prompt, the samples of one prompt contiguous)
    P  prompt length (left-padded), C  completion length (right-padded)

`VLLMGenerator` turns sampling requests into engine calls and the engine's replies into RolloutBatches;
`llamarl.exec.generate.vllm.client.EngineClient` runs the engine process
(`llamarl.exec.generate.vllm.server`, in the
vLLM environment) with a deadline on every call. The engine runs in a child process, not in this one,
for two reasons: vLLM pins its own torch, and an in-process engine would adopt the launcher's default
process group.

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
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from llamarl.comm import DEAD_AFTER_S
from llamarl.comm.layouts import dtype_from_str
from llamarl.exec.config import GeneratorConfig, SamplingConfig
from llamarl.exec.generate.vllm.client import BETWEEN_STEPS_S, EngineClient, EngineError, EngineLost
from llamarl.exec.padding import completion_mask, left_pad, right_pad
from llamarl.exec.types import GenerationPaused, RolloutBatch, TurnOutput

__all__ = ["EngineError", "EngineLost", "VLLMGenerator", "WeightsNotSyncedError"]


class WeightsNotSyncedError(RuntimeError):
    """`generate` was called while the engine holds no synced policy: it was restarted (it serves the
    checkpoint it started from, not the trainer's latest weights) or its last weight sync failed
    (weights partly replaced). A `receive_weights` that succeeds ends this state."""


class VLLMGenerator:
    """Samples completions in a vLLM engine process; implements `llamarl.exec.types.Generator`.

    Attributes:
        policy_version: the version of the weights the engine serves; set by `receive_weights` and
            checked against the engine's own report on every generate. None while the engine holds no
            synced weights: after `restart_engine()` and after a failed `receive_weights`, until the
            next successful one; `generate` then raises `WeightsNotSyncedError`.
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
        self.policy_version: int | None = 0
        self.num_engine_restarts = 0
        self._client: EngineClient | None = None
        self._temporary_log = False  # the log is ours to delete after a clean close
        self._num_calls = 0
        # The weight-sync group this generator joined (connect_weight_sync's arguments): a restarted
        # engine rejoins it under the same rank.
        self._weight_sync: dict[str, Any] | None = None

    # ----------------------------------------------------------------------------------------------
    # lifecycle

    def setup(self) -> None:
        """Starts the engine process and waits (at most start_timeout_s) until it serves."""
        self.eos_token_ids, self.pad_token_id = _special_tokens(Path(self.model_name))
        if self.log_path:
            log_path = Path(self.log_path)
        else:
            fd, name = tempfile.mkstemp(prefix="llamarl-vllm-engine-", suffix=".log")
            os.close(fd)
            log_path = Path(name)
            self._temporary_log = True
        self._client = EngineClient(
            server_args=self.server_args(),
            vllm_python=self.engine.vllm_python,
            num_threads=self.num_threads,
            log_path=log_path,
            start_timeout_s=self.start_timeout_s,
            timeout_s=self.timeout_s,
            device=self.device,
        )
        self._client.start()

    def server_args(self) -> list[str]:
        """The engine process's flags (`llamarl.exec.generate.vllm.server`): what the vLLM engine is built
        with."""
        engine = self.engine
        cuda = self.device.startswith("cuda")
        args = [
            "--model", str(self.model_name),
            "--dtype", self.dtype,
            "--max-num-seqs", str(engine.max_num_seqs or self.batch_sequences),
            "--num-threads", str(self.num_threads),
            "--seed", str(self.seed or 0),
            "--device", "cuda" if cuda else "cpu",
            "--gpu-memory-utilization", str(engine.gpu_memory_utilization),
        ]  # fmt: skip
        if engine.max_model_len is not None:
            args += ["--max-model-len", str(engine.max_model_len)]
        if not cuda:  # on CUDA the KV cache takes what gpu_memory_utilization leaves
            args += ["--kv-cache-bytes", str(self.kv_cache_bytes())]
        if cuda and engine.cuda_graphs:
            args.append("--cuda-graphs")
        # Tokens of a step scheduled ahead would be stamped with the version of weights loaded after it.
        if cuda and engine.async_scheduling and not self.supports_in_flight_updates:
            args.append("--async-scheduling")
        return args

    def kv_cache_bytes(self) -> int:
        """The CPU engine's KV cache: engine.kv_cache_gib, or sized for this run (`kv_cache_bytes`)."""
        if self.engine.kv_cache_gib is not None:
            return int(self.engine.kv_cache_gib * 2**30)
        config = json.loads((Path(self.model_name) / "config.json").read_text())
        sized = kv_cache_bytes(
            config.get("text_config", config),  # a vision-language model's is its text model's
            dtype=self.dtype,
            sequences=self.engine.max_num_seqs or self.batch_sequences,
            new_tokens=self.sampling.max_new_tokens,
            max_model_len=self.engine.max_model_len,
        )
        return FALLBACK_KV_CACHE_BYTES if sized is None else sized

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
        same weight-sync group under the same rank (waiting at most that call's timeout_s). The new
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
        self.policy_version = None
        with client.log_path.open("a") as log:  # where one engine's log ends and the next begins
            log.write(f"\n[llamarl] restarting the vLLM engine (restart {self.num_engine_restarts})\n")
        client.start()
        if self._weight_sync is not None:
            self._join_weight_sync(self._weight_sync)

    def close(self) -> None:
        """Stops the engine process (politely, then by force after a few seconds). Idempotent."""
        if self._client is None:
            return
        clean = self._client.close()
        # A temporary log is kept when the engine did not end cleanly: it is the only trace of why.
        if clean and self._temporary_log:
            self._client.log_path.unlink(missing_ok=True)

    def _client_or_raise(self) -> EngineClient:
        if self._client is None:
            raise RuntimeError("VLLMGenerator used before setup()")
        return self._client

    # ----------------------------------------------------------------------------------------------
    # weights

    def connect_weight_sync(
        self,
        *,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        timeout_s: float,
        dead_after_s: float = DEAD_AFTER_S,
        src_rank: int = 0,
        backend: str = "gloo",
    ) -> int:
        """Has the engine's worker join the trainer's weight-sync group as `rank`; returns how many
        tensors it expects. The trainer's `WeightSender` must be built at about the same time.
        `backend` "nccl": the worker receives straight into buffers on its GPU. `restart_engine()` has a
        new engine rejoin this group with the same arguments."""
        arguments: dict[str, Any] = dict(
            host=host,
            port=port,
            rank=rank,
            world_size=world_size,
            timeout_s=timeout_s,
            dead_after_s=dead_after_s,
            src_rank=src_rank,
            backend=backend,
        )
        num_tensors = self._join_weight_sync(arguments)
        self._weight_sync = arguments
        return num_tensors

    def _join_weight_sync(self, arguments: dict[str, Any]) -> int:
        """Has the engine's worker join with `connect_weight_sync`'s arguments (kept for rejoins)."""
        # A fresh engine in a group that already ran rejoins by itself: its WeightReceiver sees the
        # group's first generation done and asks for a new one (llamarl.comm.WeightReceiver).
        return self._client_or_raise().call(
            "init_weight_sync",
            # the engine's own wait has timeout_s; this one must outlast it
            deadline_s=arguments["timeout_s"] + 30,
            **arguments,
        )

    def receive_weights(self, timeout_s: float | None = None) -> int:
        """Has the engine receive one sync from the trainer (load, reset the prefix cache); returns and
        adopts its policy_version. On failure `policy_version` is None (the weights may be partly
        replaced) until a later call succeeds."""
        wait_s = timeout_s or self.timeout_s
        self.policy_version = None
        # The engine waits at most wait_s for the trainer; this wait outlasts it to get its error.
        self.policy_version = int(
            self._client_or_raise().call("receive_weights", deadline_s=wait_s + 30, timeout_s=wait_s)
        )
        return self.policy_version

    def open_turns(self, *, greedy: bool = False, between_steps: Callable[[], None] | None = None):
        """Model turns of multi-turn episodes, all in flight in the engine: each turn is returned as soon
        as it ends, and the episode's next turn starts while the others decode. `between_steps` runs
        between engine calls (new weights taken in flight: later tokens are stamped with their version)."""
        if self.policy_version is None:
            raise WeightsNotSyncedError(
                "the vLLM engine holds no synced weights (restarted, or its last sync failed): "
                "receive_weights() first"
            )
        seed = None if self.seed is None else self.seed * 100_003 + self._num_calls
        self._num_calls += 1
        return _EngineTurns(self, greedy=greedy, seed=seed, between_steps=between_steps)

    def engine_policy_version(self) -> int | None:
        """The policy_version the engine itself reports (None after a failed sync)."""
        return self._client_or_raise().call("weight_version")

    def generation_progress(self) -> tuple[list[int], list[bool]]:
        """How far the generate in flight got (callable from its `between_steps`): the tokens each
        completion sampled so far and whether it finished, as of the engine's last step; empty lists
        outside a generate. What waits on sampling progress reads it, never the clock."""
        progress = self._client_or_raise().call("progress")
        return progress["tokens"], progress["finished"]

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
                requests are aborted first), or raise `PauseGeneration` to end it keeping what was
                sampled (`GenerationPaused`). Time spent in it does not count against timeout_s: its
                calls have deadlines of their own.

        Returns:
            RolloutBatch with rewards zeros, token_version_BC the version that sampled each token and
            policy_version_B the version of each sequence's first token.

        Raises:
            GenerationPaused: `between_steps` raised `PauseGeneration` before every completion finished;
                it holds the completions as far as they got.
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
        version_at_start = self.policy_version
        # A fresh request seed per call (seeded runs stay reproducible, calls do not repeat each other).
        seed = None if self.seed is None else self.seed * 100_003 + self._num_calls
        self._num_calls += 1
        reply = self._client_or_raise().generate(
            dict(
                prompts=[list(map(int, p)) for p in prompts],
                n=samples_per_prompt,
                max_tokens=max_new_tokens,
                temperature=0.0 if greedy else self.sampling.temperature,
                stop_token_ids=self.eos_token_ids,
                seed=seed,
            ),
            between_steps,
        )
        # The engine reports the version it served when the generate ended. A sync taken in flight may
        # complete after that (the engine ends the generate, replies, then loads the weights the
        # generator asked for meanwhile), so the generator can hold a newer version than the reply: any
        # version from the call's start to now is the engine's own; anything else is not.
        served, now = reply["policy_version"], self.policy_version
        if served is None or now is None or not version_at_start <= served <= now:
            raise EngineError(
                f"the engine served policy_version {served}, the generator expects {version_at_start}"
                + ("" if now == version_at_start else f" to {now}")
            )
        token_ids, logprobs, versions = reply["token_ids"], reply["logprobs"], reply["token_versions"]
        num_sequences = len(prompts) * samples_per_prompt
        assert len(token_ids) == num_sequences, (len(token_ids), num_sequences)
        prompt_ids_BP, prompt_mask_BP = left_pad(
            [p for p in prompts for _ in range(samples_per_prompt)], self.pad_token_id
        )
        completion_ids_BC = right_pad(token_ids, self.pad_token_id, torch.int64)
        length = completion_ids_BC.shape[1]
        behavior_logprobs_BC = right_pad(logprobs, 0.0, torch.float32)
        # The engine stamps a token None only if sampled after a failed sync, and then fails the call
        # instead of returning it.
        token_version_BC = right_pad(versions, 0, torch.int64)
        assert behavior_logprobs_BC.shape == token_version_BC.shape == completion_ids_BC.shape
        # vLLM stops at the first EOS and keeps it; the mask also stops at the first EOS, so a padding
        # id equal to EOS (SmolLM2) is never mistaken for a sampled token.
        lengths_B = torch.tensor([len(t) for t in token_ids])
        completion_mask_BC = (torch.arange(length)[None, :] < lengths_B[:, None]).long()
        completion_mask_BC &= completion_mask(completion_ids_BC, self.eos_token_ids)
        behavior_logprobs_BC = behavior_logprobs_BC.masked_fill(completion_mask_BC == 0, 0.0)
        token_version_BC = token_version_BC * completion_mask_BC
        # The version of each sequence's first token (an empty completion: the version at the start).
        policy_version_B = torch.tensor(
            [vs[0] if vs else version_at_start for vs in versions], dtype=torch.int64
        )

        batch = RolloutBatch(
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
        finished_B = torch.tensor(reply.get("finished", [True] * num_sequences), dtype=torch.bool)
        if reply.get("paused") and not bool(finished_B.all()):
            raise GenerationPaused(batch, finished_B)
        return batch


# Tokens a prompt may take (chat template, earlier turns) when the KV cache is sized for a run. A run whose
# sequences need more still runs: vLLM then preempts sequences and recomputes them later.
PROMPT_TOKENS_ALLOWANCE = 1024
# A config that does not give the attention's shapes (the sizes a KV cache is made of): 1 GiB.
FALLBACK_KV_CACHE_BYTES = 1 << 30


def kv_cache_bytes(
    model_config: dict, *, dtype: str, sequences: int, new_tokens: int, max_model_len: int | None
) -> int | None:
    """Bytes of KV cache for `sequences` sequences of PROMPT_TOKENS_ALLOWANCE + `new_tokens` tokens, and
    at least for one of the engine's longest (`max_model_len`, else the model's: vLLM refuses to start
    otherwise), with 10% over for vLLM's rounding to whole blocks. `model_config`: the model folder's
    config.json; a token takes keys and values of every layer's KV heads, in `dtype` (a torch dtype's
    name). None when the config lacks the layer count or the head count."""
    if not {"num_hidden_layers", "num_attention_heads"} <= model_config.keys():
        return None
    heads = model_config["num_attention_heads"]
    kv_heads = model_config.get("num_key_value_heads") or heads
    head_dim = model_config.get("head_dim") or model_config.get("hidden_size", 0) // heads
    if not head_dim:
        return None
    per_token = 2 * model_config["num_hidden_layers"] * kv_heads * head_dim * dtype_from_str(dtype).itemsize
    longest = max_model_len or model_config.get("max_position_embeddings", 0)
    tokens = max(sequences * (PROMPT_TOKENS_ALLOWANCE + new_tokens), longest)
    return int(tokens * per_token * 1.1)


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


class _EngineTurns:
    """`TurnSession` over the engine's turns_add / turns_wait / turns_abort (see `open_turns`)."""

    def __init__(
        self,
        generator: VLLMGenerator,
        *,
        greedy: bool,
        seed: int | None,
        between_steps: Callable[[], None] | None,
    ) -> None:
        self.generator = generator
        self.greedy = greedy
        self.seed = seed
        self.between_steps = between_steps
        self.new: list[list[Any]] = []
        self.running = 0

    def submit(self, key: int, prompt_ids: list[int], max_new_tokens: int) -> None:
        self.new.append([int(key), [int(t) for t in prompt_ids], int(max_new_tokens)])

    def wait(self) -> list[TurnOutput]:
        client = self.generator._client_or_raise()
        eos = set(self.generator.eos_token_ids)
        if self.new:
            temperature = 0.0 if self.greedy else self.generator.sampling.temperature
            client.call(
                "turns_add",
                requests=self.new,
                temperature=temperature,
                stop_token_ids=self.generator.eos_token_ids,
                seed=self.seed,
            )
            self.running += len(self.new)
            self.new = []
        while self.running:
            done = client.call("turns_wait", max_s=BETWEEN_STEPS_S)
            if done:
                self.running -= len(done)
                return [
                    TurnOutput(
                        key=int(turn["key"]),
                        token_ids=turn["token_ids"],
                        logprobs=turn["logprobs"],
                        versions=[int(v) for v in turn["versions"]],
                        ended=bool(turn["token_ids"]) and turn["token_ids"][-1] in eos,
                    )
                    for turn in done
                ]
            if self.between_steps is not None:
                self.between_steps()
        return []

    def close(self) -> None:
        if self.running or self.new:
            self.new, self.running = [], 0
            self.generator._client_or_raise().call("turns_abort")
