"""llamarl.sim: sync, async and stream schedules simulated on a modelled cluster.

Answers before a cluster is rented: how to split devices between generation and training, what
asynchrony buys at a given scale, how long a weight sync takes. Pure Python (no torch): a roofline
of decoding and training on stated hardware (`hardware`, `models`, `moe`, `generation`, `training`,
`weight_sync`, `memory`, `deployment`), a discrete-event engine (`events`) running the schedules
(`schedules`), and its uses: the paper's table under stated assumptions (`paper`), how far each
assumption moves it (`sweep`), the strongest synchronous baseline (`baselines`), other systems'
published speed-ups predicted out of sample (`others`), a measured run re-priced in other modes and
rank counts (`measured_run`, `from_run`) and a GPU's efficiencies fitted from a trace
(`gpu_calibration`), a cluster plan (`plan`) with failure recovery priced (`recovery`). The command
line is `cli` (`uv run tools/simulate.py --help`).
"""
