"""Episodes over several turns: `environments.py` (what replies to a model turn), `tools.py` (functions a
model may call, in its chat template's format), `sandbox.py` (running untrusted code with limits),
`episodes.py` (the turns laid token-in/token-out as one completion for the trainer)."""
