"""Runs untrusted Python (a model's code, a user's tool function) in a child process with limits.

Each run is a fresh `python` child process in its own session and temporary folder:
- time: a wall-clock deadline (the whole process group is killed at it) and a CPU-time rlimit;
- memory: an address-space rlimit (`memory_mb`);
- output: stdout and stderr together are read up to `max_output_bytes`; a child that writes more is
  killed (a flood cannot fill memory or the prompt);
- files: a file-size rlimit, and the working folder is a temporary one, removed afterwards;
- network (unless allowed): the child moves itself into a new, empty network namespace before running
  anything (Linux `unshare`; where the kernel refuses it, Python's socket module is disabled instead,
  which stops ordinary code, not code that goes around it with ctypes).

Nothing here imports torch; a run costs one interpreter start (about 30 ms with `-I -S`).
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

# What the child runs first: limits on itself, the network cut, then the payload read from stdin.
_PRELUDE = r"""
import ctypes, json, os, resource, sys
spec = json.loads(sys.stdin.readline())
if spec["memory_mb"]:
    limit = spec["memory_mb"] << 20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
cpu = int(spec["cpu_s"]) + 1
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
resource.setrlimit(resource.RLIMIT_FSIZE, (spec["file_bytes"], spec["file_bytes"]))
if not spec["network"]:
    CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNET) != 0 and libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) != 0:
        import socket
        def _no_network(*args, **kwargs):
            raise OSError("network access is disabled in this sandbox")
        socket.socket = socket.create_connection = socket.socketpair = _no_network
        socket.getaddrinfo = _no_network
payload = sys.stdin.read()
del ctypes, json, resource, spec
"""

_RUN_CODE = (
    _PRELUDE
    + r"""
sys.argv = ["<sandbox>"]
exec(compile(payload, "<sandbox>", "exec"), {"__name__": "__main__"})
"""
)

_CALL_FUNCTION = (
    _PRELUDE
    + r"""
import importlib, json as _json
_call = _json.loads(payload)
try:
    _target = importlib.import_module(_call["module"])
    for _part in _call["qualname"].split("."):
        _target = getattr(_target, _part)
    _result = _target(**_call["arguments"])
except BaseException as _e:  # the exception itself, not a traceback, is what the caller reports
    _message = str(_e)[: _call["max_error_chars"]]
    sys.stdout.write("\x00RAISED\x00" + _json.dumps([type(_e).__name__, _message]))
    sys.stdout.flush()
    os._exit(1)
sys.stdout.write("\x00RESULT\x00" + str(_result))
"""
)
RESULT_MARK = "\x00RESULT\x00"
RAISED_MARK = "\x00RAISED\x00"
MAX_ERROR_CHARS = 500
"""How much of a raised exception's message a sandboxed call reports."""


@dataclass(frozen=True)
class SandboxResult:
    """What a sandboxed run produced."""

    output: str  # stdout and stderr together, cut at the output limit
    exit_code: int | None  # None when it was killed at a limit
    timed_out: bool = False  # killed at the wall-clock deadline
    flooded: bool = False  # killed for writing more than max_output_bytes
    raised: str | None = None  # a called function's exception, "Type: message" (message bounded)

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    def describe(self) -> str:
        """The output, with a last line saying why the run ended when it did not end well."""
        if self.timed_out:
            return f"{self.output}\n[killed: time limit]".lstrip()
        if self.flooded:
            return f"{self.output}\n[killed: output limit]".lstrip()
        if self.exit_code not in (0, None):
            return f"{self.output}\n[exit code {self.exit_code}]".lstrip()
        return self.output


@dataclass(frozen=True)
class Limits:
    """The limits of one sandboxed run."""

    timeout_s: float = 5.0
    memory_mb: int | None = 512
    max_output_bytes: int = 4096
    max_file_bytes: int = 1 << 20
    network: bool = False


def run_python(code: str, limits: Limits = Limits()) -> SandboxResult:
    """Runs `code` as a script in an isolated interpreter (`python -I -S`: no site packages)."""
    return _run([sys.executable, "-I", "-S", "-c", _RUN_CODE], code, limits, env={})


def call_function(module: str, qualname: str, arguments: dict, limits: Limits) -> SandboxResult:
    """Calls `module.qualname(**arguments)` in a child process (with this process's `sys.path`); the
    output is the call's result as text (what it printed comes before it). A call that raised says
    what in `raised` ("ValueError: no such city"; at most `MAX_ERROR_CHARS` of the message)."""
    payload = json.dumps(
        {"module": module, "qualname": qualname, "arguments": arguments, "max_error_chars": MAX_ERROR_CHARS}
    )
    env = {"PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    result = _run([sys.executable, "-c", _CALL_FUNCTION], payload, limits, env=env)
    printed, mark, value = result.output.partition(RESULT_MARK)
    if mark and result.ok:
        return SandboxResult(output=value, exit_code=result.exit_code)
    printed, mark, raised = result.output.partition(RAISED_MARK)
    if mark and result.exit_code == 1:
        with contextlib.suppress(ValueError):
            kind, message = json.loads(raised)
            return SandboxResult(
                output=printed, exit_code=1, raised=f"{kind}: {message}" if message else kind
            )
    # Killed at a limit, or died without a word: the run's own account.
    return SandboxResult(
        output=result.output, exit_code=result.exit_code, timed_out=result.timed_out, flooded=result.flooded
    )


def _run(command: list[str], payload: str, limits: Limits, *, env: dict[str, str]) -> SandboxResult:
    spec = {
        "memory_mb": limits.memory_mb,
        "cpu_s": limits.timeout_s,
        "file_bytes": limits.max_file_bytes,
        "network": limits.network,
    }
    with tempfile.TemporaryDirectory(prefix="llamarl-sandbox-") as folder:
        process = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            cwd=folder,
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": folder, **env},
            start_new_session=True,  # its own process group: killed whole, children included
        )
        try:
            assert process.stdin is not None and process.stdout is not None
            try:
                process.stdin.write((json.dumps(spec) + "\n" + payload).encode())
                process.stdin.close()
            except BrokenPipeError:
                pass  # it died before reading: its output says why
            output, timed_out, flooded = _read_limited(process, limits)
        finally:
            _kill_group(process)
    text = output.decode(errors="replace")
    if timed_out or flooded:
        return SandboxResult(output=text, exit_code=None, timed_out=timed_out, flooded=flooded)
    return SandboxResult(output=text, exit_code=process.returncode)


def _read_limited(process: subprocess.Popen, limits: Limits) -> tuple[bytes, bool, bool]:
    """Reads the child's output until it exits, its deadline passes or it writes too much."""
    assert process.stdout is not None
    deadline = time.monotonic() + limits.timeout_s
    chunks: list[bytes] = []
    size = 0
    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return b"".join(chunks), True, False
            if not selector.select(timeout=left):
                continue
            chunk = os.read(process.stdout.fileno(), 65536)
            if not chunk:  # end of output: the child exited (or closed its streams)
                try:
                    process.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    return b"".join(chunks), True, False
                return b"".join(chunks), False, False
            chunks.append(chunk)
            size += len(chunk)
            if size > limits.max_output_bytes:
                return b"".join(chunks)[: limits.max_output_bytes], False, True


def _kill_group(process: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    if process.stdout is not None:
        process.stdout.close()
