"""The policy trainer (`trainer.py`) and what it is made of: log-probs per micro-batch
(`policy_logprobs.py`), packed rows (`packing.py`, `varlen_attention.py`), FSDP2 (`parallel.py`), bf16
compute over fp32 masters (`mixed_precision.py`), compiled modules and learning-rate schedules."""
