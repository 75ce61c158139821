"""Rollout channel: moves a RolloutBatch from a generator rank to the trainer rank as tensors.

The batch crosses as a small int64 header (sizes) followed by its tensors in a fixed order, point to
point on the default (gloo) process group, so no Python object is ever pickled across ranks. Every
receive is bounded by the process group's timeout; a failure names the peer.

Shape legend: B sequences, P prompt length, C completion length, M generator metrics.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from llamarl.exec.moe.routes import no_route
from llamarl.exec.types import RolloutBatch

# Cumulative generator counters (since the generator started) that travel with each batch; the
# trainer takes their differences per step (llamarl.control.run.trainer_loop.GeneratorStats).
GENERATOR_TOTALS = (
    "generate_s_total",  # seconds spent in generate calls
    "busy_s_total",  # seconds generating and scoring (the rest is idle: waiting, taking weights)
    "alive_s_total",  # seconds since the generator role started
    "groups_total",  # groups sampled
    "filtered_total",  # groups dropped by dynamic sampling (all rewards equal)
    "engine_restarts_total",  # dead engines replaced (stream mode with vLLM)
    "reward_failures_total",  # samples scored 0: a reward function raised, hung or killed its worker
    "episodes_dropped_total",  # multi-turn episodes dropped because their environment raised
    "reward_model_s_total",  # seconds the reward model spent scoring this generator's samples
    "reward_model_samples_total",  # samples of this generator the reward model scored
    "reward_model_failures_total",  # of those, scored 0: the model's score was not a finite number
)
# Generator-side metrics that travel with each batch, in this order (a float64 tensor of length M).
GENERATOR_METRICS = (
    "generate_s",
    "score_s",
    "num_completion_tokens",
    "reward_mean",
    "policy_version",
    *GENERATOR_TOTALS,
)
_END_OF_STREAM = -1  # a header whose B is this ends a generator's stream (metrics still follow)
_MARKER = -2  # a header whose B is this is a checkpoint marker (metrics still follow)


class _CheckpointMarker:
    """A generator's checkpoint marker in its rollout stream: everything it sent before is delivered."""

    def __repr__(self) -> str:
        return "CHECKPOINT_MARKER"


# Sent in place of a batch (`send_rollouts(CHECKPOINT_MARKER, ...)`) and received as itself: in stream mode
# a generator sends it when a checkpoint is due, so that the trainer knows its buffer holds every batch
# that generator sent before saving its own state (the channel's state is then empty: a consistent cut).
CHECKPOINT_MARKER = _CheckpointMarker()

_DTYPES = {
    "prompt_ids_BP": torch.int64,
    "prompt_mask_BP": torch.int64,
    "completion_ids_BC": torch.int64,
    "completion_mask_BC": torch.int64,
    "behavior_logprobs_BC": torch.float32,
    "rewards_B": torch.float32,
    "policy_version_B": torch.int64,
    "token_version_BC": torch.int64,
    "prompt_position_B": torch.int64,
}
# A mixture of experts' routes (`RolloutBatch.prompt_routes_BPLK`, ...) follow when the header says so.
_ROUTES = ("prompt_routes_BPLK", "completion_routes_BCLK")
_ROUTE_DTYPES = (torch.uint8, torch.int16)  # by header code - 1 (0: no routes)
_HEADER_LEN = 7  # B, P, C, group_size, L, K, routes' dtype code


