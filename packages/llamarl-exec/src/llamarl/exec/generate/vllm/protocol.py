"""The vLLM engine process's protocol, declared once: every request the generator may send, the reply
each gets, and which of them the engine answers while a generate runs.

Imported on both ends of the socket: by the client and the generator (this environment), and by the
engine process (`server.py`, run in the vLLM environment, which finds this package through the import
root `env.engine_import_root` builds). Standard library only.

The wire (a socket pair; `multiprocessing.connection` pickles each message, and both ends run this
module): the engine's first message is `Started`. Then the client sends `Request`s, one of the
dataclasses below, and the engine answers each with a `Reply` naming the request's method. While a
generate runs, the engine answers the requests marked `nested` between two of its steps, and refuses
every other one; so a nested request's reply and the generate's own reply can cross, and the client
sorts replies by the method they name. `refusal` is the one rule both ends apply.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from llamarl.comm import WeightSyncEndpoint


@dataclass(frozen=True)
class Request:
    """A call of one of the engine's methods: `method` names it on the wire and in errors; `nested`:
    the engine answers it while a generate runs, between two of its steps."""

    method: ClassVar[str]
    nested: ClassVar[bool] = False


# -- sampling -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Generate(Request):
    """Samples `n` completions of each prompt (token ids), with temperature alone (0: greedy); steps
    the engine itself, answering nested requests between two steps. Reply: `GenerateReply`."""

    method = "generate"
    prompts: list[list[int]]
    n: int
    max_tokens: int
    temperature: float
    stop_token_ids: list[int]
    seed: int | None


@dataclass(frozen=True)
class GenerateReply:
    """One list per completion (len(prompts) * n, the samples of one prompt contiguous), each as long as
    the completion: `token_ids`, their behaviour `logprobs` and the policy version that sampled each
    (`token_versions`). `finished`: which completions are complete (all unless `paused`: a `Pause`
    ended the call with what was sampled). `version_arrivals`: per completion, (tokens it had, version)
    for each version that arrived while it was in flight. `policy_version`: served at the end."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    token_versions: list[list[int | None]]
    finished: list[bool]
    paused: bool
    version_arrivals: list[list[tuple[int, int | None]]]
    policy_version: int | None


@dataclass(frozen=True)
class Turn:
    """One model turn of a multi-turn episode: sample at most `max_tokens` after `prompt_ids`."""

    key: int
    prompt_ids: list[int]
    max_tokens: int


@dataclass(frozen=True)
class TurnsAdd(Request):
    """Starts model turns; they run until `TurnsWait` returns them. Reply: None."""

    method = "turns_add"
    turns: list[Turn]
    temperature: float
    stop_token_ids: list[int]
    seed: int | None


@dataclass(frozen=True)
class TurnDone:
    """A turn that ended: its tokens, their behaviour log-probs and the version that sampled each."""

    key: int
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int | None]


@dataclass(frozen=True)
class TurnsWait(Request):
    """Steps the engine (at least once) until a turn ends or `max_s` passed. Reply: list[TurnDone]."""

    method = "turns_wait"
    max_s: float


@dataclass(frozen=True)
class TurnsAbort(Request):
    """Abandons every turn still running. Reply: None."""

    method = "turns_abort"


@dataclass(frozen=True)
class Progress(Request):
    """How far the generate in flight got. Reply: `ProgressReply` (empty outside a generate)."""

    method = "progress"
    nested = True


@dataclass(frozen=True)
class ProgressReply:
    """As of the engine's last step: the tokens each completion sampled so far, and whether it finished."""

    tokens: list[int]
    finished: list[bool]


@dataclass(frozen=True)
class Abort(Request):
    """Abandons the generate in flight (its requests aborted); outside one, nothing. Reply: None."""

    method = "abort"
    nested = True


@dataclass(frozen=True)
class Pause(Request):
    """Ends the generate in flight with what it sampled (its reply `paused`); outside one, nothing."""

    method = "pause"
    nested = True


@dataclass(frozen=True)
class Close(Request):
    """Ends the engine process (a generate in flight first, its requests aborted). Reply: None."""

    method = "close"
    nested = True


# -- weights --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class InitWeightSync(Request):
    """The engine's workers join the trainer's weight-sync group as `endpoint` says (worker 0's rank);
    a sync they begin waits at most `announce_timeout_s` (default: the endpoint's timeout_s) for the
    trainer to start it. Reply: the number of tensors each sync delivers."""

    method = "init_weight_sync"
    endpoint: WeightSyncEndpoint
    announce_timeout_s: float | None = None


@dataclass(frozen=True)
class ReceiveWeights(Request):
    """One sync from the trainer, waiting at most `timeout_s` for it. While requests run (a generate's,
    or model turns) the engine keeps stepping them as the sync is pulled into staging, and swaps it in
    between two steps once it is whole: the requests keep their KV cache, later tokens come from the
    new weights. Reply (once swapped in): its policy_version."""

    method = "receive_weights"
    nested = True
    timeout_s: float | None


@dataclass(frozen=True)
class WeightVersion(Request):
    """The policy version the engine's workers report (None after a failed sync). Reply: int | None."""

    method = "weight_version"
    nested = True


@dataclass(frozen=True)
class CloseWeightSync(Request):
    """The workers leave the weight-sync group (the weights they hold stay). Reply: None."""

    method = "close_weight_sync"


#: Every request the engine serves.
REQUESTS: tuple[type[Request], ...] = (
    Generate,
    TurnsAdd,
    TurnsWait,
    TurnsAbort,
    Progress,
    Abort,
    Pause,
    Close,
    InitWeightSync,
    ReceiveWeights,
    WeightVersion,
    CloseWeightSync,
)

#: The methods the engine answers while a generate runs.
NESTED_METHODS = tuple(r.method for r in REQUESTS if r.nested)


def refusal(request: object, *, generating: bool) -> str | None:
    """Why the engine refuses `request` now (one line), or None when it serves it: an object that is
    none of `REQUESTS`, or a request that is not `nested` while a generate runs."""
    if type(request) not in REQUESTS:
        known = ", ".join(r.method for r in REQUESTS)
        return f"unknown engine request {request!r}; the engine serves: {known}"
    assert isinstance(request, Request)
    if generating and not request.nested:
        return (
            f"{request.method} is not allowed while a generate is in flight; "
            f"allowed then: {', '.join(NESTED_METHODS)}"
        )
    return None


@dataclass(frozen=True)
class Reply:
    """The engine's answer to the request whose method it names: its `value`, or `error` (the
    engine's traceback text, or a refusal)."""

    method: str
    value: Any = None
    error: str | None = None


@dataclass(frozen=True)
class Started:
    """The engine's first message: `info` (vLLM and torch versions, seconds to start) once it serves,
    or `error` (its traceback text) when it could not start."""

    info: dict[str, Any] | None
    error: str | None = None
