"""llamarl.sim: sync, async and stream schedules simulated on a modelled cluster.

Answers before a cluster is rented: how to split devices between generation and training, what
asynchrony buys at a given scale, how long a weight sync takes. Pure Python (no torch): a roofline
of decoding and training on stated hardware (`hardware`, `models`, `generation`, `training`,
`weight_sync`, `memory`, `deployment`), a discrete-event engine (`events`) running the schedules
(`schedules`), and three uses: the paper's table explained (`paper`), a measured run re-priced in
other modes and rank counts (`measured_run`, `from_run`), a cluster plan (`plan`). The command line
is `cli` (`uv run tools/simulate.py --help`).
"""
