"""`uv run apps/calc_rl --help`: multi-turn RL with a tool: sums and products with a calculator
(the CPU multi-turn recipe, `--config recipes/calc_cpu.toml`; the task: `llamarl.control.tasks.calc`)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the apps' shared command line

if __name__ == "__main__":
    # Imported here, not above: every spawned process of the run (ranks, reward workers) imports this
    # file again as its parent's main module, and a reward worker needs none of llamarl's heavy imports.
    from rl_app import main

    sys.exit(main("calc"))
