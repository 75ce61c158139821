"""A stream generator's work in hand: its request and the request's lifecycle, as explicit states.

A generator in stream mode works on one request at a time: its share of a step's prompts, one group of
completions per prompt. Admission control lets the request in (`StreamControl.admit`: one ticket per
group, the order the trainer takes groups in); the generator samples it, perhaps pausing between two
decoding steps for a checkpoint or an evaluation and then continuing; scores it into a batch; and hands
the batch to its outbox. `WorkInHand` holds the request and moves it through these states, as
torchtitan's work buffer moves its entries (WAITING -> INFLIGHT -> FINALIZED): every move is checked
and an illegal one raises `RequestStateError`. Nothing here does I/O or waits.

              admit          start                      make             deliver
    (none) ---------> ADMITTED ------> SAMPLING ---------------> MADE ------------> DELIVERED
                                        |  ^  |
                                  pause |  |  | filter: dynamic sampling dropped every group
                                        v  |  v
                                      PAUSED  FILTERED
                                       start

    interrupt: SAMPLING -> PAUSED (or ADMITTED, if never paused): an engine died or a sync failed in
    the middle; the request goes on from its last pause.

What a checkpoint saves of a generator's stream is `WorkInHand.state()`: a checkpoint is taken while
the generator is paused, so its request (if any) is ADMITTED, PAUSED or MADE, never SAMPLING. DELIVERED
and FILTERED requests are no longer in hand.

Tickets: each group keeps its admission ticket (`StreamRequest.tickets`, by the prompt's position in the
data order) until it is delivered; the tickets of groups that dynamic sampling dropped are `held` for
the next request, which samples new prompts under them (the trainer waits for those tickets).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from llamarl.control.run.channels.rollouts import PendingBatch
from llamarl.control.run.in_flight import InFlightRequest
from llamarl.exec.types import GenerationPaused


class RequestState(enum.Enum):
    """Where a stream request is in its life (see the module doc)."""

    ADMITTED = "admitted"  # prompts and tickets assigned; nothing sampled yet
    SAMPLING = "sampling"  # the generator is sampling or scoring it
    PAUSED = "paused"  # stopped between two decoding steps; its completions so far kept (`in_flight`)
    MADE = "made"  # scored into a batch (`made`), not yet handed to the outbox
    DELIVERED = "delivered"  # handed to the outbox: no longer in hand
    FILTERED = "filtered"  # every group dropped by dynamic sampling: nothing to deliver


class RequestStateError(RuntimeError):
    """A request asked to move where its state does not lead."""


@dataclass
class StreamRequest:
    """One request of a stream generator; `WorkInHand` moves it through its states."""

    number: int  # 0, 1, ... in the order this generator started them (fault points name them)
    positions: list[int]  # its prompts, as positions in the data order
    tickets: dict[int, int]  # position -> admission ticket, of the groups still in hand
    state: RequestState = RequestState.ADMITTED
    in_flight: InFlightRequest | None = None  # the completions so far, once it was paused
    made: PendingBatch | None = None  # the scored batch, once made

    def as_dict(self) -> dict[str, Any]:
        return {
            "number": self.number,
            "positions": list(self.positions),
            "tickets": dict(self.tickets),
            "state": self.state.value,
            "in_flight": None if self.in_flight is None else self.in_flight.state(),
            "made": None if self.made is None else self.made.state(),
        }

    @classmethod
    def from_dict(cls, state: dict[str, Any]) -> StreamRequest:
        return cls(
            number=int(state["number"]),
            positions=[int(p) for p in state["positions"]],
            tickets={int(p): int(t) for p, t in state["tickets"].items()},
            state=RequestState(state["state"]),
            in_flight=None if state["in_flight"] is None else InFlightRequest.from_state(state["in_flight"]),
            made=None if state["made"] is None else PendingBatch.from_state(state["made"]),
        )


class WorkInHand:
    """A stream generator's request in hand (at most one), the requests started so far, and the tickets
    held for the next request."""

    def __init__(self) -> None:
        self.request: StreamRequest | None = None
        self.requests = 0  # requests started
        self.held: list[int] = []  # tickets of groups dynamic sampling dropped, for the next request

    def admit(self, positions: list[int], tickets: list[int]) -> StreamRequest:
        """A new request of the prompts at `positions`, their groups under `tickets` (-> ADMITTED)."""
        if self.request is not None:
            raise RequestStateError(
                f"cannot admit a request while request {self.request.number} is {self.request.state.value}"
            )
        self.request = StreamRequest(
            self.requests, list(positions), dict(zip(positions, tickets, strict=True))
        )
        self.requests += 1
        return self.request

    def take_held(self) -> list[int]:
        """The tickets held for the next request (in order), which no longer holds them."""
        tickets, self.held = self.held, []
        return tickets

    def start(self) -> StreamRequest:
        """ADMITTED or PAUSED -> SAMPLING."""
        return self._move(RequestState.SAMPLING, RequestState.ADMITTED, RequestState.PAUSED)

    def pause(self, paused: GenerationPaused) -> None:
        """SAMPLING -> PAUSED, keeping what was drawn (a continued request's completions extended
        themselves already)."""
        request = self._move(RequestState.PAUSED, RequestState.SAMPLING)
        if request.in_flight is None:
            request.in_flight = InFlightRequest.from_paused(paused)

    def interrupt(self) -> None:
        """SAMPLING -> back to its last pause (PAUSED), or ADMITTED if it never paused."""
        request = self._current(RequestState.SAMPLING)
        request.state = RequestState.ADMITTED if request.in_flight is None else RequestState.PAUSED

    def make(self, made: PendingBatch, *, dropped: list[int]) -> None:
        """SAMPLING -> MADE: `made` is the scored batch; the groups of the prompts at `dropped` (dynamic
        sampling) leave it and their tickets are held for the next request."""
        request = self._move(RequestState.MADE, RequestState.SAMPLING)
        request.made = made
        self._hold(request, dropped)

    def filter(self, *, dropped: list[int]) -> None:
        """SAMPLING -> FILTERED: every group was dropped; their tickets are held for the next request."""
        request = self._move(RequestState.FILTERED, RequestState.SAMPLING)
        self._hold(request, dropped)
        self.request = None

    def deliver(self) -> PendingBatch:
        """MADE -> DELIVERED: the outbox has the batch; returns it. Its tickets leave with it (the
        trainer reads them from the store)."""
        request = self._move(RequestState.DELIVERED, RequestState.MADE)
        assert request.made is not None
        self.request = None
        return request.made

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps (taken while paused: the request is never SAMPLING then)."""
        if self.request is not None and self.request.state is RequestState.SAMPLING:
            raise RequestStateError(
                f"request {self.request.number} is sampling: checkpoints are taken paused"
            )
        return {
            "request": None if self.request is None else self.request.as_dict(),
            "requests": self.requests,
            "held": list(self.held),
        }

    def restore(self, state: dict[str, Any]) -> None:
        """Takes up the work in hand that `state()` saved."""
        request = None if state["request"] is None else StreamRequest.from_dict(state["request"])
        if request is not None and request.state not in _IN_HAND_AT_A_CHECKPOINT:
            raise RequestStateError(f"a checkpoint cannot hold a request that is {request.state.value}")
        self.request = request
        self.requests = int(state["requests"])
        self.held = [int(t) for t in state["held"]]

    def _current(self, *allowed: RequestState) -> StreamRequest:
        if self.request is None or self.request.state not in allowed:
            now = (
                "no request in hand" if self.request is None else f"the request is {self.request.state.value}"
            )
            raise RequestStateError(f"{now}; expected one that is {' or '.join(a.value for a in allowed)}")
        return self.request

    def _move(self, to: RequestState, *allowed: RequestState) -> StreamRequest:
        request = self._current(*allowed)
        request.state = to
        return request

    def _hold(self, request: StreamRequest, positions: list[int]) -> None:
        for position in positions:
            ticket = request.tickets.pop(position, None)
            if ticket is not None:  # None: a request restored from a checkpoint written before tickets
                self.held.append(ticket)
        self.held.sort()


_IN_HAND_AT_A_CHECKPOINT = frozenset({RequestState.ADMITTED, RequestState.PAUSED, RequestState.MADE})
