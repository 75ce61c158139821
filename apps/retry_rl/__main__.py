"""`uv run apps/retry_rl --help`: multi-turn RL with feedback: one-digit sums, three tries (the CPU
multi-turn recipe, `--config recipes/retry_cpu.toml`; the task: `llamarl.control.tasks.retry`)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the apps' shared command line

if __name__ == "__main__":
    # Imported here, not above: every spawned process of the run (ranks, reward workers) imports this
    # file again as its parent's main module, and a reward worker needs none of llamarl's heavy imports.
    from rl_app import main

    sys.exit(main("retry"))
