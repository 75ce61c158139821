"""The trainer side of the `llamarl` vLLM weight-transfer backend, for any PyTorch trainer; no vLLM here.

`LlamarlTrainerWeightTransferEngine` has the shape of vLLM's `TrainerWeightTransferEngine`
(`trainer_init(init_info, client=, source=)`, `send_weights()`, `shutdown()`), so vLLM's
`WeightTransferTrainerFactory` builds it where vLLM is installed (`adapters.vllm.register`), and a
trainer without vLLM uses the class directly. Every trainer rank builds one: each sends the slices it
holds (whole tensors, FSDP2 / DTensor shards: read from their placements, never gathered); trainer rank
0 hosts the group's store and drives the engine through `client`, any object with vLLM's
`VLLMWeightSyncClient` methods: vLLM's own clients, an `LLM`, or `HTTPWeightSyncClient` below, which
speaks to `vllm serve`'s RL routes with the standard library alone.

One `send_weights()` on rank 0, pull before pause:

1. `start_weight_update`: every engine worker starts pulling into its staging; generation goes on;
2. the trainer ranks send (`WeightSender.send`), bucket by bucket, while the engine generates;
3. `pause(mode="keep")` (requests in flight stay, with their KV cache), `update_weights` (each worker
   waits for its pull to be whole, checks the version, loads: the swap), `finish_weight_update` with the
   version (vLLM stamps it on the tokens sampled from then on), the prefix cache reset (checked:
   refused while kept requests hold blocks), `resume`. Only step 3 pauses generation.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from llamarl.comm._session import SyncStats
from llamarl.comm.endpoint import WeightSyncEndpoint
from llamarl.comm.sender import WeightSender
from llamarl.comm.transport import WeightSyncGroup

__all__ = [
    "BACKEND",
    "HTTPWeightSyncClient",
    "LlamarlTrainerInitInfo",
    "LlamarlTrainerWeightTransferEngine",
    "SendReport",
    "VLLMServerError",
]

#: The backend's name: `WeightTransferConfig(backend=BACKEND)`, `--weight-transfer-config '{"backend": ...}'`.
BACKEND = "llamarl"


class VLLMServerError(RuntimeError):
    """A vLLM server answered a weight-sync route with an error (or not at all); the message is one line."""


class HTTPWeightSyncClient:
    """`vllm serve`'s weight-sync routes (vLLM 0.32; the server needs `VLLM_SERVER_DEV_MODE=1`, which
    registers them) over HTTP with urllib. Each call waits at most `timeout_s`; an error status or an
    unreachable server raises `VLLMServerError` naming the route."""

    def __init__(self, base_url: str, *, timeout_s: float = 300.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s

    def post(self, route: str, body: dict[str, Any] | None = None, **query: Any) -> Any:
        """POSTs `body` (JSON) to `route` with `query` parameters; returns the JSON reply (None if empty)."""
        url = f"{self.base_url}/{route}"
        if query:
            url += "?" + urllib.parse.urlencode(
                {k: str(v).lower() if isinstance(v, bool) else v for k, v in query.items()}
            )
        data = json.dumps(body if body is not None else {}).encode()
        request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as reply:
                text = reply.read().decode()
        except urllib.error.HTTPError as exc:
            detail = " ".join(exc.read().decode(errors="replace").split())[:500]
            raise VLLMServerError(f"POST {url}: HTTP {exc.code}: {detail}") from None
        except (urllib.error.URLError, TimeoutError, OSError) as exc:
            raise VLLMServerError(f"POST {url}: no answer within {self.timeout_s:.0f} s: {exc}") from None
        return json.loads(text) if text else None

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.post("init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self) -> None:
        self.post("start_weight_update")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.post("update_weights", {"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.post("finish_weight_update", {"weight_version": weight_version})

    def shutdown_weight_transfer_engine(self) -> None:
        self.post("shutdown_weight_transfer_engine")

    def pause(self, mode: str = "keep") -> None:
        """Stops scheduling: "keep" freezes the requests in flight (they resume where they were)."""
        self.post("pause", mode=mode)

    def resume(self) -> None:
        self.post("resume")

    def reset_prefix_cache(self) -> bool:
        """Drops cached KV blocks; False (refused) while requests hold blocks."""
        return bool(self.post("reset_prefix_cache")["success"])


@dataclass(kw_only=True)
class LlamarlTrainerInitInfo:
    """What a trainer rank needs to send to a vLLM engine over the llamarl backend.

    `endpoint`: this trainer rank's member of the group (rank 0 hosts the store and drives the engine;
    `world_size` counts every trainer rank and every engine worker). `first_engine_rank`: the rank of
    the engine's first worker (worker i is the next i-th; default: the rank after the trainer's single
    one). `wire_dtype` / `bucket_bytes`: the `WeightSender`'s. `pause_mode`: vLLM's pause around the
    swap ("keep": requests in flight continue under the new weights; None: no pause, for an engine
    that only generates between syncs). `reset_prefix_cache`: drop the prefix cache after the swap.
    `announce_timeout_s`: how long a worker's started update waits for the send to begin.
    """

    backend: ClassVar[str] = BACKEND

    endpoint: WeightSyncEndpoint
    first_engine_rank: int = 1
    wire_dtype: torch.dtype | None = None
    bucket_bytes: int = 64 << 20
    pause_mode: str | None = "keep"
    reset_prefix_cache: bool = True
    announce_timeout_s: float | None = None

    @property
    def rank(self) -> int:
        return self.endpoint.rank

    @property
    def is_sender(self) -> bool:
        """Whether this rank drives the engine (vLLM's name for it; every trainer rank sends its slices)."""
        return self.endpoint.rank == 0

    def engine_init_info(self) -> dict[str, Any]:
        """The engine workers' `init_info` (the llamarl backend's `LlamarlInitInfo`, as JSON)."""
        return {
            "endpoint": self.endpoint.for_rank(self.first_engine_rank).to_json(),
            "announce_timeout_s": self.announce_timeout_s,
        }


@dataclass(frozen=True, kw_only=True)
class SendReport:
    """One `send_weights` on this rank: the version, this rank's sync (`stats`: what the engine pulled
    while generating), and on the driving rank the engine's pause around the swap (`pause_s`: from the
    pause request to the resume's answer, HTTP round trips included) and whether the prefix cache was
    reset (None: not asked, or not the driving rank)."""

    policy_version: int
    stats: SyncStats
    pause_s: float | None
    prefix_cache_reset: bool | None


class LlamarlTrainerWeightTransferEngine:
    """Trainer-side engine of the llamarl backend (module doc). Build it with `trainer_init`."""

    backend: ClassVar[str] = BACKEND
    init_info_cls = LlamarlTrainerInitInfo

    def __init__(self, *, init_info: LlamarlTrainerInitInfo, client: Any, sender: WeightSender) -> None:
        self.init_info = init_info
        self.client = client
        self.sender = sender
        self.is_sender = init_info.is_sender
        self.policy_version = 0  # the checkpoint both sides start from

    @classmethod
    def trainer_init(
        cls,
        init_info: LlamarlTrainerInitInfo,
        *,
        client: Any,
        source: torch.nn.Module | Mapping[str, torch.Tensor] | None = None,
    ) -> LlamarlTrainerWeightTransferEngine:
        """Joins the group and (rank 0) has the engine's workers join it: both sides publish their
        layouts and wait for the other's, so the engine's init runs on a thread meanwhile. `source`: the
        model, or its named tensors, as this rank holds them (DTensor shards are read as they are)."""
        if not isinstance(source, torch.nn.Module | Mapping):
            raise TypeError(
                f"source must be the model or its named tensors, not {type(source).__name__}: the llamarl "
                "backend sends each rank's own shards and never gathers"
            )
        group = WeightSyncGroup(init_info.endpoint)
        try:
            if not init_info.is_sender:
                sender = WeightSender(
                    group, source, wire_dtype=init_info.wire_dtype, bucket_bytes=init_info.bucket_bytes
                )
            else:
                sender = _with_engine_joining(init_info, client, group, source)
        except BaseException:
            group.close()
            raise
        return cls(init_info=init_info, client=client, sender=sender)

    def send_weights(self, policy_version: int | None = None) -> SendReport:
        """Sends the weights as they are now as `policy_version` (default: one more than the last) and,
        on rank 0, has the engine swap them in (module doc). Call it on every trainer rank."""
        version = self.policy_version + 1 if policy_version is None else int(policy_version)
        if self.is_sender:
            self.client.start_weight_update()
        try:
            stats = self.sender.send(version)
        except BaseException:
            if self.is_sender:
                self._end_failed_update()
            raise
        pause_s, reset = self._swap(version) if self.is_sender else (None, None)
        self.policy_version = version
        return SendReport(policy_version=version, stats=stats, pause_s=pause_s, prefix_cache_reset=reset)

    def _end_failed_update(self) -> None:
        """After a failed send: vLLM's workers keep an update started until `update_weights` ends it, and
        refuse the next start meanwhile; this one fails on the pull's own error (or the engine is gone)
        and leaves them ready for the next sync."""
        with contextlib.suppress(Exception):
            self.client.update_weights({"timeout_s": self.sender.group.timeout_s})

    def _swap(self, version: int) -> tuple[float, bool | None]:
        """The engine's pause: (seconds from pause to resume, whether the prefix cache was reset)."""
        info = self.init_info
        start = time.perf_counter()
        # vLLM's own clients have no pause: the swap then stops the engine only while update_weights
        # runs, and a step may run between it and finish_weight_update's version (stamped as the old).
        pause = info.pause_mode is not None and hasattr(self.client, "pause")
        if pause:
            self.client.pause(info.pause_mode)
        reset = None
        try:
            self.client.update_weights({"policy_version": version, "timeout_s": self.sender.group.timeout_s})
            self.client.finish_weight_update(str(version))
            if info.reset_prefix_cache and hasattr(self.client, "reset_prefix_cache"):
                reset = bool(self.client.reset_prefix_cache())
        finally:
            if pause:
                self.client.resume()
        return time.perf_counter() - start, reset

    def shutdown(self) -> None:
        """Leaves the group (rank 0 has the engine leave it first, when its client can)."""
        if self.is_sender and hasattr(self.client, "shutdown_weight_transfer_engine"):
            self.client.shutdown_weight_transfer_engine()
        self.sender.group.close()


def _with_engine_joining(
    info: LlamarlTrainerInitInfo,
    client: Any,
    group: WeightSyncGroup,
    source: torch.nn.Module | Mapping[str, torch.Tensor],
) -> WeightSender:
    """Rank 0's sender, built while the engine's workers join on a thread (each side waits for the
    other's layout); raises the engine's error if its join failed."""
    errors: list[BaseException] = []

    def join() -> None:
        try:
            client.init_weight_transfer_engine(info.engine_init_info())
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=join, name="llamarl-engine-join", daemon=True)
    thread.start()
    try:
        sender = WeightSender(group, source, wire_dtype=info.wire_dtype, bucket_bytes=info.bucket_bytes)
    except BaseException:
        thread.join(1.0)
        if errors:  # the engine's refusal is the cause; the sender only timed out waiting for it
            raise errors[0] from None
        raise
    thread.join(group.timeout_s + 30)
    if thread.is_alive():
        raise VLLMServerError(
            f"the engine's init_weight_transfer_engine did not answer within {group.timeout_s + 30:.0f} s"
        )
    if errors:
        raise errors[0]
    return sender
