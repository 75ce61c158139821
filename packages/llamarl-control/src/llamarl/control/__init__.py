"""llamarl.control: the single controller, the channels between executors, launch and metrics."""

from llamarl.control.config import ConfigError, RunConfig
from llamarl.control.launch import RunFailed, launch
from llamarl.control.tasks import GSM8K, MATH, TASKS, DataError, Example, Task, load_examples

__all__ = [
    "GSM8K",
    "MATH",
    "TASKS",
    "ConfigError",
    "DataError",
    "Example",
    "RunConfig",
    "RunFailed",
    "Task",
    "launch",
    "load_examples",
]
