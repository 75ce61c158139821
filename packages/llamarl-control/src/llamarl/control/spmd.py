"""What every rank runs (SPMD): pick this rank's side, build it, run it, tear it down.

    rank r ──▶ TrainerSide (r < N), GeneratorSide (N <= r < N+G) or RewardSide (the reward ranks after)
               side.setup()    models, executors, channels, the resumed checkpoint
               side.run()      the schedule (llamarl.control.schedule), evaluations, checkpoints
               side.close()    always, even after a failure

`llamarl.control.launcher` starts one process per rank through torch elastic and calls `run_rank` in
each, with the default (gloo) process group initialised.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from llamarl.control.config import RunConfig
from llamarl.control.generator_side import GeneratorSide
from llamarl.control.reward_side import RewardSide
from llamarl.control.side import Side
from llamarl.control.trainer_side import TrainerSide


def run_rank(
    config: RunConfig, train_rows: list[dict], eval_rows: list[dict], *, draw_report: bool = True
) -> dict[str, Any] | None:
    """Runs this rank's side of the job; returns the summary on the first trainer rank, None elsewhere.
    The first trainer rank draws report.png if `draw_report` (not when the launcher draws it)."""
    rank = dist.get_rank()
    if rank < config.ranks.num_trainers:
        kind: type[Side] = TrainerSide
    elif rank in config.reward_ranks:
        kind = RewardSide
    else:
        kind = GeneratorSide
    side: Side = kind(config, train_rows, eval_rows, rank=rank)
    side.draw_report = draw_report
    try:
        side.setup()
        return side.run()
    finally:
        side.close()
