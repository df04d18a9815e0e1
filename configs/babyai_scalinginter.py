r"""BabyAI with GRPO and ScalingInter-RL (turns 6 -> 13 -> 20), AgentGym-RL's hyperparameters.

    python -m agentgym_jax.launch --config=configs/babyai_scalinginter.py \
        --config.model.hf_dir=/path/to/Qwen2.5-7B-Instruct --config.workdir=runs/babyai_scalinginter

AgentGym-RL (examples/train/ScalingInter-RL/babyai_train.sh): as TextCraft but n = 4 samples per
task, 8192 response tokens per episode and horizons [6, 13, 20] (its `rounds`) every 100 steps.
"""

import ml_collections

from configs import models, textcraft_grpo


def get_config(arg: str = "") -> ml_collections.ConfigDict:
    config = textcraft_grpo.settings()  # arg: the model preset, as in textcraft_grpo
    config.workdir = "runs/babyai_scalinginter"
    config.env.name = "babyai"
    config.rollout.group_size = 4
    config.rollout.max_response_length = 8192
    config.rollout.max_cache_len = 512 + 8192
    config.horizon_schedule.horizons = (6, 13, 20)
    config.eval.num_tasks = 120  # the whole BabyAI test split
    config.eval.horizon = 20
    return models.apply(config, arg or "qwen2.5-7b")  # mini-batches of 32 rows (8 tasks x 4 samples)
