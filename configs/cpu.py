r"""CPU recipes for the seed environments (and TextArena's Guess The Number): the quickstart's SFT
warm start, GRPO and ScalingInter-RL with per-environment numbers (what each number is and why,
beside it).

    python -m agentgym_jax.launch --config=configs/maze_cpu.py          # or textcraft_cpu, babyai_cpu, wordle_cpu, guess_the_number_cpu, movie_cpu
    python -m agentgym_jax.launch --config=configs/cpu.py:maze          # the same
    python -m agentgym_jax.launch --config=configs/maze_cpu.py --config.horizon_schedule.kind=fixed   # the baseline
    python -m agentgym_jax.launch --config=configs/maze_cpu.py --config.env.reward_shaping=progress  # opt-in shaping

Only what an environment needs differs from `configs/quickstart.py`: the horizon schedule starts
near where the oracle's demonstrations end (a first stage far shorter than the demonstrations gives
groups of all-zero rewards, so no signal), SFT on the demonstrations that fit the final horizon
(Maze: from an oracle whose moves its observations explain, and long enough to learn them),
turns long enough for the environment's actions, an episode budget for its observations, and a
run that fits 15 minutes of a 2-core CPU. Rewards and success are the environment's own; shaping
(`env.reward_shaping`, Maze and TextCraft: `progress`) is an explicit per-run option, off here.
Groups whose rewards are all equal carry no GRPO signal and are left out (DAPO's dynamic sampling;
the shortfall is logged). Results, commands, seeds and what limits each: docs/experiments.md.
"""

import ml_collections

from configs import quickstart

# Oracle demonstrations measured on the first 60 training tasks (turns median / max): maze 9 / 27,
# textcraft 2 / 4, babyai 2 / 40 with the oracle's high-level shortcut (40% of tasks in <= 4
# turns, 55% in <= 12), wordle 4 / 5.
RECIPES = {
    "maze": dict(
        horizons=(8, 12, 16),  # around the demonstrations' median of 9 moves; 16 holds ~80% of them
        max_tokens_per_turn=16,  # "Action: move up" and a short thought
        max_response_length=2560,  # 16 turns of a ~100-token wall description and an action
        # The shortest-path oracle's moves depend on walls no observation shows: cloned, they teach
        # "move up" on unseen layouts (held-out 6%). The `local` oracle moves towards the goal on
        # what the observation shows (52% of test tasks in 12 moves, 64% of training tasks in 16).
        sft_oracle="local",
        sft_tasks=250,  # every training task: the ~160 the local oracle solves within 16 moves train
        sft_epochs=24,  # 240 updates of 16, ~8 minutes: at 80 updates the move is still near chance (held-out
        #   8%), 240 start about where 400 did (8-18% over seeds 0-2, against 6-26%), 400 of 8 start at 2%
        #   and diverge in RL (docs/experiments.md); 400 of 16 (~13 minutes) leave RL no room in the budget
        steps=18,  # 64 episodes of up to 16 turns, the groups dynamic sampling leaves out not scored: ~10-25 s a step
    ),
    "textcraft": dict(
        horizons=(4, 6, 8),  # recipes of depth 1-3 take 2-4 crafts; later stages leave room for a wrong try
        max_tokens_per_turn=24,  # "Action: craft 4 oak planks using 1 oak log" in a 1024-token BPE
        max_response_length=1536,
        sft_tasks=200,
        sft_epochs=6,
        steps=18,  # ~600-token command lists make a step ~30 s: 18 fit the budget
    ),
    "babyai": dict(
        horizons=(4, 8, 12),  # 40% of tasks take <= 4 turns (a target in view: one high-level action)
        max_tokens_per_turn=20,  # "Action: toggle and go through red door 1"
        max_response_length=1536,  # each observation lists what the agent sees (~60-100 tokens)
        sft_tasks=400,  # about half fit 12 turns: ~225 demonstrations
        sft_epochs=4,
    ),
    "wordle": dict(
        horizons=(6,),  # Wordle's own limit of six guesses: nothing to schedule
        max_tokens_per_turn=16,  # a five-letter guess
        max_response_length=1024,  # six feedback lines
        sft_tasks=200,
        sft_epochs=6,
    ),
    # TextArena's Guess The Number (1-20, 10 turns) alone: the one game here whose rule (halve the
    # range the hints leave) reads off the feedback the same way for every hidden number, so what
    # RL learns on the training seeds carries to the held-out ones.
    "guess_the_number": dict(
        env="textarena",
        tasks="game=GuessTheNumber",  # its 80 training and 20 test seeds; the other games stay out
        horizons=(5, 8, 10),  # bisection needs <= 5 guesses; later stages leave room for a wrong one
        max_tokens_per_turn=16,  # "Action: [12]"
        max_response_length=512,  # ten one-line hints
        sft_tasks=80,  # every training seed
        sft_epochs=16,  # 80 updates: a start of 35-40% (8 epochs: 10-30%, more often garbled or repeated guesses);
        #   more would leave RL little to show, like the quickstart's deliberately weak start
        eval_tasks=20,  # the game's whole test split
    ),
    # AgentGym's Movie tool environment on ggplot2movies (docs/tools.md), its questions about one
    # film's field (rating, length, budget, MPAA rating, genres): three calls each (search the
    # title, details of the id found, finish with the field), every one a copy from the goal or
    # the last result. The policy writes AgentGym's `Action: <tool> with Action Input: {...}`.
    "movie": dict(
        tasks="templates=movie_rating,movie_length,movie_budget,movie_mpaa,movie_genres",  # 117 train, 33 test
        horizons=(3, 4, 5),  # the three calls, then room for a retried one
        max_tokens_per_turn=40,  # 'Action: get_search_movie with Action Input: {"movie_name": "..."}' in a 1024-token BPE
        max_response_length=1024,  # five calls and their JSON answers (a film's details: ~60 tokens)
        action_format="{action}",  # the oracle writes whole calls
        sft_tasks=117,  # every training task of these kinds
        sft_epochs=14,  # 112 updates of 16 (24 minutes of the run on a shared 2-core machine); at 60 updates on
        #   every kind of question (4 epochs of all 240 training tasks) the policy wrote broken calls
        steps=9,  # three per horizon; with 14 epochs the run fits ~35 minutes (docs/experiments.md)
    ),
}


