r"""Collection: trajectories of the oracle or of a policy, as a token-exact JSONL dataset and in
AgentGym's conversation format.

    python -m agentgym_jax.launch --config=configs/collect.py --config.envs=textcraft --config.task_ids=0:500

`policy`: "oracle", "checkpoint:<RL workdir>" or "hf:<folder>" (as in configs/eval.py). Writes
`out_dir/trajectories.jsonl` batch by batch (progress bar) and `out_dir/agentgym.json` (item_id
like `maze_12`, conversations with from/value/loss). Interrupted? Run the same command again: it
plays only the (task, sample) pairs that have no record yet. Oracle demonstrations of the 200
Maze training tasks take about a minute on a 2-core CPU.
"""

import ml_collections

from configs import eval as eval_config


def get_config(arg: str = "") -> ml_collections.ConfigDict:
    config = eval_config.get_config(arg)
    config.mode = "collect"
    config.split = "train"
    config.task_ids = "200"
    config.horizon = 100  # the oracle needs room; a model policy: the turns it may take
    config.temperature = 1.0  # sampled, so that group_size > 1 differ
    config.max_attempts = 2
    config.only_successful = False  # True: keep successes only in agentgym.json, as AgentTraj does
    config.out_dir = "runs/collect"
    return config
