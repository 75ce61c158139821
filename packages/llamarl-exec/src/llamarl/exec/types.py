"""Data that moves between executors, and the small Protocols executors implement.

Shape legend (suffixes on tensor names):
    B  sequences in the batch (num_prompts x samples_per_prompt, grouped: the samples of one prompt
       are contiguous)
    P  prompt length, left-padded to the longest prompt of the batch
    C  completion length, right-padded to the longest completion of the batch
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Protocol

import torch

from llamarl.comm import WeightSyncEndpoint


@dataclass(kw_only=True)
class RolloutBatch:
    """Sampled completions with everything the trainer needs, as plain tensors.

    Every field is a tensor so a batch can cross a process boundary as tensors (see
    `llamarl.control.run.channels`), never as pickled Python objects.
    """

    prompt_ids_BP: torch.Tensor  # int64, left-padded with the pad token
    prompt_mask_BP: torch.Tensor  # int64, 1 on real prompt tokens
    completion_ids_BC: torch.Tensor  # int64, right-padded with the pad token
    completion_mask_BC: torch.Tensor  # int64, 1 on sampled tokens (EOS included), 0 on padding
    behavior_logprobs_BC: torch.Tensor  # float32, log mu(y_t) of the sampling distribution; 0 on padding
    rewards_B: torch.Tensor  # float32, one scalar reward per sequence
    policy_version_B: torch.Tensor  # int64, the policy_version that sampled the sequence's first token
    group_size: int  # samples per prompt; B is a multiple of it
    # int64, the policy_version that sampled each token (weights may change mid-sequence when a stream
    # generator takes new weights in flight); 0 on padding. None: every token of a sequence was sampled
    # by its policy_version_B (filled in by __post_init__).
    token_version_BC: torch.Tensor | None = None
    # int64, each sequence's prompt as a position in the run's shuffled data order (the controller sets
    # it; OUTPUT_DIR/trained_groups.jsonl names the groups each step trained on by it). -1: not set.
    prompt_position_B: torch.Tensor | None = None
    # Mixture-of-experts policies: the experts each position went to in every MoE layer, as the
    # generator routed it (`llamarl.exec.moe.routes`: uint8, NO_ROUTE where none; L MoE layers, K experts
    # per token). The trainer replays them (routing replay). None: a dense model, or no routes recorded.
    prompt_routes_BPLK: torch.Tensor | None = None
    completion_routes_BCLK: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.token_version_BC is None:
            self.token_version_BC = self.policy_version_B[:, None] * self.completion_mask_BC.long()
        if self.prompt_position_B is None:
            self.prompt_position_B = torch.full_like(self.policy_version_B, -1)

    @property
    def num_sequences(self) -> int:
        return self.prompt_ids_BP.shape[0]

    @property
    def num_completion_tokens(self) -> int:
        return int(self.completion_mask_BC.sum())

    def token_lags_BC(self, current_version: int) -> torch.Tensor:
        """int64 [B, C]: how many policy versions behind `current_version` each token is (0 on padding)."""
        assert self.token_version_BC is not None
        return (current_version - self.token_version_BC) * self.completion_mask_BC.long()

    def select(self, rows: slice | list[int]) -> RolloutBatch:
        """The batch of the sequences in `rows` (views for a slice, copies for a list; padding kept)."""
        return RolloutBatch(
            **{name: t[rows] for name, t in self.tensors().items()}, group_size=self.group_size
        )

    def data_parallel_part(self, index: int, num_parts: int) -> RolloutBatch:
        """Part `index` of `num_parts` equal, consecutive parts of whole groups (one per trainer rank).

        Groups stay whole because advantages are computed within a group.
        """
        num_groups = self.num_sequences // self.group_size
        if num_groups % num_parts:
            raise ValueError(f"{num_groups} groups cannot be split evenly over {num_parts} trainer ranks")
        rows = self.num_sequences // num_parts
        return self.select(slice(index * rows, (index + 1) * rows))

    @property
    def has_routes(self) -> bool:
        """Whether the batch carries its generator's expert routes (a mixture-of-experts policy)."""
        return self.prompt_routes_BPLK is not None

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensor fields by name, in a fixed order (token_version_BC and prompt_position_B always
        present, the routes where the batch has them)."""
        named = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "group_size"}
        return {name: t for name, t in named.items() if t is not None}

    def state(self) -> dict[str, torch.Tensor | int]:
        """What a checkpoint keeps of the batch: its tensors by name, and `group_size` (plain values that
        torch.save writes without pickling a class of ours); `from_state` reads it back."""
        return {**self.tensors(), "group_size": self.group_size}

    @classmethod
    def from_state(cls, state: dict[str, torch.Tensor | int]) -> RolloutBatch:
        """The batch that `state()` described."""
        return cls(**state)  # type: ignore[arg-type]


@dataclass(frozen=True)
class TurnOutput:
    """One sampled model turn of a multi-turn episode (token-in/token-out: ids exactly as sampled)."""

    key: int  # the key it was submitted under
    token_ids: list[int]  # the sampled tokens, up to and including the EOS when it ended with one
    logprobs: list[float]  # behaviour log-prob of each sampled token, log softmax(z / T)
    versions: list[int]  # the policy_version that sampled each token
    ended: bool  # whether it ended with an EOS token (else it hit its token limit)


class TurnSession(Protocol):
    """Model turns of many episodes in flight: submit a turn's full token prefix, wait for turns to end.

    Returned by `Generator.open_turns`. The vLLM generator keeps every submitted turn running in its
    engine and returns each as soon as it ends (an episode's next turn can start while others decode);
    the HF generator samples the turns pending at each `wait` in one batched generate call.
    """

    def submit(self, key: int, prompt_ids: list[int], max_new_tokens: int) -> None:
        """Starts sampling a turn after `prompt_ids` (the episode so far, as token ids)."""
        ...

    def wait(self) -> list[TurnOutput]:
        """At least one finished turn while any is pending ([] when none is), in any order."""
        ...

    def close(self) -> None:
        """Abandons the turns still running."""
        ...


class PauseGeneration(Exception):
    """Raised by a `between_steps` callback to stop a `generate` early and keep what it sampled: the
    generator then raises `GenerationPaused` with the completions as far as they got. Stream mode
    pauses the requests in flight for a checkpoint or an evaluation and continues them afterwards."""


class GenerationPaused(Exception):
    """A `generate` stopped by `PauseGeneration`.

    Attributes:
        partial: every completion as far as it got: tokens, behaviour log-probs and the version of each
            token (rewards zeros); B = num_prompts x samples_per_prompt rows as `generate` returns.
        finished_B: bool [B], which completions are complete (ended by EOS or at max_new_tokens); the
            others continue from `prompt + partial completion`.
    """

    def __init__(self, partial: RolloutBatch, finished_B: torch.Tensor) -> None:
        super().__init__(f"generate paused with {int((~finished_B).sum())} of {len(finished_B)} unfinished")
        self.partial = partial
        self.finished_B = finished_B


class WeightsNotSyncedError(RuntimeError):
    """A generator was asked to sample while it holds no synced policy (`policy_version` is None): its
    engine was restarted (it serves the checkpoint it started from, not the trainer's latest weights),
    its last weight sync failed (weights partly replaced), or the weights were marked lost. A
    `receive_weights` that succeeds ends this state."""


def synced_version(policy_version: int | None, holder: str) -> int:
    """`policy_version` when the weights `holder` (say, "the vLLM engine") holds are a synced policy;
    else raises `WeightsNotSyncedError`: rollouts from them would be stamped as no policy at all."""
    if policy_version is None:
        raise WeightsNotSyncedError(
            f"{holder} holds no synced weights (an engine restarted, a sync failed, or the weights were "
            "marked lost): receive_weights() first"
        )
    return policy_version


class Generator(Protocol):
    """Samples completions and holds the policy weights that `policy_version` names.

    Lifecycle: construct (cheap), `setup()` (load the model or start the engine), then
    `connect_weight_sync(endpoint)` once, then any number of `receive_weights` and `generate` calls,
    `close()`. Only the generator changes its `policy_version`: by receiving weights, or when told
    what its weights are (`mark_weights_lost`, `serve_initial_weights`).
    """

    supports_in_flight_updates: bool
    """Whether `generate` calls `between_steps` between decoding steps, where new weights may be taken."""
    can_restart_engine: bool
    """Whether a dead engine process can be replaced by `restart_engine()` (an engine in another process)."""

    @property
    def policy_version(self) -> int | None:
        """The version of the weights held; None while they are not a synced policy (a restarted engine,
        a failed sync, weights marked lost): no generate runs then (`WeightsNotSyncedError`)."""
        ...

    @property
    def engine_pid(self) -> int | None:
        """The engine's process id when sampling runs in a process of its own, else None."""
        ...

    def setup(self) -> None: ...

    def connect_weight_sync(self, endpoint: WeightSyncEndpoint) -> int:
        """Joins the trainer's weight-sync group (llamarl.comm) as the member `endpoint` describes (its
        rank, the group's backend and deadlines, the trainer rank it receives from): this process or its
        engine receives straight from the trainer ranks from then on. The endpoint is kept: a restarted
        engine rejoins with it. Returns how many tensors each sync delivers here."""
        ...

    def receive_weights(self, timeout_s: float) -> int:
        """Waits at most `timeout_s` for the trainer to start a sync, receives it, adopts and returns its
        policy_version. May be called from `between_steps` during a generate (an in-flight update): the
        sync is then pulled while decoding goes on and swapped in between two later steps (at the
        latest when the generate ends), and the call may return before that swap, with the version
        still served (the hf generator does; the vLLM engine answers once swapped in). On failure
        `policy_version` is None (the weights may be partly replaced) until a later one succeeds."""
        ...

    def mark_weights_lost(self) -> None:
        """The weights held are no synced policy any more (a sync failed elsewhere in the group, and the
        weights must come again): `policy_version` is None until a `receive_weights` succeeds."""
        ...

    def serve_initial_weights(self) -> None:
        """Serves the checkpoint the generator started from as policy_version 0, e.g. after an engine
        restart when the trainer never sent weights (so its own are still that checkpoint). Raises when
        the weights held are not that checkpoint."""
        ...

    def generate(
        self,
        prompts: list[list[int]],
        *,
        samples_per_prompt: int,
        max_new_tokens: int,
        greedy: bool = False,
        between_steps: Callable[[], None] | None = None,
    ) -> RolloutBatch:
        """Samples `samples_per_prompt` completions per prompt (token ids); rewards are zeros.
        `between_steps` is called between decoding steps when `supports_in_flight_updates`; when it
        raises `PauseGeneration`, `generate` raises `GenerationPaused` with what was sampled so far."""
        ...

    def open_turns(
        self, *, greedy: bool = False, between_steps: Callable[[], None] | None = None
    ) -> TurnSession:
        """A session for the model turns of multi-turn episodes (`llamarl.exec.multiturn.episodes`); tokens
        keep their behaviour log-probs and versions, `between_steps` may take new weights in flight."""
        ...

    def restart_engine(self) -> None:
        """Replaces a dead engine process; the weights are not a synced policy until the next receive."""
        ...

    def close(self) -> None: ...


class Rewarder(Protocol):
    """Scores samples with a task's reward functions, in worker processes with a per-sample deadline."""

    num_failures: int
    """Samples scored 0 because a reward function raised, hung past its deadline or killed its worker."""

    def setup(self) -> None: ...

    def score(
        self,
        prompts: list[list[dict]],
        completions: list[str],
        rows: list[dict],
        *,
        progress: Callable[[], None] | None = None,
    ) -> list[float]:
        """The weighted reward of each (prompt messages, completion text, dataset row), in order;
        `progress` is called as samples are scored (the waiting ranks see an evaluation going on)."""
        ...

    def close(self) -> None: ...


class ModelRewarder(Protocol):
    """Scores samples with a reward model (a sequence classifier, an LLM judge): one float per sample,
    from the task's question, the completion text and the reference answer. Its weights are its own.
    A sample it cannot score (NaN, infinite) scores 0 and is counted in `num_failures`."""

    num_failures: int

    def setup(self) -> None: ...

    def score(self, questions: list[str], completions: list[str], references: list[str]) -> list[float]: ...

    def close(self) -> None: ...


class Trainer(Protocol):
    """Computes the loss on a RolloutBatch and takes one optimizer step per call.

    `model` and `optimizer` are what checkpoints save (through torch.distributed.checkpoint) and what
    weight sync sends from.
    """

    policy_version: int
    model: torch.nn.Module | None
    optimizer: torch.optim.Optimizer | None

    def setup(self) -> None: ...

    def train_step(self, batch: RolloutBatch) -> dict[str, float]: ...

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole policy on CPU on the first trainer rank (a collective over the trainer ranks)."""
        ...

    def sync_tensors(self) -> torch.nn.Module | dict[str, torch.Tensor]:
        """What weight syncs send: the model, or only the tensors that train (LoRA adapters)."""
        ...

    def close(self) -> None: ...
