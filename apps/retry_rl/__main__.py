"""`uv run apps/retry_rl --help`: multi-turn RL with feedback: one-digit sums, three tries (the CPU
multi-turn learning recipe in README.md, `--config recipes/retry_cpu.toml`)."""

import sys
from pathlib import Path

# The task's module must be importable by name in the ranks and reward workers (fresh processes that
# inherit sys.path), so it lives beside this file, not in it.
sys.path.insert(0, str(Path(__file__).resolve().parent))

from retry_task import TASK

from llamarl.control import main

if __name__ == "__main__":
    sys.exit(main(TASK))
