"""Advantages, losses, KL, horizon schedules and curricula: pure functions on arrays.

`advantages.py` (with the batch data layout every module shares), `losses.py`, `kl.py`,
`horizon.py`, `curriculum.py` and `pass_rate.py` (which tasks a step draws and where their
episodes start), and `masked.py` (the masked reductions they all use). Formulas and the
differences from AgentGym-RL: docs/algorithms.md.
"""
