r"""DPO on preference pairs (a success and a failure of the same task) from collected trajectories.

    python -m agentgym_jax.launch --config=configs/dpo.py --config.init=runs/sft \
        --config.data.trajectories=runs/collect/trajectories.jsonl

`init` is a job folder (config.json, tokenizer/, checkpoints/; e.g. a mode=sft or mode=rl run)
whose policy is both the starting point and the frozen reference; `init_step=-1` takes its last
checkpoint. The trajectories must be token ids of that policy's tokenizer (mode=collect with
`policy=checkpoint:<init>` at a temperature > 0 gives several attempts per task).
Re-running the same command resumes.
"""

import ml_collections

from configs import quickstart


def get_config(arg: str = "") -> ml_collections.ConfigDict:
    config = quickstart.get_config(arg)
    config.mode = "dpo"
    config.workdir = "runs/dpo"
    del config.horizon_schedule, config.sft

    config.init = ""  # job folder of the starting policy; empty: model.hf_dir
    config.init_step = -1  # its checkpoint step; -1: the latest

    config.data = ml_collections.ConfigDict()
    config.data.trajectories = ""  # comma-separated trajectory JSONL files

    config.dpo = ml_collections.ConfigDict()
    config.dpo.beta = 0.1  # DPO's temperature on the implicit reward

    config.optim.lr = 1e-5
    config.train.steps = 100
    config.train.batch_size = 8  # pairs per update
    config.train.checkpoint_every = 25
    config.train.keep_checkpoints = 2
    return config
