r"""CPU recipes with a real pretrained policy: SmolLM2-135M-Instruct (`pretrained:smollm2-135m-instruct`,
built offline from its registry package on first use) learns a seed environment: SFT warm start on
oracle demonstrations, then GRPO with ScalingInter-RL, held-out success before and after.

    python -m agentgym_jax.launch --config=configs/textcraft_smollm.py     # or babyai_, maze_, wordle_smollm
    python -m agentgym_jax.launch --config=configs/smollm.py:textcraft     # the same

What differs from the random-init recipes (`configs/cpu.py`), and why:
- The policy is 30 layers and 135M parameters: on 2 cores a full update runs at ~100 token
  positions/s. Every layer trains: with only the top 6 (`model.trainable_layers`, 2.4x less CPU
  an update) SFT learned the action format but not the task (1 of 32 held-out TextCraft tasks after
  12 updates), with all 30 four updates solved 11 of 32 (docs/experiments.md). Float32 throughout (bfloat16 is no faster for SFT and scoring on this CPU and 6.6x slower to
  decode: `bench/precision.py`), log-probs a 128-position chunk at a time (the 49152-word
  vocabulary makes a 1024-position chunk a 1.6 GB logits block).
- Few RL steps: 4 tasks x 6 samples, one on-policy update each (ppo_epochs 1, one mini-batch,
  4 micro-batches of one group, its rows packed as one prefix tree) at Adam 1e-5 with a KL term to the SFT policy (0.05,
  low_var_kl). Without the KL term two updates at 1e-5 took held-out TextCraft from 3/8 to 1/8
  (run D); at 3e-6 with it six steps left the greedy policy as it was on 63 of 64 held-out tasks
  (run F); at 1e-5 with it training success rose 0.13 -> 0.63 and held-out invalid actions fell
  0.85 -> 0.54, held-out success level (run G). A warm RL step of 24 episodes of ~500 tokens
  took 8.7 minutes before each group's prompt was computed once (rollout and update), 3.7 now
  (bench/rl_step.py); in the 6-step recipe a step takes ~2.8 minutes, 42% of it compiling new
  shapes (docs/experiments.md), so few steps fit.
- TextCraft's RL draws depth-1 goals only (`curriculum.key=depth`): goals of every depth at
  horizons 4-6 gave all-failure groups, nothing to learn from (run C), and so did depth-2 goals
  after SFT (run F); depth-1 goals give mixed ones. BabyAI's stages draw the tasks the oracle
  finishes within the stage's horizon (`curriculum.key=oracle_turns`, environments/babyai/grades.py).
- SFT at 1e-4 for few updates (4 at 5e-5 on the top 6 layers left the model copying the prompt).
  What RL adds here is small so far. Greedy held-out success does not move after RL; sampled at 0.7
  (`eval.temperature`), TextCraft's RL adds +5 points over three seeds (p = 0.02), all on depth-1 goals.
  Three SFT epochs on 88 demonstrations start at 19/64 sampled, and GRPO adds nothing to that (run K).
  On BabyAI, SFT teaches the one-action shortcut ("go to red ball 1" with the ball in view) and no
  search: no held-out or training task of 2+ actions is solved often enough for GRPO to learn from
  (from a one-update start too: its one-action groups are already uniform wins). On Maze, SFT
  learns the moves' prior ("move down"), not the local rule; on Wordle no game is won after SFT,
  so no GRPO group is mixed.
- Sampling at temperature 0.7: at 1.0 the SFT'd model's turns were 94-99% invalid actions (no
  group had a mixed outcome); the RL trainer scores the same tempered distribution.
`configs/smollm.py:textcraft_replay` and `:babyai_replay` (REPLAY below) add the replayed-prefix
curriculum (issue #44): every depth or grade drawn, episodes started near the goal of the task's
oracle demonstration and moved back to its start as groups succeed.
Results, commands, seeds and minutes: docs/experiments.md.
"""

import ml_collections

from configs import cpu

RECIPES = {
    "textcraft": dict(
        horizons=(6, 8),  # depth-1 goals take 2-3 actions; the SFT'd policy needs room for wrong tries
        max_tokens_per_turn=24,  # "Action: craft 4 oak planks using 1 oak log" is ~15 SmolLM2 tokens
        max_response_length=768,  # 8 turns of ~30-token inventories and actions
        sft_tasks=32,  # 4 updates: 11 of 32 held-out tasks (run C)
        sft_epochs=1,
        steps=6,
        curriculum=("depth", (1,)),  # depth-1 goals: the SFT start solves no depth-2 goal, so those groups teach nothing
    ),
    "babyai": dict(
        horizons=(4, 6, 8),  # the oracle finishes 40% of training tasks in 4 actions, 48% in 8 (12 turns: 53%)
        max_tokens_per_turn=20,  # "Action: toggle and go through red door 1"
        max_response_length=768,  # 8 turns of a ~55-token view (90 at p90) and an action
        sft_tasks=96,  # ~45 demonstrations end within 8 turns: 6 updates
        sft_epochs=1,
        steps=12,
        curriculum=("oracle_turns", (4, 6, 8)),  # tasks the oracle finishes within the stage's horizon
    ),
    "maze": dict(
        horizons=(8, 12, 16),
        max_tokens_per_turn=12,  # "Action: move up"
        max_response_length=1024,  # 16 turns of a ~35-token wall description and an action
        sft_oracle="local",  # moves its observations explain (configs/cpu.py)
        sft_tasks=128,
        sft_epochs=2,
        steps=12,
    ),
    "wordle": dict(
        horizons=(6,),
        max_tokens_per_turn=12,  # "Action: crane"
        max_response_length=512,
        sft_tasks=128,
        sft_epochs=2,
        steps=12,
    ),
}


