r"""The CPU recipe for TextArena's Guess The Number (configs/cpu.py has the numbers and why).

    python -m agentgym_jax.launch --config=configs/guess_the_number_cpu.py
"""

from configs import cpu


def get_config(arg: str = ""):
    del arg
    return cpu.get_config("guess_the_number")
