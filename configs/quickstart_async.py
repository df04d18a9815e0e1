r"""The quickstart with asynchronous RL: the sampler plays the next step's episodes while the
trainer updates, one update behind at most (docs/algorithms.md, "Asynchronous RL").

    python -m agentgym_jax.launch --config=configs/quickstart_async.py

Asynchronous RL streams episodes through continuous batching (64 sampler rows) and corrects for
the older weights with decoupled PPO (the ratio against the trainer's weights, each token weighted
by their probability over the sampler's, tokens above `algo.is_cap` dropped). Held-out success
after RL against the synchronous quickstart, three seeds each: docs/experiments.md.
"""

from configs import quickstart


def get_config(arg: str = ""):
    del arg
    config = quickstart.get_config()
    config.rollout.max_staleness = 1
    config.rollout.lock_step = False  # overlap: True would alternate sampling and updating, reproducibly
    config.rollout.num_slots = 64
    config.algo.decoupled_ppo = True
    return config