# Replayed-prefix curriculum variants (`configs/smollm.py:<env>_replay`; docs/algorithms.md, "Groups
# that carry signal"): every task drawn, each episode starting k turns into its task's oracle
# demonstration with k kept per grade and steered toward groups half successful (one turn before
# the goal at first, back to the start as groups succeed), tasks drawn toward that pass rate, and
# up to a second batch of groups played to replace those whose returns are all equal. Prepared for
# issue #44's runs, not yet measured: their results, minutes and what limits them go to
# docs/experiments.md.
REPLAY = {
    "textcraft": dict(
        replay_by="depth",  # depth-2 goals (61% of the test split) start one craft from done, then further back
        steps=12,  # stages of 6 at horizons 6 and 8; a step ~2.5 minutes alone (run H), up to twice that with
        #   extra groups: with SFT and two evaluations (~11 minutes) about the 60-minute budget
        max_cache_len=512 + 512 + 768,  # the prompt, up to 7 replayed turns (~40 ids each plus an inventory), the episode
    ),
    "babyai": dict(
        replay_by="oracle_turns",  # tasks the oracle finishes in as many actions share a k
        steps=12,  # stages of 4 at horizons 4, 6 and 8 over every task (no difficulty stages); ~2.6 minutes a
        #   step alone (run C), up to twice that with extra groups
        max_cache_len=512 + 768 + 768,  # up to 7 replayed turns of a ~55-90-id view and an action
    ),
}


def get_config(arg: str = "") -> ml_collections.ConfigDict:
    """`arg`: the environment, one of RECIPES, or `<env>_replay`, one of REPLAY."""
    if arg.endswith("_replay") and arg.removesuffix("_replay") in REPLAY:
        return replay_config(arg.removesuffix("_replay"))
    if arg not in RECIPES:
        raise ValueError(f"configs/smollm.py needs an environment, e.g. configs/smollm.py:textcraft; valid: "
                         f"{', '.join([*RECIPES, *(f'{env}_replay' for env in REPLAY)])}")
    recipe = RECIPES[arg]
    config = cpu.get_config(arg)  # the environment's horizon, turn and budget numbers, then the overrides below
    config.workdir = f"runs/{arg}_smollm"
    config.model.hf_dir = "pretrained:smollm2-135m-instruct"
    config.tokenizer.dir = ""  # the model's own
    config.model.trainable_layers = 0  # all 30 (the top 6 cost 2.4x less CPU an update, and did not learn the task)
    config.model.param_dtype = "float32"
    config.model.compute_dtype = "float32"
    config.model.logprob_chunk = 128
    config.rollout.max_tokens_per_turn = recipe["max_tokens_per_turn"]
    config.rollout.max_response_length = recipe["max_response_length"]
    config.rollout.max_cache_len = 512 + recipe["max_response_length"]  # the instruction, first observation and the episode
    config.rollout.batch_tasks = 4
    config.rollout.group_size = 6
    config.rollout.temperature = 0.7
    config.horizon_schedule.horizons = recipe["horizons"]
    config.train.steps = recipe["steps"]
    config.horizon_schedule.steps_per_stage = recipe["steps"] // len(recipe["horizons"])
    config.eval.horizon = recipe["horizons"][-1]
    config.eval.num_tasks = 64
    config.sft.num_tasks = recipe["sft_tasks"]
    config.sft.epochs = recipe["sft_epochs"]
    config.sft.oracle = recipe.get("sft_oracle", "")
    config.sft.horizon = recipe["horizons"][-1]
    config.sft.batch_size = 8
    config.sft.lr = 1e-4
    if "curriculum" in recipe:
        config.curriculum.key, config.curriculum.max_grades = recipe["curriculum"]
        config.curriculum.steps_per_stage = config.horizon_schedule.steps_per_stage  # stages aligned with the horizon's
    config.optim.lr = 1e-5
    config.algo.kl_coef = 0.05
    config.algo.kl_estimator = "low_var_kl"
    config.algo.ppo_epochs = 1
    config.algo.num_minibatches = 1
    # One group of 6 rows a micro-batch, packed as one prefix tree (algo.shared_prefix): its ~430-token
    # prompt computed once, ~1,000-1,500 positions where 3 plain rows took up to 4,600 (they peaked at
    # ~17 GB with 6 rows a micro-batch, run E); the update 2.3-2.45x faster (bench/rl_step.py). SFT: 2 rows
    # a micro-batch.
    config.algo.shared_prefix = True
    config.algo.num_microbatches = 4
    config.algo.length_buckets = 4  # a group's tree of ~1,000-1,500 positions at width 1,536 runs at
    config.algo.length_spacing = "even"  # 1,152 or 1,536 (halvings: 1,536 for all)
    return config


def replay_config(env: str) -> ml_collections.ConfigDict:
    """The `env` recipe with the replayed-prefix curriculum, pass-rate-targeted tasks and refilled
    dynamic sampling (REPLAY)."""
    recipe = REPLAY[env]
    config = get_config(env)
    config.workdir = f"runs/{env}_smollm_replay"
    config.curriculum.key, config.curriculum.max_grades = "", ()  # every grade: the replay makes the hard ones reachable
    config.curriculum.replay = True
    config.curriculum.replay_by = recipe["replay_by"]
    config.curriculum.replay_start = 1.0
    config.curriculum.sampling = "pass_rate"
    config.algo.dynamic_sampling = True
    config.algo.max_extra_groups = config.rollout.batch_tasks
    config.rollout.max_cache_len = recipe["max_cache_len"]
    config.train.steps = recipe["steps"]
    config.horizon_schedule.steps_per_stage = recipe["steps"] // len(config.horizon_schedule.horizons)
    return config
