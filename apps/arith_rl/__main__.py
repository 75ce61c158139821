"""`uv run apps/arith_rl --help`: RL on one-digit sums with llamarl, the CPU learning recipe (README.md)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the apps' shared command line

from rl_app import main

if __name__ == "__main__":
    sys.exit(main("arith"))
