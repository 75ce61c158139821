"""Naming a task: the built-in ones, reasoning-gym's generators, a user's own module, or a `Task` given
in code and registered in this process.

`load_task(task.name, task.module)` is how every part of a run (the config's validation, the launcher,
every rank) finds the task a run config names.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

from llamarl.control.tasks.arith import ARITH
from llamarl.control.tasks.calc import CALC
from llamarl.control.tasks.gsm8k import GSM8K
from llamarl.control.tasks.math import MATH
from llamarl.control.tasks.retry import RETRY
from llamarl.control.tasks.task import Task, TaskError

__all__ = [
    "REASONING_GYM_PREFIX",
    "TASKS",
    "load_task",
    "register_task",
    "task_by_name",
    "task_from_module",
    "task_origin",
]

REASONING_GYM_PREFIX = "reasoning_gym:"

TASKS = {task.name: task for task in (GSM8K, MATH, ARITH, CALC, RETRY)}
"""The built-in tasks by name."""

_REGISTERED: dict[str, Task] = {}  # tasks given as objects (llamarl.control.train), by name, per process
_ORIGINS: dict[str, str] = {}  # of those, where each can be imported again: `task.module`'s form


def register_task(task: Task) -> None:
    """Makes `task` known by its name in this process (a task given as an object, not by module), and
    remembers where it can be imported from again, if a module holds it (`task_origin`)."""
    task.check()
    _REGISTERED[task.name] = task
    origin = _module_holding(task)
    if origin is None:
        _ORIGINS.pop(task.name, None)
    else:
        _ORIGINS[task.name] = origin


def task_origin(name: str) -> str | None:
    """Where the task given in code as `name` can be imported from again (`path/to/file.py:NAME` for a
    script's task, `package.module:NAME` otherwise), for a run's config.toml to rerun it; None when no
    module holds it (it was built inside a function) or it was not given in code."""
    return _ORIGINS.get(name)


def _module_holding(task: Task) -> str | None:
    """`task.module`'s spec of the module-level name that holds `task` itself, if any: the script run
    as __main__ first (by its file), then any other module."""
    for module_name, module in list(sys.modules.items()):
        names = [k for k, v in list(vars(module).items()) if v is task and not k.startswith("_")]
        if not names:
            continue
        if module_name == "__main__":
            file = getattr(module, "__file__", None)
            if file:
                return f"{Path(file).resolve()}:{names[0]}"
            continue
        return f"{module_name}:{names[0]}"
    return None


def task_by_name(name: str) -> Task:
    """A registered task, a built-in one, or `reasoning_gym:DATASET` (a reasoning-gym generator);
    TaskError otherwise."""
    if name in _REGISTERED:
        return _REGISTERED[name]
    if name in TASKS:
        return TASKS[name]
    if name.startswith(REASONING_GYM_PREFIX):
        from llamarl.control.tasks.reasoning_gym import reasoning_gym_task

        return reasoning_gym_task(name.removeprefix(REASONING_GYM_PREFIX))
    raise TaskError(
        f"unknown task {name!r}; known: {', '.join(TASKS)}, {REASONING_GYM_PREFIX}DATASET, or a task of "
        "your own with task.module (a task given in code: run the script that defines it with the same "
        "flags, or set task.module to its file:NAME)"
    )


def task_from_module(spec: str) -> Task:
    """The Task that `spec` names: `package.module:NAME` or `path/to/file.py:NAME`, NAME a Task or a
    function returning one. TaskError (one line) when it does not import or does not define one."""
    for name, origin in _ORIGINS.items():  # given in code in this process: the same object, no import
        if origin == spec:
            return _REGISTERED[name]
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise TaskError(f"task.module {spec!r}: expected 'package.module:NAME' or 'path/to/file.py:NAME'")
    if module_name.endswith(".py"):
        path = Path(module_name).expanduser().resolve()
        if not path.is_file():
            raise TaskError(f"task.module {spec!r}: no file {path}")
        # Imported by its name from its folder, so the ranks and reward workers (fresh processes that
        # inherit sys.path) import it the same way when they unpickle its functions.
        if str(path.parent) not in sys.path:
            sys.path.insert(0, str(path.parent))
        module_name = path.stem
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # the user's module may raise anything while importing
        raise TaskError(
            f"task.module {spec!r}: cannot import {module_name!r} ({type(e).__name__}: {e})"
        ) from None
    if not hasattr(module, attr):
        raise TaskError(f"task.module {spec!r}: module {module_name!r} defines no {attr!r}")
    value = getattr(module, attr)
    if callable(value) and not isinstance(value, Task):
        try:
            value = value()
        except Exception as e:
            raise TaskError(f"task.module {spec!r}: {attr}() raised {type(e).__name__}: {e}") from None
    if not isinstance(value, Task):
        raise TaskError(f"task.module {spec!r}: {attr} is a {type(value).__name__}, not a llamarl Task")
    value.check()
    return value


def load_task(name: str | None, module: str | None = None) -> Task:
    """The task a run names (`task.module` wins over `task.name`)."""
    if module:
        return task_from_module(module)
    if not name:
        raise TaskError("no task: set task.name (a built-in task) or task.module (a task of your own)")
    return task_by_name(name)
