"""The channels between executors (the paper's "communication channels"): what moves between ranks.

- `rollouts`: a batch of samples, generator rank -> first trainer rank -> the other trainer ranks, as
  tensors (never pickled objects).
- `buffer`: the first trainer rank's bounded, staleness-bounded rollout buffer (stream mode).
- `stream`: stream mode's sending side, receiving side, shared counters and pause server.
- `weights`: trainer -> generator weights through llamarl.comm (DDMA, shard to shard).
"""
