"""The engine process's requests (vLLM environment): `Engine` serves each request of `protocol` with a
`vllm.LLM` built with llamarl.comm's `llamarl` weight-transfer backend.

In-flight requests: `Generate` steps the engine itself (`LLMEngine.add_request` + `step()`, what
`LLM.generate` does inside) and, between two engine steps, answers the requests that may arrive while
it runs (`protocol.NESTED_METHODS`: a weight sync, a version or progress query, an abort, a pause that
ends the generate with what it sampled so far). A weight sync taken while requests run (a generate's,
or model turns) is pulled into the workers' staging while the engine keeps stepping them, and swapped
in between two steps once whole: generation pauses only for the swap. The requests stay in flight,
their KV cache from the old weights kept (partial rollouts, as in PipelineRL / AReaL), and later tokens
come from the new weights.
"""

from __future__ import annotations

import contextlib
import itertools
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from llamarl.exec.generate.vllm import protocol as p
from llamarl.exec.generate.vllm.engine_sampling import Completions, EngineTurns, add_prompts, sampling_params
from llamarl.exec.generate.vllm.engine_weights import EngineWeights


class GenerateAborted(Exception):
    """The client abandoned the generate in flight (`Abort` between two engine steps, or it went away)."""


class GeneratePaused(Exception):
    """The client paused the generate in flight: it ends now and replies with what was sampled so far."""


class CloseRequested(Exception):
    """A `Close` arrived (while a generate was in flight, its requests are aborted): the process ends."""


