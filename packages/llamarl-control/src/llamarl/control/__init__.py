"""llamarl.control: the single controller. Its rooms:

    config.py cli.py   the run config (one typed tree) and the command line and config files made from it
    entry.py           `train` (from Python) and `main` (a command line): check everything, then launch
    tasks/             what a run learns: the Task API, rows, the built-in tasks, the registry
    launch/            starting the ranks (torch elastic), devices, threads, nodes, failures, memory
    run/               what each rank does: the sides, their loops, the schedules, the channels,
                       evaluation, checkpoints
    outputs/           what a run writes: metrics, the summary, the trace, the report

Public names load lazily (PEP 562), so reading a dataset or a config does not start torch.distributed.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    "ConfigError": "config",
    "RunConfig": "config",
    "parse_run_config": "cli",
    "RunFailed": "launch.failures",
    "RunInterrupted": "launch.failures",
    "launch": "launch.launcher",
    "train": "entry",
    "main": "entry",
    "GSM8K": "tasks.gsm8k",
    "MATH": "tasks.math",
    "TASKS": "tasks.registry",
    "DataError": "tasks.task",
    "Hub": "tasks.task",
    "Task": "tasks.task",
    "TaskError": "tasks.task",
    "load_rows": "tasks.rows",
    "load_task": "tasks.registry",
    "reasoning_gym_task": "tasks.reasoning_gym",
}

__all__ = [
    "GSM8K",
    "MATH",
    "TASKS",
    "ConfigError",
    "DataError",
    "Hub",
    "RunConfig",
    "RunFailed",
    "RunInterrupted",
    "Task",
    "TaskError",
    "launch",
    "load_rows",
    "load_task",
    "main",
    "parse_run_config",
    "reasoning_gym_task",
    "train",
]

if TYPE_CHECKING:
    from llamarl.control.cli import parse_run_config
    from llamarl.control.config import ConfigError, RunConfig
    from llamarl.control.entry import main, train
    from llamarl.control.launch.failures import RunFailed, RunInterrupted
    from llamarl.control.launch.launcher import launch
    from llamarl.control.tasks.gsm8k import GSM8K
    from llamarl.control.tasks.math import MATH
    from llamarl.control.tasks.reasoning_gym import reasoning_gym_task
    from llamarl.control.tasks.registry import TASKS, load_task
    from llamarl.control.tasks.rows import load_rows
    from llamarl.control.tasks.task import DataError, Hub, Task, TaskError


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f"llamarl.control.{_EXPORTS[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'llamarl.control' has no attribute {name!r}")