@dataclass
class PendingBatch:
    """A batch made and not yet handed on, with the generator metrics that travel with it: a generator's
    batch between lock-step phases (async: made in one tick, sent in the next) or a stream request's
    batch until its outbox takes it; a reward rank's scored batch until it forwards it."""

    batch: RolloutBatch
    metrics: dict[str, float]

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps (tensors and plain values); `from_state` reads it back."""
        return {"batch": self.batch.state(), "metrics": dict(self.metrics)}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> PendingBatch:
        return cls(RolloutBatch.from_state(state["batch"]), dict(state["metrics"]))

    def send(self, *, dst: int, group: dist.ProcessGroup | None = None, tag: int = 0) -> None:
        """`send_rollouts` of the batch and its metrics."""
        send_rollouts(self.batch, self.metrics, dst=dst, group=group, tag=tag)


class ChannelError(RuntimeError):
    """A rollout transfer that failed or timed out; the message names the peer rank."""


def _shape(name: str, sizes: dict[str, int]) -> tuple[int, ...]:
    # The shape suffix of each field name is its contract: _BP, _BC, _B, _BPLK...
    return tuple(sizes[axis] for axis in name.rsplit("_", 1)[1])


def send_rollouts(
    batch: RolloutBatch | _CheckpointMarker | None,
    metrics: dict[str, float],
    *,
    dst: int,
    group: dist.ProcessGroup | None = None,
    tag: int = 0,
) -> None:
    """Sends `batch` and its generator metrics to rank `dst` (blocking) over `group` (default: the
    default group). `batch=None` sends the end of a stream and `CHECKPOINT_MARKER` a checkpoint marker:
    only the metrics follow. `tag` tells apart streams between the same two ranks (a reward rank
    forwards several generators' batches to the trainer: the tag is the generator's rank)."""
    tensors = batch.tensors() if isinstance(batch, RolloutBatch) else {}
    routes = {name: tensors.pop(name) for name in _ROUTES if name in tensors}
    if isinstance(batch, RolloutBatch) and list(tensors) != list(_DTYPES):
        raise ValueError(f"RolloutBatch fields changed: {list(tensors)}; update llamarl.control.run.channels")
    if batch is None:
        header = torch.tensor([_END_OF_STREAM, *[0] * (_HEADER_LEN - 1)], dtype=torch.int64)
    elif batch is CHECKPOINT_MARKER:
        header = torch.tensor([_MARKER, *[0] * (_HEADER_LEN - 1)], dtype=torch.int64)
    else:
        layers, top_k, code = 0, 0, 0
        if routes:
            layers, top_k = routes["prompt_routes_BPLK"].shape[2:]
            code = _ROUTE_DTYPES.index(routes["prompt_routes_BPLK"].dtype) + 1
        header = torch.tensor(
            [
                batch.num_sequences,
                batch.prompt_ids_BP.shape[1],
                batch.completion_ids_BC.shape[1],
                batch.group_size,
                layers,
                top_k,
                code,
            ],
            dtype=torch.int64,
        )
    metric_values = torch.tensor(
        [float(metrics.get(k, float("nan"))) for k in GENERATOR_METRICS], dtype=torch.float64
    )
    try:
        dist.send(header, dst, group=group, tag=tag)
        for name, tensor in tensors.items():
            dist.send(tensor.detach().to("cpu", _DTYPES[name]).contiguous(), dst, group=group, tag=tag)
        for tensor in routes.values():
            dist.send(tensor.detach().cpu().contiguous(), dst, group=group, tag=tag)
        dist.send(metric_values, dst, group=group, tag=tag)
    except Exception as e:
        raise ChannelError(f"sending rollouts to rank {dst} failed: {e}") from e


def recv_rollouts(
    *, src: int, group: dist.ProcessGroup | None = None, tag: int = 0
) -> tuple[RolloutBatch | _CheckpointMarker | None, dict[str, float]]:
    """Receives one batch (and its generator metrics) from rank `src` with `tag`; raises ChannelError
    on timeout.

    The batch is None when `src` ended its stream (`send_rollouts(None, ...)`), `CHECKPOINT_MARKER` for
    a checkpoint marker.
    """
    try:
        header = torch.empty(_HEADER_LEN, dtype=torch.int64)
        dist.recv(header, src, group=group, tag=tag)
        num_sequences, prompt_len, completion_len, group_size, layers, top_k, code = (int(v) for v in header)
        sizes = {"B": num_sequences, "P": prompt_len, "C": completion_len, "L": layers, "K": top_k}
        tensors = {}
        if num_sequences >= 0:
            dtypes = dict(_DTYPES)
            if code:
                dtypes.update(dict.fromkeys(_ROUTES, _ROUTE_DTYPES[code - 1]))
            for name, dtype in dtypes.items():
                tensors[name] = torch.empty(_shape(name, sizes), dtype=dtype)
                dist.recv(tensors[name], src, group=group, tag=tag)
        metric_values = torch.empty(len(GENERATOR_METRICS), dtype=torch.float64)
        dist.recv(metric_values, src, group=group, tag=tag)
    except Exception as e:
        raise ChannelError(f"receiving rollouts from rank {src} failed: {e}") from e
    metrics = dict(zip(GENERATOR_METRICS, metric_values.tolist(), strict=True))
    if num_sequences == _END_OF_STREAM:
        return None, metrics
    if num_sequences == _MARKER:
        return CHECKPOINT_MARKER, metrics
    return RolloutBatch(group_size=group_size, **tensors), metrics


def concat_rollouts(batches: list[RolloutBatch]) -> RolloutBatch:
    """Joins batches from several generators: prompts re-padded on the left, completions on the right."""
    if len(batches) == 1:
        return batches[0]
    group_size = batches[0].group_size
    if any(b.group_size != group_size for b in batches):
        raise ValueError("all generators must sample the same number of completions per prompt")
    prompt_len = max(b.prompt_ids_BP.shape[1] for b in batches)
    completion_len = max(b.completion_ids_BC.shape[1] for b in batches)

    if len({b.has_routes for b in batches}) > 1:
        raise ValueError("some generators' batches carry expert routes and others do not")

    def pad(t: torch.Tensor, length: int, *, left: bool) -> torch.Tensor:
        # Padding values are masked out everywhere downstream, so zeros are safe for every field but
        # the routes, whose padding is "no route".
        missing = length - t.shape[1]
        value = no_route(t.dtype) if t.dim() == 4 else 0
        widths = (0, 0) * (t.dim() - 2) + ((missing, 0) if left else (0, missing))
        return torch.nn.functional.pad(t, widths, value=value)

    joined = {}
    for name in batches[0].tensors():
        parts = [getattr(b, name) for b in batches]
        if "_BP" in name:
            parts = [pad(t, prompt_len, left=True) for t in parts]
        elif "_BC" in name:
            parts = [pad(t, completion_len, left=False) for t in parts]
        joined[name] = torch.cat(parts)
    return RolloutBatch(group_size=group_size, **joined)
