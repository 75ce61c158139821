"""How many CPU threads a rank computes with: its share of the machine's cores, and more while the other
side of the run only waits for it.

By default every rank computes with a share of its machine's cores: all of them in sync mode (the sides
take turns), the cores split across the ranks that run at once otherwise. Some stretches of an async or
stream run have only one side at work: the first batch (of a resumed async run too) is only generated
(the trainer waits for it),
the last step only trains (nothing is left to sample: stream admission stops at the run's last step),
and an evaluation only generates. There the working side borrows the waiting side's cores
(`borrowed_cores`). Measured on the GSM8K benchmark's 2-core machine (16 x 128 tokens a step, bf16, one
thread a rank otherwise): the first batch 9.5 -> 7.2 s, the last step's training 7.9 -> 5.7 s; a 4-step
run's loop 46.6 -> 42.5 s async (160 -> 175 tokens/s) and 48.1 -> 41.9 s stream (155 -> 178). A long
run gains those seconds once (an async run again after each resume).

A user who fixed `ranks.threads_per_rank` keeps it throughout. Nothing is borrowed when the ranks
share their machine with other machines' ranks of the run (a share of the cores there depends on how
the ranks are spread), and the vLLM engine's threads are fixed when it starts: borrowing speeds up
what the rank computes itself (the HF generator, the trainer).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

from llamarl.control.config import RunConfig


def rank_threads(config: RunConfig) -> int:
    """The CPU threads each rank computes with: `ranks.threads_per_rank` when set, else a share of the
    cores (`default_threads`)."""
    return config.ranks.threads_per_rank or default_threads(config)


def default_threads(config: RunConfig) -> int:
    """All of the machine's cores in sync mode (the ranks take turns), else the cores split across the
    machine's ranks."""
    cores = os.cpu_count() or 1
    if config.schedule.mode == "sync":
        return cores
    return max(1, cores // _ranks_on_this_machine(config))


def busy_threads(config: RunConfig, busy_ranks: int) -> int | None:
    """The threads each of `busy_ranks` ranks may compute with while every other rank of the run waits
    for them: their share of the machine's cores (never fewer than `rank_threads`); None where nothing
    is borrowed (threads fixed by the user, or the run spans several machines)."""
    if config.ranks.threads_per_rank is not None or _ranks_on_this_machine(config) != config.world_size:
        return None
    return max(rank_threads(config), (os.cpu_count() or 1) // max(1, busy_ranks))


@contextlib.contextmanager
def borrowed_cores(config: RunConfig, busy_ranks: int) -> Iterator[None]:
    """This rank computes with `busy_threads` threads meanwhile (if any), then with what it had."""
    threads = busy_threads(config, busy_ranks)
    before = torch.get_num_threads()
    if threads is not None and threads != before:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


def _ranks_on_this_machine(config: RunConfig) -> int:
    # Under torchrun the machines are torchrun's (--nnodes), not launch.nnodes.
    return int(os.environ.get("LOCAL_WORLD_SIZE", config.world_size // config.launch.nnodes))
