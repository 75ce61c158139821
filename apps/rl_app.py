"""The command line shared by the RL apps (`uv run apps/gsm8k_rl`, `uv run apps/task_rl`, ...).

`llamarl.control.main` does the work (settings from flags and `--config FILE`, the model and the rows
checked, the ranks launched, the summary printed; every user error one line); the apps add the copies of
GSM8K and MATH shipped in apps/data for a machine that cannot reach the hub.
"""

from __future__ import annotations

import sys
from pathlib import Path

from llamarl.control import RunConfig, Task
from llamarl.control.entry import main as run_main
from llamarl.control.tasks import Hub, hub_unavailable_reason

EMBEDDED_DATA = Path(__file__).resolve().parent / "data"  # compressed copies shipped with the apps


def resolve_data(config: RunConfig, task: Task) -> str | None:
    """The dataset to load: the setting, else the task's own rows, else the embedded copy when the hub
    cannot be reached (said in one line, instead of letting the hub client retry with warnings)."""
    embedded = EMBEDDED_DATA / task.name
    if config.task.data is not None or not isinstance(task.rows, Hub) or not embedded.is_dir():
        return config.task.data
    reason = hub_unavailable_reason()
    if reason is None:
        return None
    print(f"{task.name}_rl: {reason}: using the {task.name} copy shipped in {embedded}", file=sys.stderr)
    return str(embedded)


def main(task: str | None, argv: list[str] | None = None) -> int:
    """Runs the app of `task` (a built-in task's name; None: the task comes from --task.module or
    --task.name)."""
    return run_main(task, argv, prog=f"{task}_rl" if task else "task_rl", resolve_data=resolve_data)
