r"""A released model in the user's Hugging Face cache as the policy of a seed environment: Gemma 3
(google/gemma-3-1b-it) or the mixture of experts Qwen3-30B-A3B, GRPO with ScalingInter-RL on
AgentGym-RL's hyperparameters (configs/textcraft_grpo.py).

    python -m agentgym_jax.launch --config=configs/released.py:gemma-3-1b,textcraft
    python -m agentgym_jax.launch --config=configs/released.py:qwen3-30b-a3b,babyai      # 8 x 80 GB: bench/README.md
    python bench/scale.py --config=configs/released.py:qwen3-30b-a3b,textcraft --config.model.hf_dir=

The argument is `<model>,<environment>`. `model.hf_dir` names the checkpoint (`hf:<org>/<name>`:
the snapshot `refs/main` names in `$HF_HUB_CACHE`; nothing is downloaded) and its tokenizer and
chat template; with it empty, the preset of the same name (`configs/models.py`) stands for the
shape, which is how `bench/scale.py` compiles the job without the weights. The preset also sizes
the mesh, the sampler's engine and the micro-batches. TextCraft and BabyAI take AgentGym-RL's
horizons (10 -> 20 -> 30, 6 -> 13 -> 20); Maze and Wordle the CPU recipes' (`configs/cpu.py`).
Gemma 3's 4B and larger checkpoints hold a vision tower and are refused; their language model's
shape compiles as the preset `gemma-3-4b` (`bench/scale.py --config=configs/textcraft_grpo.py:gemma-3-4b`).
The router's load-balancing loss stays off (`model.router_aux_coef`), as in MoE RL recipes.
"""

import ml_collections

from configs import cpu, models, textcraft_grpo

MODELS = {"gemma-3-1b": "hf:google/gemma-3-1b-it", "qwen3-30b-a3b": "hf:Qwen/Qwen3-30B-A3B"}
# environment -> (horizons, tokens per turn, response tokens per episode, samples per task, held-out tasks)
ENVS = {
    "textcraft": ((10, 20, 30), 512, 10240, 8, 109),  # AgentGym-RL's textcraft_train.sh; the whole test split
    "babyai": ((6, 13, 20), 512, 8192, 4, 120),  # AgentGym-RL's babyai_train.sh
    "maze": (cpu.RECIPES["maze"]["horizons"], 64, cpu.RECIPES["maze"]["max_response_length"], 8, 50),
    "wordle": (cpu.RECIPES["wordle"]["horizons"], 64, cpu.RECIPES["wordle"]["max_response_length"], 8, 64),
}


def get_config(arg: str = "") -> ml_collections.ConfigDict:
    """`arg`: `<model>,<environment>`, a key of MODELS and one of ENVS."""
    model, _, env = arg.partition(",")
    if model not in MODELS or env not in ENVS:
        raise ValueError(f"configs/released.py needs <model>,<environment>, e.g. configs/released.py:gemma-3-1b,textcraft; "
                         f"models: {', '.join(MODELS)}; environments: {', '.join(ENVS)}")
    horizons, turn_tokens, response_tokens, group_size, eval_tasks = ENVS[env]
    config = textcraft_grpo.settings()
    config.workdir = f"runs/{env}_{model}"
    config.env.name = env
    config.model.hf_dir = MODELS[model]
    config.rollout.group_size = group_size
    config.rollout.max_tokens_per_turn = turn_tokens
    config.rollout.max_response_length = response_tokens
    config.rollout.max_cache_len = 512 + response_tokens
    config.horizon_schedule.horizons = horizons
    config.eval.horizon = horizons[-1]
    config.eval.num_tasks = eval_tasks
    return models.apply(config, model)
