"""llamarl.control: the single controller: tasks and how to run them (`Task`, `train`, `main`), the run
config, the two sides of a run, the channels between them, launch through torch elastic, checkpoints,
evaluation and metrics.

Public names load lazily (PEP 562), so reading a dataset or a config does not start torch.distributed.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    "ConfigError": "config",
    "RunConfig": "config",
    "parse_run_config": "cli",
    "RunFailed": "failures",
    "RunInterrupted": "failures",
    "launch": "launcher",
    "train": "run",
    "main": "run",
    "GSM8K": "tasks",
    "MATH": "tasks",
    "TASKS": "tasks",
    "DataError": "tasks",
    "Hub": "tasks",
    "Task": "tasks",
    "TaskError": "tasks",
    "load_rows": "tasks",
    "load_task": "task_registry",
    "reasoning_gym_task": "reasoning_gym",
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
    from llamarl.control.failures import RunFailed, RunInterrupted
    from llamarl.control.launcher import launch
    from llamarl.control.reasoning_gym import reasoning_gym_task
    from llamarl.control.run import main, train
    from llamarl.control.task_registry import load_task
    from llamarl.control.tasks import (
        GSM8K,
        MATH,
        TASKS,
        DataError,
        Hub,
        Task,
        TaskError,
        load_rows,
    )


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f"llamarl.control.{_EXPORTS[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'llamarl.control' has no attribute {name!r}")
