"""The client side of one vLLM engine process: start it, call it with a deadline, stop it.

`EngineClient` runs `llamarl.exec.generate.vllm.server` in the vLLM environment
(`llamarl.exec.generate.vllm.env`) with one end of a socket pair and speaks its protocol
(`llamarl.exec.generate.vllm.protocol`: the requests, their replies, which may come during a generate).
Every wait has a deadline; an engine that dies (crash, out of memory, kill -9) is reported as
`EngineLost` with the tail of its log, anything else that goes wrong (a request the engine refuses
included) as `EngineError`.

It knows nothing about sampling or weights: `llamarl.exec.generate.vllm.generator.VLLMGenerator` builds the
requests and reads the replies. The one protocol subtlety lives here: while a `generate` runs, the
caller may send nested requests (a weight sync, a version query) that the engine answers between two of
its steps, so a nested request's reply and the generate's own reply can cross; replies are sorted by the
method they name.
"""

from __future__ import annotations

import os
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from llamarl.exec.generate.vllm import protocol as p
from llamarl.exec.generate.vllm.env import engine_env, find_vllm_python
from llamarl.exec.types import PauseGeneration

_SERVER = Path(__file__).resolve().with_name("server.py")

#: How often a `generate` calls its `between_steps` while it waits for the engine (seconds).
BETWEEN_STEPS_S = 0.05
#: How long an abandoned generate waits for the engine to confirm its abort before killing it.
ABORT_TIMEOUT_S = 30.0


class EngineError(RuntimeError):
    """The engine process failed, died or missed a deadline; the message carries its error or log tail."""


