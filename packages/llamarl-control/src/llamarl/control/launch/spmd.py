"""What every rank runs (SPMD): pick this rank's side, build it, run it, tear it down.

    rank r ──▶ TrainerSide (r < N), GeneratorSide (N <= r < N+G) or RewardSide (the reward ranks after)
               side.setup()    models, executors, channels, the resumed checkpoint
               side.run()      the schedule (llamarl.control.run.schedule), evaluations, checkpoints
               side.close()    always, even after a failure

`llamarl.control.launch.launcher` starts one process per rank through torch elastic and calls `run_rank` in
each, with the default (gloo) process group initialised.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from llamarl.control.config import Role, RunConfig
from llamarl.control.launch.progress import ProgressMark
from llamarl.control.run.generator_side import GeneratorSide
from llamarl.control.run.reward_side import RewardSide
from llamarl.control.run.side import Side
from llamarl.control.run.trainer_side import TrainerSide

SIDES: dict[Role, type[Side]] = {"trainer": TrainerSide, "generator": GeneratorSide, "reward": RewardSide}


def run_rank(
    config: RunConfig,
    train_rows: list[dict],
    eval_rows: list[dict],
    *,
    draw_report: bool = True,
    progress: ProgressMark | None = None,
) -> dict[str, Any] | None:
    """Runs this rank's side of the job; returns the summary on the first trainer rank, None elsewhere.
    The first trainer rank draws report.png if `draw_report` (not when the launcher draws it); the side
    marks its progress in `progress`."""
    rank = dist.get_rank()
    side: Side = SIDES[config.role_of(rank)](config, train_rows, eval_rows, rank=rank, progress=progress)
    side.draw_report = draw_report
    try:
        side.setup()
        return side.run()
    finally:
        side.close()
