"""Rewards: the task-facing reward functions (`functions.py`), the worker processes that run them with a
deadline per sample (`pool.py`, `worker.py`), and reward models (`model.py`). Nothing heavy is
imported here: a reward worker imports `llamarl.exec.reward.worker` and must start fast."""