class EngineLost(EngineError):
    """The engine process is gone (it exited, was killed, or closed its connection).

    Restartable: `VLLMGenerator.restart_engine()` starts a new engine in its place. Other `EngineError`s
    (an error raised inside a live engine, a missed deadline) are not this class.

    Attributes:
        exit_code: the engine's exit status (negative: killed by that signal), None if unknown.
    """

    def __init__(self, message: str, *, exit_code: int | None) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class EngineClient:
    """One engine process and the connection to it.

    `server_args` are `server.py`'s flags (model, dtype, ...); `num_threads` and `device` (the
    generator rank's: "cuda:i" gives the engine that GPU alone) go into the engine's environment.
    Every call waits at most `timeout_s` unless given its own deadline; the start waits at most
    `start_timeout_s`. The engine's output is appended to `log_path` (default: a temporary file,
    deleted after a clean close; kept when the engine did not end cleanly: it is the only trace of why).
    """

    def __init__(
        self,
        *,
        server_args: list[str],
        vllm_python: str | None,
        num_threads: int,
        log_path: Path | None,
        start_timeout_s: float,
        timeout_s: float,
        device: str = "cpu",
    ) -> None:
        self.server_args = server_args
        self.device = device
        self.vllm_python = vllm_python
        self.num_threads = num_threads
        self._temporary_log = log_path is None  # ours to delete after a clean close
        if log_path is None:
            fd, name = tempfile.mkstemp(prefix="llamarl-vllm-engine-", suffix=".log")
            os.close(fd)
            log_path = Path(name)
        self.log_path = log_path
        self.start_timeout_s = start_timeout_s
        self.timeout_s = timeout_s
        self.info: dict[str, Any] = {}  # what the engine reported on start (vllm and torch versions, ...)
        self._proc: subprocess.Popen | None = None
        self._conn: Connection | None = None
        # Set while a generate waits for the engine; its reply, when a nested call reads it, is kept here.
        self._generating = False
        self._generate_reply: p.Reply | None = None

    # ----------------------------------------------------------------------------------------------
    # the process

    def start(self) -> None:
        """Starts an engine process (appending to the log) and waits until it serves."""
        python = find_vllm_python(self.vllm_python, cuda=self.device.startswith("cuda"))
        ours, theirs = socket.socketpair()
        # -P: the script's folder (llamarl/exec, with a types.py) must not shadow the standard library.
        command = [python, "-P", str(_SERVER), "--fd", str(theirs.fileno()), *self.server_args]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self._proc = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=engine_env(num_threads=self.num_threads, device=self.device),
                pass_fds=(theirs.fileno(),),
            )
        theirs.close()
        self._conn = Connection(ours.detach())
        started = self._receive(self.start_timeout_s, what="the engine to start")
        if not isinstance(started, p.Started) or started.info is None:
            self.kill()
            raise EngineError(f"the vLLM engine failed to start:\n{getattr(started, 'error', started)}")
        self.info = started.info

    @property
    def pid(self) -> int | None:
        """Process id of the engine (None before start and after close)."""
        return None if self._proc is None else self._proc.pid

    def alive(self) -> bool:
        """Whether the engine process runs (False before start, after close and once it died)."""
        return self._proc is not None and self._proc.poll() is None

    def close(self) -> bool:
        """Stops the engine (politely, then by force after a few seconds); True if it ended cleanly.
        Idempotent."""
        if self._proc is None:
            return False
        clean = False
        try:
            if self._proc.poll() is None and self._conn is not None:
                self._conn.send(p.Close())
                clean = self._proc.wait(timeout=15) == 0
        except (OSError, subprocess.TimeoutExpired, EOFError):
            pass
        self.kill()
        if clean and self._temporary_log:
            self.log_path.unlink(missing_ok=True)
        return clean

    def kill(self) -> None:
        """Kills the engine if it runs and drops the connection."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait(timeout=30)
        self._proc = None
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def log_tail(self, num_chars: int = 6000) -> str:
        """The end of the engine's log (what a failure message shows)."""
        try:
            return self.log_path.read_text(errors="replace")[-num_chars:]
        except OSError:
            return ""

    # ----------------------------------------------------------------------------------------------
    # calls

    def call(self, request: p.Request, *, deadline_s: float | None = None) -> Any:
        """Has the engine serve `request`; returns its reply's value, waiting at most `deadline_s`
        (default: `timeout_s`). Raises EngineError for a request the engine refuses (`protocol.refusal`:
        during a generate, from its `between_steps`, only the nested ones), before sending it."""
        why = p.refusal(request, generating=self._generating)
        if why is not None:
            raise EngineError(why)
        self._send(request)
        reply = self._reply_to(request.method, deadline_s or self.timeout_s)
        if reply.error is not None:
            raise EngineError(f"the vLLM engine failed in {request.method}:\n{reply.error}")
        return reply.value

    def generate(self, request: p.Generate, between_steps: Callable[[], None] | None) -> p.GenerateReply:
        """Sends one generate request and waits for its reply, calling `between_steps` about every
        BETWEEN_STEPS_S meanwhile. When `between_steps` raises `PauseGeneration` the engine ends the
        generate early and its reply (`paused`, `finished`) holds what was sampled so far.

        The wait is bounded by `timeout_s` of engine time: the time spent inside `between_steps` (a
        weight sync waiting for the trainer, with a deadline of its own) extends it. If the wait is
        abandoned (`between_steps` raised, the deadline passed) the engine's requests are aborted first,
        so they never run into the next call nor their late reply is read as the next call's.
        """
        if self._generating:
            raise RuntimeError("generate called from inside a generate (between_steps)")
        self._send(request)
        self._generating, self._generate_reply = True, None
        try:
            self._await_generate(between_steps)
        except BaseException as exc:
            if self._generate_reply is None and not isinstance(exc, EngineLost):  # a lost one has none
                self._abort_generate()
            raise
        finally:
            self._generating = False
        reply, self._generate_reply = self._generate_reply, None
        assert reply is not None
        if reply.error is not None:
            raise EngineError(f"the vLLM engine failed in generate:\n{reply.error}")
        return reply.value

    def _await_generate(self, between_steps: Callable[[], None] | None) -> None:
        """Waits for the generate's reply (into `_generate_reply`), calling `between_steps` meanwhile;
        a `PauseGeneration` from it pauses the generate."""
        deadline = time.monotonic() + self.timeout_s
        while self._generate_reply is None:
            wait_s = BETWEEN_STEPS_S if between_steps is not None else 1.0
            reply = self._next_message(min(wait_s, max(0.0, deadline - time.monotonic())), what="generate")
            if reply is not None:
                self._keep_generate_reply(reply, awaited="generate")
                return
            if time.monotonic() >= deadline:
                raise EngineError(
                    f"timed out after {self.timeout_s:.0f} s waiting for generate:\n{self.log_tail()}"
                )
            if between_steps is not None:
                called = time.monotonic()
                try:
                    between_steps()
                except PauseGeneration:
                    # The engine ends the generate and replies with what it sampled so far (or
                    # with all of it, if it finished just before the pause arrived).
                    self._end_generate(p.Pause())
                    return
                deadline += time.monotonic() - called

    def _end_generate(self, request: p.Pause | p.Abort) -> None:
        """Has the engine end the generate in flight (`Pause`: with what it sampled so far; `Abort`:
        abandoned) and reads both replies, this request's and the generate's, waiting at most
        ABORT_TIMEOUT_S: the connection is then in step for the next call."""
        self._send(request)
        deadline = time.monotonic() + ABORT_TIMEOUT_S
        answered = False
        while not (answered and self._generate_reply is not None):
            reply = self._receive(max(0.0, deadline - time.monotonic()), what=request.method)
            if reply.method == request.method:
                answered = True
            else:
                self._keep_generate_reply(reply, awaited=request.method)

    def _abort_generate(self) -> None:
        """Aborts the generate in flight (`_end_generate`). An engine that does not answer in time is
        killed: the next call reports it as an `EngineLost`."""
        try:
            self._end_generate(p.Abort())
        except EngineLost:
            pass  # the next call reports it
        except EngineError:
            if self._proc is not None and self._proc.poll() is None:
                self._proc.kill()

    def _keep_generate_reply(self, reply: p.Reply, *, awaited: str) -> None:
        """Keeps the generate's reply for `generate`; any other reply here is out of step."""
        if reply.method != p.Generate.method:
            raise EngineError(f"the vLLM engine answered {reply.method!r} while {awaited} was awaited")
        self._generate_reply = reply

    # ----------------------------------------------------------------------------------------------
    # the wire

    def _send(self, request: p.Request) -> None:
        if self._conn is None:
            raise RuntimeError("the vLLM engine is not running (used before setup() or after close())")
        try:
            self._conn.send(request)
        except OSError:  # broken pipe: the engine died while idle
            raise self._lost(f"was gone when {request.method} was sent") from None

    def _reply_to(self, method: str, timeout_s: float) -> p.Reply:
        """The engine's reply to `method`, waiting at most timeout_s in all.

        A request made during a generate (a nested call) may see the generate's own reply first (the
        engine finished just as the request was sent): it is kept for `generate`.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            reply = self._receive(max(0.0, deadline - time.monotonic()), what=method)
            if reply.method == method:
                return reply
            if self._generating and self._generate_reply is None:
                self._keep_generate_reply(reply, awaited=repr(method))
                continue
            raise EngineError(f"the vLLM engine answered {reply.method!r} while {method!r} was awaited")

    def _receive(self, timeout_s: float, *, what: str) -> Any:
        """The engine's next message, waiting at most timeout_s; fails fast if the engine dies."""
        deadline = time.monotonic() + timeout_s
        while True:
            message = self._next_message(min(1.0, max(0.0, deadline - time.monotonic())), what=what)
            if message is not None:
                return message
            if time.monotonic() >= deadline:
                raise EngineError(f"timed out after {timeout_s:.0f} s waiting for {what}:\n{self.log_tail()}")

    def _next_message(self, wait_s: float, *, what: str) -> Any:
        """The engine's next message (a `Reply`, or the `Started` first) if one comes within wait_s,
        else None; EngineLost if it is gone."""
        assert self._conn is not None and self._proc is not None
        if not self._conn.poll(wait_s):
            if self._proc.poll() is not None:
                raise EngineLost(
                    f"the vLLM engine exited (code {self._proc.returncode}) while waiting for {what}; "
                    f"its log ends:\n{self.log_tail()}",
                    exit_code=self._proc.returncode,
                )
            return None
        try:
            return self._conn.recv()
        except (EOFError, OSError):  # EOF, or a reset connection: the engine is gone or going
            raise self._lost(f"closed its connection while waiting for {what}") from None

    def _lost(self, what_happened: str) -> EngineLost:
        """An EngineLost for an engine whose connection broke: waits (bounded) for it to exit."""
        assert self._proc is not None
        try:
            exit_code: int | None = self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            # A closed connection but a live process: it cannot serve us any more; do not leave it.
            self._proc.kill()
            exit_code = self._proc.wait(timeout=30)
        return EngineLost(
            f"the vLLM engine {what_happened} (exit code {exit_code}); its log ends:\n{self.log_tail()}",
            exit_code=exit_code,
        )
