"""What each side keeps in a checkpoint: a dataclass per side for its rank{r}.pt, and the run's state
(controller.json, from the first trainer rank).

Each is written as plain values (`as_dict`: tensors, numbers, lists, dicts, which torch.save and JSON
write without pickling a class of ours) and read back by `from_dict`, which reads today's format
(`llamarl.control.run.checkpoint.RANK_STATE_FORMAT`) and, through
`llamarl.control.run.legacy_checkpoints`, the states of older checkpoints.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from llamarl.control.run import legacy_checkpoints as legacy
from llamarl.control.run.channels.rollouts import PendingBatch


@dataclass
class GeneratorRankState:
    """A generator rank's part of a checkpoint."""

    prompt_position: int  # where its share of the data order continues
    generator_totals: dict[str, float]  # the cumulative counters (the trainer takes differences)
    samples_bytes: int  # the length of OUTPUT_DIR/samples.rank{r}.jsonl
    eval_samples_bytes: int = 0  # the length of OUTPUT_DIR/eval_samples.rank{r}.jsonl
    pending: PendingBatch | None = None  # async mode: the batch made and not yet sent
    work: dict[str, Any] | None = None  # stream mode: the request in hand (`WorkInHand.state()`)

    def as_dict(self) -> dict[str, Any]:
        return {
            "prompt_position": self.prompt_position,
            "generator_totals": dict(self.generator_totals),
            "samples_bytes": self.samples_bytes,
            "eval_samples_bytes": self.eval_samples_bytes,
            "pending": None if self.pending is None else self.pending.state(),
            "work": self.work,
        }

    @classmethod
    def from_dict(cls, state: dict[str, Any]) -> GeneratorRankState:
        state = legacy.generator_state(state)
        pending = state["pending"]
        return cls(
            prompt_position=int(state["prompt_position"]),
            generator_totals=dict(state["generator_totals"]),
            samples_bytes=int(state["samples_bytes"]),
            eval_samples_bytes=int(state["eval_samples_bytes"]),
            pending=None if pending is None else PendingBatch.from_state(pending),
            work=state["work"],
        )


@dataclass
class RewardRankState:
    """A reward rank's part of a checkpoint."""

    scored: dict[int, PendingBatch]  # async mode: by generator, the batches scored and not yet forwarded
    totals: dict[int, dict[str, float]]  # by generator: the reward model's cumulative counters
    scores_bytes: int  # the length of OUTPUT_DIR/reward_scores.rank{r}.jsonl

    def as_dict(self) -> dict[str, Any]:
        return {
            "scored": {g: p.state() for g, p in self.scored.items()},
            "totals": {g: dict(t) for g, t in self.totals.items()},
            "scores_bytes": self.scores_bytes,
        }

    @classmethod
    def from_dict(cls, state: dict[str, Any]) -> RewardRankState:
        state = legacy.reward_state(state)
        return cls(
            scored={int(g): PendingBatch.from_state(p) for g, p in state["scored"].items()},
            totals={int(g): dict(t) for g, t in state["totals"].items()},
            scores_bytes=int(state["scores_bytes"]),
        )


@dataclass
class TrainerRankState:
    """A trainer rank's part of a checkpoint (the model and optimizer go through DCP)."""

    intake: dict[str, Any] | None = None  # stream mode, first trainer rank: `TrainerIntake.state()`

    def as_dict(self) -> dict[str, Any]:
        return {"intake": self.intake}

    @classmethod
    def from_dict(cls, state: dict[str, Any]) -> TrainerRankState:
        return cls(intake=legacy.trainer_state(state)["intake"])


@dataclass
class TrainerRunState:
    """The run's state, from the first trainer rank (controller.json, with the tick to resume at, the
    policy version and the settings that `RunCheckpoints` adds)."""

    step_records: list[dict[str, float]]  # every step's metrics
    evaluations: list[dict[str, Any]]  # every evaluation (`EvalResult.as_dict()`), in order
    last_sync_s: float
    generator_stats: dict[str, Any]  # `GeneratorStats.state()`
    wandb_id: str | None
    metrics_bytes: int  # the length of OUTPUT_DIR/metrics.jsonl
    trained_bytes: int  # the length of OUTPUT_DIR/trained_groups.jsonl

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, state: dict[str, Any]) -> TrainerRunState:
        state = legacy.run_state(state)
        return cls(**{f.name: state[f.name] for f in fields(cls)})