class Engine:
    """Serves the protocol's requests (`reply_to`) with `llm`; `conn` is the socket to the generator,
    polled between two engine steps of a generate for nested requests. `async_scheduling`: the engine
    schedules a step ahead, so weights cannot load mid-generate."""

    def __init__(
        self, llm: Any, conn: Connection, *, async_scheduling: bool, log: Callable[[str], None]
    ) -> None:
        self.llm = llm
        self.conn = conn
        self.async_scheduling = async_scheduling
        self.weights = EngineWeights(llm, log)
        self._ids = itertools.count()  # numbers every engine request of this process
        self.turns = EngineTurns(llm, lambda: next(self._ids), lambda: self.weights.version)
        self._generating: Completions | None = None  # the generate in flight's completions
        # A sync asked for during a generate, pulled while it steps; answered once swapped in.
        self._sync: p.ReceiveWeights | None = None
        self._handlers: dict[type[p.Request], Callable[[Any], Any]] = {
            p.Generate: self.generate,
            p.TurnsAdd: lambda r: self.turns.add(r.turns, r.temperature, r.stop_token_ids, r.seed),
            p.TurnsWait: self._turns_wait,
            p.TurnsAbort: self._turns_abort,
            p.Progress: lambda r: (
                self._generating.progress() if self._generating is not None else p.ProgressReply([], [])
            ),
            p.Abort: lambda r: None,  # outside a generate (it finished first): nothing to abandon
            p.Pause: lambda r: None,  # likewise
            p.Close: self._close,
            p.InitWeightSync: lambda r: self.weights.join(r.endpoint, r.announce_timeout_s),
            p.ReceiveWeights: self._receive_weights,
            p.WeightVersion: lambda r: self.weights.reported_version(),
            p.CloseWeightSync: lambda r: self.weights.close(),
        }
        unserved = set(p.REQUESTS) ^ set(self._handlers)
        if unserved:  # a request declared in the protocol and not served here, or the reverse
            raise RuntimeError(
                f"the engine and its protocol disagree on {sorted(r.method for r in unserved)}"
            )

    @property
    def in_flight(self) -> bool:
        """Whether requests run in the engine (a generate's, or model turns)."""
        return self._generating is not None or self.turns.running

    def refusal(self, request: object) -> str | None:
        """Why the engine refuses `request` now (one line; `protocol.refusal`, and no weights load
        mid-generate under async scheduling, where a step scheduled ahead would run on the new weights
        with its tokens stamped as the old), or None."""
        generating = self._generating is not None
        why = p.refusal(request, generating=generating)
        if why is None and generating and self.async_scheduling and isinstance(request, p.ReceiveWeights):
            why = "weights cannot load mid-generate with async scheduling"
        return why

    def reply_to(self, request: object) -> p.Reply:
        """The reply to `request`: its value, a one-line refusal, or the traceback of its failure.
        Raises `CloseRequested` for a `Close`."""
        method = getattr(request, "method", repr(request))
        why = self.refusal(request)
        if why is not None:
            return p.Reply(method, error=why)
        try:
            return p.Reply(method, self._handlers[type(request)](request))
        except CloseRequested:
            raise
        except BaseException:
            return p.Reply(method, error=traceback.format_exc())

    def _close(self, request: p.Close) -> None:
        raise CloseRequested

    def _turns_wait(self, request: p.TurnsWait) -> list[p.TurnDone]:
        done = self.turns.wait(request.max_s)
        if not self.in_flight:
            self.weights.settle_prefix_cache()
        return done

    def _turns_abort(self, request: p.TurnsAbort) -> None:
        self.turns.abort()
        self.weights.settle_prefix_cache()

    def _receive_weights(self, request: p.ReceiveWeights) -> int:
        """A sync outside a generate: model turns running keep decoding while it is pulled (their tokens
        wait in `turns` for the next TurnsWait), and it is swapped in between two of their steps."""
        if not self.turns.running:
            return self.weights.receive(request.timeout_s, in_flight=False)
        self.weights.begin()
        while self.turns.running and not self.weights.staged():
            self.turns.step()
        return self.weights.complete(request.timeout_s, in_flight=self.in_flight)

    # -- generate -------------------------------------------------------------------------------------

    def generate(self, request: p.Generate) -> p.GenerateReply:
        """Samples `request.n` completions per prompt, stepping the engine here (`_step_until_done`).
        A `Pause` between two steps ends the call early: its requests are aborted and the reply holds
        every completion as far as it got, with `finished` saying which are complete."""
        params = sampling_params(
            n=request.n,
            temperature=request.temperature,
            max_tokens=request.max_tokens,
            stop_token_ids=request.stop_token_ids,
            seed=request.seed,
        )
        call = next(self._ids)
        request_ids = [f"llamarl-{call}-{i}" for i in range(len(request.prompts))]
        completions = Completions(request_ids, request.n)
        added: list[str] = []
        paused = False
        self._generating = completions
        try:
            add_prompts(self.llm, request_ids, request.prompts, params, added)
            paused = self._step_until_done(completions)
            # A sync still being pulled when the requests ended goes in now, before the reply.
            self._settle_sync(block=True)
            if not paused:
                added = []  # every request finished: nothing to abort
        finally:
            self._generating = None
            if added:  # aborted or failed half way: the requests must not run into the next call
                self.llm.llm_engine.abort_request(added)
            self._answer_abandoned_sync()
            self.weights.settle_prefix_cache()
        if not paused and not all(completions.finished):
            raise RuntimeError(
                f"the engine ran out of requests with completions unfinished: {completions.finished}"
            )
        return completions.reply(paused=paused, policy_version=self.weights.reported_version())

    def _step_until_done(self, completions: Completions) -> bool:
        """Steps the engine until its requests are done, serving nested requests between two steps
        (a weight sync loads there); True when a `Pause` ended it first."""
        engine = self.llm.llm_engine
        while engine.has_unfinished_requests():
            version_before = self.weights.version
            try:
                self._serve_nested()  # may begin a sync (and raise GenerateAborted)
            except GeneratePaused:
                return True
            self._settle_sync(block=False)  # a sync pulled meanwhile goes in between these two steps
            if self.weights.version != version_before:
                completions.note_version(self.weights.version)
            # The weights this step's forward pass runs with stamp its tokens.
            completions.record(engine.step(), self.weights.version)
        return False

    def _serve_nested(self) -> None:
        """Answers every request waiting on the connection (between two engine steps, never blocking)."""
        while self.conn.poll():
            try:
                request = self.conn.recv()
            except EOFError:  # the generator went away mid-generate: nothing left to serve
                raise GenerateAborted("the generator closed its connection") from None
            if isinstance(request, p.Abort):
                self.conn.send(p.Reply(request.method))
                raise GenerateAborted("aborted by the generator")
            if isinstance(request, p.Pause):
                self.conn.send(p.Reply(request.method))
                raise GeneratePaused
            if isinstance(request, p.Close):
                raise CloseRequested
            if isinstance(request, p.ReceiveWeights) and self.refusal(request) is None:
                self._begin_sync(request)  # answered once swapped in (`_settle_sync`)
                continue
            self.conn.send(self.reply_to(request))

    def _begin_sync(self, request: p.ReceiveWeights) -> None:
        """Starts pulling the sync `request` asks for while the generate steps on; one asked for while
        another is still pulled waits for that one to go in first."""
        if self._sync is not None:
            self._settle_sync(block=True)
        self.weights.begin()
        self._sync = request

    def _settle_sync(self, *, block: bool) -> None:
        """Swaps the sync pulled during the generate in once it is whole (`block`: now, waiting for the
        pull) and answers its request. A failed sync ends the generate: the weights may be partly
        replaced, and tokens sampled on would come from no policy at all."""
        request = self._sync
        if request is None or not (block or self.weights.staged()):
            return
        self._sync = None
        try:
            version = self.weights.complete(request.timeout_s, in_flight=self.in_flight)
        except Exception:
            self.conn.send(p.Reply(request.method, error=traceback.format_exc()))
            raise RuntimeError(
                "the weight sync taken during this generate failed; its requests were aborted"
            ) from None
        self.conn.send(p.Reply(request.method, version))

    def _answer_abandoned_sync(self) -> None:
        """A generate that ended by an error or an abort with a sync still pulled: the sync goes in
        anyway (its sender is sending), and its request gets the answer."""
        if self._sync is None:
            return
        # (Answered with its error, or the generator is gone.)
        with contextlib.suppress(RuntimeError, OSError):
            self._settle_sync(block=True)
