"""The loop of one reward worker process (`llamarl.exec.reward.pool` starts them).

A spawned worker imports the module of its target first, so this one imports nothing heavy: only the
reward functions' own module (`llamarl.exec.reward.functions`), never torch or transformers. A worker then
starts in a fraction of a second and holds tens of MB, not the half GB a torch import costs.
"""

from __future__ import annotations

import signal
from multiprocessing.connection import Connection

from llamarl.exec.reward.functions import Reward, score_samples


def worker_main(conn: Connection, rewards: tuple[Reward, ...]) -> None:
    """Worker loop: receive (job, prompts, completions, rows), send (job, scores, errors)."""
    # Ctrl-C (and a scheduler's SIGTERM) reach every process of the run: a worker ends with its rank
    # (which stops it, or whose exit closes the pipe), never with a traceback of its own.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    conn.send(("ready", None, None))
    while True:
        try:
            task = conn.recv()
        except EOFError:  # the parent went away
            return
        if task is None:
            return
        job, prompts, completions, rows = task
        scores, errors = score_samples(rewards, prompts, completions, rows)
        conn.send((job, scores, errors))
