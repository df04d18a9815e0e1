"""Advantages, losses, KL and horizon schedules: pure functions on arrays.

`advantages.py` (with the batch data layout every module shares), `losses.py`, `kl.py`,
`horizon.py`, and `masked.py` (the masked reductions they all use). Formulas and the differences
from AgentGym-RL: docs/algorithms.md.
"""
