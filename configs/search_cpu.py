r"""The CPU quickstart's recipe on `search` (multi-turn BM25 retrieval), with turns long enough for queries.

    python -m agentgym_jax.launch --config=configs/search_cpu.py

Everything not set here is configs/quickstart.py's. The oracle's actions (`<search>...</search>`
or `<answer>...</answer>`) run 20-67 characters, which 16 tokens per turn cut; each search
returns ~400 (up to ~1,300) characters of documents, and a question takes the oracle 2-4 turns
(1-3 searches and the answer). The changes below fit that; fewer tasks than the quickstart keep
the run near 20 minutes on 2 CPU cores.
"""

import ml_collections

from configs import quickstart


def get_config(arg: str = "") -> ml_collections.ConfigDict:
    config = quickstart.get_config(arg)
    config.workdir = "runs/search_cpu"
    config.env.name = "search"
    config.rollout.max_tokens_per_turn = 64  # `Action: <search>query</search>`: at most ~75 characters
    # 4 turns of up to 64 policy tokens and 3 observations of up to ~400 tokens each.
    config.rollout.max_response_length = 2048
    config.rollout.max_cache_len = 2560  # the ~150-token instruction and question on top
    # The oracle needs at most 4 turns; up to 8 leaves room for searches that miss without
    # paying for the quickstart's 12-turn episodes (the environment stops at 10).
    config.horizon_schedule.horizons = (4, 6, 8)
    # A demonstration is 1-4 turns with the documents, so batches are ~3x longer than sql's
    # (SFT at 200 tasks measured ~22 s a batch on 2 loaded cores): fewer tasks keep the run near 20 minutes.
    config.sft.num_tasks = 64  # 4 batches of 16 per epoch
    config.rollout.batch_tasks = 4  # x group_size 8 = 32 episodes per RL step
    config.horizon_schedule.steps_per_stage = 3
    config.train.steps = 8  # 3 + 3 + 2 steps over the three horizons
    config.eval.num_tasks = 32  # the first 32 of the 230 test tasks
    config.eval.horizon = 8  # the last training horizon
    return config
