r"""TextCraft with GRPO and ScalingInter-RL, on AgentGym-RL's published hyperparameters.

    python -m agentgym_jax.launch --config=configs/textcraft_grpo.py \
        --config.model.hf_dir=/path/to/Qwen2.5-7B-Instruct --config.workdir=runs/textcraft_grpo

The config argument names the model-shape preset (`configs/models.py`, default qwen2.5-7b: its
shape and the mesh it is sized for), e.g. `--config=configs/textcraft_grpo.py:qwen2.5-1.5b`;
`bench/scale.py` compiles it at that shape without a checkpoint. See docs/scale.md.

AgentGym-RL (examples/train/ScalingInter-RL/textcraft_train.sh): GRPO, lr 1e-6, KL loss 0.001
(low_var_kl), n = 8 samples per task, 32 tasks per step, PPO mini-batches of 8 tasks, 2 inner
epochs, 512 tokens per turn, 10240 response tokens per episode, turns 10 -> 20 -> 30 every 100
steps, a checkpoint every 25 steps. Sized for an accelerator slice (set `mesh` to it); the
environment servers start locally unless `env.urls` names running ones.
"""

import ml_collections

from configs import models, quickstart


def get_config(arg: str = "") -> ml_collections.ConfigDict:
    return models.apply(settings(), arg or "qwen2.5-7b")


def settings() -> ml_collections.ConfigDict:
    """AgentGym-RL's TextCraft settings without a model preset (`babyai_scalinginter` changes
    them, then applies its preset)."""
    config = quickstart.get_config()
    config.workdir = "runs/textcraft_grpo"
    config.env.name = "textcraft"
    config.env.num_servers = 4
    config.env.max_concurrency = 256
    config.tokenizer.dir = ""  # empty: the tokenizer files of model.hf_dir
    config.model.hf_dir = ""  # required: a local Qwen2.5 folder (config.json, safetensors, tokenizer)
    config.model.param_dtype = "float32"  # master weights and AdamW moments
    config.model.compute_dtype = "bfloat16"  # matmuls; the reference policy is stored in it
    config.model.remat = "full"  # a layer keeps only its input: 8 rows x 10752 tokens fit 80 GB at 7B

    config.rollout.batch_tasks = 32  # data.train_batch_size
    config.rollout.group_size = 8  # rollout.n
    config.rollout.max_tokens_per_turn = 512  # rollout.max_tokens
    config.rollout.max_response_length = 10240  # data.max_response_length
    config.rollout.max_cache_len = 512 + 10240  # max_prompt_length + max_response_length
    config.rollout.temperature = 1.0

    config.horizon_schedule.kind = "stepwise"
    config.horizon_schedule.horizons = (10, 20, 30)
    config.horizon_schedule.steps_per_stage = 100

    config.algo.advantage = "grpo"
    config.algo.ppo_epochs = 2  # ppo_epochs (honoured here; AgentGym-RL ignores it)
    config.algo.num_minibatches = 4  # 32 tasks / ppo_mini_batch_size 8
    # algo.num_microbatches: set by the model preset (configs/models.py) from the rows per
    # micro-batch its devices hold: 64 rows (8 tasks x 8 samples) per mini-batch / 8 for 7B.
    config.algo.kl_coef = 0.001
    config.algo.kl_estimator = "low_var_kl"
    config.algo.kl_in_reward = False  # use_kl_loss=True
    # Plain rows: the ~500-token prompt is ~5% of a 10k-token episode here, and a micro-batch holds one
    # row per device (configs/models.py); a group packed as one prefix tree would put 8 rows on a device.
    config.algo.shared_prefix = False

    config.optim.lr = 1e-6
    config.optim.warmup_steps = 0
    config.optim.lr_schedule = "constant"
    config.optim.weight_decay = 0.01
    config.optim.grad_clip = 1.0
    config.optim.b1 = 0.9
    config.optim.b2 = 0.999

    config.sft.num_tasks = 0  # the instruct model starts RL directly
    config.train.steps = 300
    config.train.checkpoint_every = 25  # trainer.save_freq
    config.train.keep_checkpoints = 3
    config.eval.num_tasks = 109  # the whole TextCraft test split
    config.eval.horizon = 30
    return config
