"""The loop of one reward worker process (`llamarl.exec.reward.pool` starts them).

A worker is a fresh interpreter that imports this module, then the reward functions' own modules
(unpickling them), never torch or transformers, nor the parent's main script unless a reward function
lives there. It then starts in a fraction of a second and holds tens of MB, not the half GB a torch
import costs, so the pool can start more of them when its workers all wait on slow functions.

Before each reward function call the worker writes which function and which sample of its job it is
on into a small memory map the parent reads too: a parent that kills a hung worker names the function.
"""

from __future__ import annotations

import io
import mmap
import pickle
import runpy
import signal
import struct
import sys
import types
from multiprocessing.connection import Connection

from llamarl.exec.reward.functions import Reward, score_samples

WHERE = struct.Struct("<ii")
"""The layout of the memory map a worker writes before each call: (reward function index, sample
offset in its job; -1: all the job's samples at once); (-1, -1) before the first call."""

_MAIN_NAMES = ("__main__", "__mp_main__")  # where a function of the parent's main script is pickled from


def main() -> None:
    """Entry of a worker process: `python -c "...; main()" CONNECTION_FD WHERE_FD`.

    Receives (the parent's main script, the pickled rewards), says "ready", then loops: receive (job,
    prompts, completions, rows), send (job, scores, errors); None or the parent's exit ends it.
    """
    # Ctrl-C (and a scheduler's SIGTERM) reach every process of the run: a worker ends with its rank
    # (which stops it, or whose exit closes the socket), never with a traceback of its own.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    conn = Connection(int(sys.argv[1]))
    where = mmap.mmap(int(sys.argv[2]), WHERE.size)
    main_script, payload = conn.recv()
    rewards = _load_rewards(payload, main_script)
    conn.send(("ready", None, None))

    def on_call(k: int, j: int) -> None:
        WHERE.pack_into(where, 0, k, j)

    while True:
        try:
            task = conn.recv()
        except EOFError:  # the parent went away
            return
        if task is None:
            return
        job, prompts, completions, rows = task
        scores, errors = score_samples(rewards, prompts, completions, rows, on_call=on_call)
        WHERE.pack_into(where, 0, -1, -1)
        conn.send((job, scores, errors))


def _load_rewards(payload: bytes, main_script: tuple[str | None, str | None]) -> tuple[Reward, ...]:
    """The rewards, unpickled; the parent's main script is run (as `__mp_main__`, as multiprocessing's
    spawn does) only when one of them is defined there."""

    class Unpickler(pickle.Unpickler):
        def find_class(self, module: str, name: str):
            if module in _MAIN_NAMES:
                module = _import_main(*main_script)
            return super().find_class(module, name)

    return Unpickler(io.BytesIO(payload)).load()


def _import_main(name: str | None, path: str | None) -> str:
    """Runs the parent's main module (by its module name, else its file) as `__mp_main__`, once, and
    makes it `__main__` too; returns the name to look functions up in."""
    # Not "is __mp_main__ in sys.modules": importing multiprocessing aliases it to this process's own.
    if not getattr(sys.modules.get("__mp_main__"), "_llamarl_parent_main", False):
        if name is None and path is None:
            raise pickle.UnpicklingError(
                "a reward function lives in the parent's __main__, which has no file"
            )
        module = types.ModuleType("__mp_main__")
        module._llamarl_parent_main = True
        sys.modules["__mp_main__"] = module  # before running it: it may import itself
        if name is not None:
            module.__dict__.update(runpy.run_module(name, run_name="__mp_main__"))
        else:
            module.__dict__.update(runpy.run_path(str(path), run_name="__mp_main__"))
        sys.modules["__main__"] = module
    return "__mp_main__"
