"""A small discrete-event engine: actors are Python generators that yield what they do next.

An actor yields one of three commands and is resumed when it is done:

- `Work`: busy for `seconds` of its own time on its pool of cores. Works that share a pool with a
  finite number of cores share them (processor sharing): when the works running there want more
  threads than the pool has, each runs at cores / threads-wanted of its speed. A work may carry a
  `poll` callback, asked between steps whether to join a collective now (an in-flight weight update):
  the work then pauses until the collective ends.
- `Join`: a collective (rollout transfer, weight sync) that starts once every participant has joined
  and lasts `seconds` for all of them.
- `WaitUntil`: blocks until a predicate over shared state holds (a buffer with room, a batch to take).

Every work, join and named wait becomes a `Span`, the simulated counterpart of a trace box.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Generator
from dataclasses import dataclass, field

EPS = 1e-12


@dataclass(frozen=True)
class Span:
    """One simulated phase of one actor: from `start` (when it was reached) to `end`."""

    actor: str
    name: str
    tag: int | None
    start: float
    end: float
    busy_start: float | None = None  # joins: when the last participant arrived and the transfer began

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class Join:
    """A collective among `participants`, identified by `key`; `seconds` once all have joined."""

    key: str
    participants: frozenset[str]
    seconds: float
    name: str
    tag: int | None = None


@dataclass(frozen=True)
class Work:
    """`seconds` of work (at full speed, alone) on the actor's pool, using `threads` cores."""

    name: str
    seconds: float
    tag: int | None = None
    threads: float = 1.0
    poll: Callable[[], Join | None] | None = None


@dataclass(frozen=True)
class WaitUntil:
    """Blocks until `ready()` holds; a `name` records the wait as a span."""

    ready: Callable[[], bool]
    name: str | None = None
    tag: int | None = None


Command = Work | Join | WaitUntil
Process = Generator[Command, None, None]


class Deadlock(RuntimeError):
    """No actor can move and nothing is in progress: the schedule is stuck."""


@dataclass
class _Actor:
    name: str
    process: Process
    pool: str | None
    command: Command | None = None
    since: float = 0.0  # when the current command began
    remaining: float = 0.0  # works: seconds of work left
    interrupt: Join | None = None  # a join taken in the middle of a work
    interrupt_since: float = 0.0
    done: bool = False


@dataclass
class _Collective:
    join: Join
    arrived: dict[str, float] = field(default_factory=dict)
    start: float | None = None


class Simulation:
    """Runs actors until the `main` ones finish; returns their spans in time order."""

    def __init__(self, pool_cores: dict[str, float] | None = None) -> None:
        self.pool_cores = dict(pool_cores or {})
        self.now = 0.0
        self.spans: list[Span] = []
        self._actors: dict[str, _Actor] = {}
        self._collectives: dict[str, _Collective] = {}

    def add(self, name: str, process: Process, pool: str | None = None) -> None:
        """Adds an actor; `pool` names the cores it shares with others (None: its own devices)."""
        self._actors[name] = _Actor(name, process, pool)

    def run(self, main: set[str] | None = None, max_events: int = 10_000_000) -> list[Span]:
        main = set(self._actors) if main is None else main
        for actor in list(self._actors.values()):
            self._advance(actor)
        for _ in range(max_events):
            self._settle()
            if all(self._actors[a].done for a in main):
                return sorted(self.spans, key=lambda s: (s.start, s.end))
            dt = self._next_event_in()
            if math.isinf(dt):
                raise Deadlock(self._state())
            self._elapse(dt)
        raise RuntimeError(f"simulation did not finish within {max_events} events")

    # -- internals ---------------------------------------------------------------------------------

    def _advance(self, actor: _Actor) -> None:
        """Resumes `actor` until it yields a command that takes time (or ends)."""
        try:
            command = next(actor.process)
        except StopIteration:
            actor.done, actor.command = True, None
            return
        actor.command, actor.since = command, self.now
        if isinstance(command, Work):
            actor.remaining = max(command.seconds, 0.0)
        elif isinstance(command, Join):
            self._arrive(actor, command)

    def _arrive(self, actor: _Actor, join: Join) -> None:
        collective = self._collectives.setdefault(join.key, _Collective(join))
        if actor.name not in join.participants:
            raise ValueError(f"{actor.name} joined {join.key} without being a participant")
        collective.arrived[actor.name] = self.now

    def _settle(self) -> None:
        """Applies every change possible at `now`: finished works, ready waits, polls, full joins."""
        changed = True
        while changed:
            changed = False
            for actor in list(self._actors.values()):
                command = actor.command
                if actor.done or command is None:
                    continue
                if isinstance(command, Work) and actor.interrupt is None:
                    if actor.remaining <= EPS:
                        self.spans.append(Span(actor.name, command.name, command.tag, actor.since, self.now))
                        self._advance(actor)
                        changed = True
                    elif command.poll is not None:
                        join = command.poll()
                        if join is not None:
                            actor.interrupt, actor.interrupt_since = join, self.now
                            self._arrive(actor, join)
                            changed = True
                elif isinstance(command, WaitUntil) and command.ready():
                    if command.name is not None:
                        self.spans.append(Span(actor.name, command.name, command.tag, actor.since, self.now))
                    self._advance(actor)
                    changed = True
            for key, collective in list(self._collectives.items()):
                join = collective.join
                if collective.start is None and set(collective.arrived) == set(join.participants):
                    collective.start = self.now
                    changed = True
                if collective.start is not None and self.now >= collective.start + join.seconds - EPS:
                    del self._collectives[key]
                    for name, arrived in collective.arrived.items():
                        self.spans.append(
                            Span(name, join.name, join.tag, arrived, self.now, collective.start)
                        )
                        actor = self._actors[name]
                        if actor.interrupt is not None and actor.interrupt.key == key:
                            actor.interrupt = None  # back to the paused work
                        else:
                            self._advance(actor)
                    changed = True

    def _rates(self) -> dict[str, float]:
        """Speed of every running work (1: full speed) under processor sharing of its pool."""
        wanted: dict[str, float] = {}
        running = [
            a
            for a in self._actors.values()
            if not a.done and isinstance(a.command, Work) and a.interrupt is None and a.remaining > EPS
        ]
        for a in running:
            if a.pool is not None:
                wanted[a.pool] = wanted.get(a.pool, 0.0) + a.command.threads
        rates = {}
        for a in running:
            cores = self.pool_cores.get(a.pool, math.inf) if a.pool is not None else math.inf
            rates[a.name] = min(1.0, cores / wanted[a.pool]) if a.pool is not None else 1.0
        return rates

    def _next_event_in(self) -> float:
        dt = math.inf
        for name, rate in self._rates().items():
            dt = min(dt, self._actors[name].remaining / rate)
        for collective in self._collectives.values():
            if collective.start is not None:
                dt = min(dt, collective.start + collective.join.seconds - self.now)
        return max(dt, 0.0)

    def _elapse(self, dt: float) -> None:
        for name, rate in self._rates().items():
            self._actors[name].remaining -= dt * rate
        self.now += dt

    def _state(self) -> str:
        lines = [f"stuck at t={self.now:.3f}:"]
        for a in self._actors.values():
            what = "done" if a.done else type(a.command).__name__ + f" {getattr(a.command, 'name', '')}"
            if isinstance(a.command, Join):
                what += f" {a.command.key}"
            lines.append(f"  {a.name}: {what}")
        for key, c in self._collectives.items():
            lines.append(f"  {key}: waiting for {sorted(set(c.join.participants) - set(c.arrived))}")
        return "\n".join(lines)
