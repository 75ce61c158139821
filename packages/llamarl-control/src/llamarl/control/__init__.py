"""llamarl.control: the single controller: the run config, the two sides of a run, the channels between
them, launch through torch elastic, checkpoints, evaluation and metrics.

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
    "GSM8K": "tasks",
    "MATH": "tasks",
    "TASKS": "tasks",
    "DataError": "tasks",
    "Example": "tasks",
    "Task": "tasks",
    "load_examples": "tasks",
}

__all__ = [
    "GSM8K",
    "MATH",
    "TASKS",
    "ConfigError",
    "DataError",
    "Example",
    "RunConfig",
    "RunFailed",
    "RunInterrupted",
    "Task",
    "launch",
    "load_examples",
    "parse_run_config",
]

if TYPE_CHECKING:
    from llamarl.control.cli import parse_run_config
    from llamarl.control.config import ConfigError, RunConfig
    from llamarl.control.failures import RunFailed, RunInterrupted
    from llamarl.control.launcher import launch
    from llamarl.control.tasks import GSM8K, MATH, TASKS, DataError, Example, Task, load_examples


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f"llamarl.control.{_EXPORTS[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'llamarl.control' has no attribute {name!r}")
