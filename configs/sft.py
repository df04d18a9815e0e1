r"""Supervised fine-tuning on a weighted mix of environments (trajectory JSONL and/or AgentGym files).

    python -m agentgym_jax.launch --config=configs/sft.py \
        --config.data.agentgym=AgentTraj-L/webshop.json,AgentTraj-L/alfworld.json \
        --config.data.weights=webshop=2,alfworld=1 --config.model.hf_dir=/models/Llama-2-7b-chat

Each batch row picks an environment with probability w_e / sum(w) (empty weights: proportional
to each environment's row count); see agentgym_jax/train/sft_data.py for the exact rule. Without
`tokenizer.dir`/`model.hf_dir`, a tokenizer is built from the AgentGym files' text and a small
random model is trained (the CPU-sized default). Re-running the same command resumes.
"""

import ml_collections

from configs import quickstart


def get_config(arg: str = "") -> ml_collections.ConfigDict:
    config = quickstart.get_config(arg)
    config.mode = "sft"
    config.workdir = "runs/sft"
    del config.horizon_schedule, config.sft  # no RL; the `train` section below is the SFT schedule

    config.data = ml_collections.ConfigDict()
    config.data.trajectories = ""  # comma-separated trajectory JSONL files (mode=collect output)
    config.data.agentgym = ""  # comma-separated AgentGym conversation files (AgentTraj-L)
    config.data.weights = ""  # "env=w,env=w"; empty: proportional to each environment's rows
    config.data.include_failures = False  # also train on episodes that did not succeed

    config.optim.lr = 1e-3
    config.train.steps = 200
    config.train.batch_size = 16
    config.train.checkpoint_every = 50
    config.train.keep_checkpoints = 2

    config.eval.num_tasks = 0  # > 0: greedy evaluation on held-out tasks of env.name at the end
    return config