def get_config(arg: str = "") -> ml_collections.ConfigDict:
    """`arg`: the recipe, one of RECIPES (an environment's name, or `guess_the_number`)."""
    if arg not in RECIPES:
        raise ValueError(f"configs/cpu.py needs an environment, e.g. configs/cpu.py:maze; valid: {', '.join(RECIPES)}")
    recipe = RECIPES[arg]
    config = quickstart.get_config()
    config.workdir = f"runs/{arg}_cpu"
    config.env.name = recipe.get("env", arg)
    config.env.tasks = recipe.get("tasks", "")
    config.rollout.max_tokens_per_turn = recipe["max_tokens_per_turn"]
    config.rollout.max_response_length = recipe["max_response_length"]
    config.rollout.max_cache_len = 512 + recipe["max_response_length"]  # the prompt (instruction, first observation) + the episode
    config.horizon_schedule.horizons = recipe["horizons"]
    config.train.steps = recipe.get("steps", config.train.steps)  # the quickstart's 24 unless the budget needs fewer
    config.horizon_schedule.steps_per_stage = config.train.steps // len(recipe["horizons"])  # equal stages
    config.eval.horizon = recipe["horizons"][-1]  # held-out episodes get the final horizon
    config.eval.num_tasks = recipe.get("eval_tasks", 64)  # at least 50 held-out tasks where there are (maze has 50: all of them)
    config.sft.num_tasks = recipe["sft_tasks"]
    config.sft.epochs = recipe["sft_epochs"]
    config.sft.oracle = recipe.get("sft_oracle", "")
    config.rollout.action_format = recipe.get("action_format", config.rollout.action_format)
    config.sft.horizon = recipe["horizons"][-1]  # a demonstration longer than the final horizon shows what RL cannot do
    config.algo.dynamic_sampling = True
    # Episodes end anywhere from a few turns to the horizon: 4 micro-batches of like lengths, each
    # run at the shortest of the batch's length, its half or its quarter that holds it (exact).
    config.algo.num_microbatches = 4
    config.algo.length_buckets = 3
    return config
