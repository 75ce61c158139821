"""What each rank does during a job (SPMD: every rank runs the same controller logic).

side.py                 the lifecycle every rank shares: setup, the schedule, evaluations, checkpoints
trainer_side.py         ranks 0..N-1: the trainer and the first trainer rank's logging
generator_side.py       ranks N..N+G-1: a generator, its rewarder, its samples
reward_side.py          a reward model on ranks of its own (optional)
trainer_loop.py         take a batch -> train -> send weights
generator_loop.py       receive weights -> generate and score -> hand over a batch
schedule.py             the lock-step schedules as data, stream mode's admission rule and pause plan
stream mode's machines (no I/O of their own; tests run them in one process):
  trainer_intake.py     the trainer's intake: buffer, receiving threads, pauses, its checkpoint state
  generator_stream.py   a generator's requests, admitted -> sampled -> delivered, request after request
  stream_requests.py    a stream request's states (admitted, sampling, paused, made, delivered)
sampler.py in_flight.py reward_scoring.py   sampling a task's prompts, paused requests, model rewards
evaluation.py checkpoint.py faults.py       held-out accuracy, checkpoints, fault injection
rank_states.py legacy_checkpoints.py        each side's part of a checkpoint; older checkpoints read
channels/               what moves between ranks: rollouts, the stream buffer and its control, weights
"""
