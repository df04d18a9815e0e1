r"""The CPU recipe for movie, one of AgentGym's tool environments (configs/cpu.py has the numbers and why).

    python -m agentgym_jax.launch --config=configs/movie_cpu.py
"""

from configs import cpu


def get_config(arg: str = ""):
    del arg
    return cpu.get_config("movie")
