"""Plan a cluster before renting it: `uv run tools/simulate.py paper | from-run RUN | plan ...`.

- `paper`: the paper's 8B / 70B / 405B step times explained under stated assumptions.
- `from-run OUTPUT_DIR [--compare RUN ...]`: a measured run predicted in other modes and rank counts.
- `plan --model 8b --gpus 64`: the generator/trainer split and schedule to run, with step times.

The simulator itself is `llamarl.sim` (docs/simulator.md).
"""

from __future__ import annotations

import sys

from llamarl.sim.cli import main

if __name__ == "__main__":
    sys.exit(main())
