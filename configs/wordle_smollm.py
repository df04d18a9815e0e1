r"""The pretrained-policy recipe for wordle (configs/smollm.py has the numbers and why).

    python -m agentgym_jax.launch --config=configs/wordle_smollm.py
"""

from configs import smollm


def get_config(arg: str = ""):
    del arg
    return smollm.get_config("wordle")
