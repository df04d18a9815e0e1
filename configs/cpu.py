r"""CPU recipes for the seed environments: the quickstart's SFT warm start, GRPO and ScalingInter-RL
with per-environment numbers (what each number is and why, beside it).

    python -m agentgym_jax.launch --config=configs/maze_cpu.py          # or textcraft_cpu, babyai_cpu, wordle_cpu
    python -m agentgym_jax.launch --config=configs/cpu.py:maze          # the same
    python -m agentgym_jax.launch --config=configs/maze_cpu.py --config.horizon.schedule=fixed   # the baseline

Only what an environment needs differs from `configs/quickstart.py`: the horizon schedule starts
where the oracle's demonstrations end (a first stage shorter than the median demonstration gives
groups of all-zero rewards, so no signal), turns long enough for the environment's actions, an
episode budget for its observations, and SFT sized to start RL from a weak but non-zero policy.
Rewards and success are the environment's own (no shaping). Groups whose rewards are all equal
carry no GRPO signal and are left out (DAPO's dynamic sampling; the shortfall is logged).
Results, commands and seeds: docs/experiments.md.
"""

import ml_collections

from configs import quickstart

# Oracle demonstrations measured on the first 60 training tasks (turns median / max): maze 9 / 27,
# textcraft 2 / 4, babyai 11.5 / 40 (47 of 60 within 40 turns), wordle 4 / 5.
RECIPES = {
    "maze": dict(
        rounds=(10, 15, 20),  # starts at the demonstrations' median of 9 moves; the longest need 27
        max_tokens_per_turn=16,  # "Action: move up" and a short thought
        max_response_length=3072,  # 20 turns of a ~100-token wall description and an action
        sft_epochs=12,
    ),
    "textcraft": dict(
        rounds=(4, 6, 8),  # recipes of depth 1-3 take 2-4 crafts; later stages leave room for a wrong try
        max_tokens_per_turn=24,  # "Action: craft 4 oak planks using 1 oak log" in a 1024-token BPE
        max_response_length=1536,
        sft_epochs=6,
    ),
    "babyai": dict(
        rounds=(12, 18, 24),  # the median demonstration is 11.5 turns; 24 covers ~80% of them
        max_tokens_per_turn=16,  # "Action: go forward", "Action: pick up red ball 1"
        max_response_length=4096,  # each observation lists what the agent sees (~100 tokens)
        sft_epochs=6,
    ),
    "wordle": dict(
        rounds=(6,),  # Wordle's own limit of six guesses: nothing to schedule
        max_tokens_per_turn=16,  # a five-letter guess
        max_response_length=1024,  # six feedback lines
        sft_epochs=6,
    ),
}


def get_config(arg: str = "") -> ml_collections.ConfigDict:
    """`arg`: the environment, one of RECIPES."""
    if arg not in RECIPES:
        raise ValueError(f"configs/cpu.py needs an environment, e.g. configs/cpu.py:maze; valid: {', '.join(RECIPES)}")
    recipe = RECIPES[arg]
    config = quickstart.get_config()
    config.workdir = f"runs/{arg}_cpu"
    config.env.name = arg
    config.rollout.max_tokens_per_turn = recipe["max_tokens_per_turn"]
    config.rollout.max_response_length = recipe["max_response_length"]
    config.rollout.max_cache_len = 512 + recipe["max_response_length"]  # the prompt (instruction, first observation) + the episode
    config.horizon.rounds = recipe["rounds"]
    config.eval.horizon = recipe["rounds"][-1]  # held-out episodes get the final horizon
    config.eval.num_tasks = 64  # at least 50 held-out tasks (maze has 50: all of them)
    config.sft.epochs = recipe["sft_epochs"]
    config.algo.dynamic_sampling = True
    # Episodes end anywhere from a few turns to the horizon: 4 micro-batches of like lengths, each
    # run at the shortest of the batch's length, its half or its quarter that holds it (exact).
    config.algo.num_microbatches = 4
    config.algo.length_buckets = 3
    return config
