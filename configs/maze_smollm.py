r"""The pretrained-policy recipe for maze (configs/smollm.py has the numbers and why).

    python -m agentgym_jax.launch --config=configs/maze_smollm.py
"""

from configs import smollm


def get_config(arg: str = ""):
    del arg
    return smollm.get_config("maze")
