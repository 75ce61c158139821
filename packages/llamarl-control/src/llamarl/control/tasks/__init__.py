"""Tasks: what a run learns, one file per built-in task, each owning its rows, prompt and rewards.

task.py           the Task API (rows + prompt + rewards; tools or an environment for multi-turn)
rows.py           loading and checking a task's rows (folders, the hub, functions, lists)
registry.py       naming a task: built-in, reasoning-gym's, a user's module, or one given in code
prompts.py        which rows a generator samples, in which order, and how a row becomes token ids
gsm8k.py math.py arith.py calc.py retry.py reasoning_gym.py   the built-in tasks
"""

from llamarl.control.tasks.rows import hub_unavailable_reason, load_rows
from llamarl.control.tasks.task import DataError, Hub, Prompt, Rows, Task, TaskError

__all__ = ["DataError", "Hub", "Prompt", "Rows", "Task", "TaskError", "hub_unavailable_reason", "load_rows"]
