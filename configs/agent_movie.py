r"""Online RL over an agent program: `agents/openai_tools.py` (the `openai` package alone) plays
AgentGym's Movie tool environment over HTTP through the job's in-process gateway, which serves the
newest SmolLM2-135M-Instruct weights; GRPO trains on its conversations (docs/agents.md). `:engine`
is the same recipe trained through the rollout engine on the environment protocol
(`rollout.tool_calls=True`): the same prompts, the same SFT start and budget.

    python -m agentgym_jax.launch --config=configs/agent_movie.py                 # the agent program
    python -m agentgym_jax.launch --config=configs/agent_movie.py:engine          # the engine, tool_calls=True
    python -m agentgym_jax.launch --config=configs/agent_movie.py --config.env.agent=agents.langchain_tools:play

The comparison (3 seeds each, `--config.seed=<s> --config.workdir=runs/agent_movie_s<s>` and
`runs/engine_movie_s<s>`), paired task by task over the seeds:

    python -m agentgym_jax.eval.compare --a=runs/agent_movie_s0,runs/agent_movie_s1,runs/agent_movie_s2 \
        --b=runs/engine_movie_s0,runs/engine_movie_s1,runs/engine_movie_s2 --out=runs/agent_vs_engine

What it does, and why the numbers:
- SFT warm start on 32 oracle demonstrations (8 updates of 4) written as `<tool_call>` blocks (`sft.oracle=tool_call`),
  framed as function-calling episodes: SmolLM2's ChatML writes no tool list, so the tools go into
  the system turn as the one block the engine, the demonstrations and the gateway all write
  (`rollout/tool_use.tool_list_block`). The agent sends exactly that conversation, so the SFT
  start serves both paths.
- Movie's questions about one film's field (5 kinds, 117 training and 33 test tasks; configs/cpu.py):
  three calls each. Horizons 3 then 5; 6 RL steps of 2 tasks x 4 samples, one on-policy update each
  at Adam 1e-5 with a KL term to the SFT policy (configs/smollm.py has why), sampling at 0.7.
- Held-out success on all 33 test tasks before and after, sampled at 0.7 (greedy success of the
  SFT'd SmolLM2 does not move with RL: configs/smollm.py). The agent's own evaluation plays the
  agent; the engine's plays the environment protocol: the same conversations.
- Every episode starts with a ~1,370-id prompt (SmolLM2's tokenizer; 880 without the tool block)
  and runs to ~1,700 ids: the update, at ~100 positions/s on 2 cores (configs/smollm.py), is what
  costs. Measured on the 2-core AMD EPYC (docs/experiments.md): 55.4 minutes alone on one instance
  (SFT 14, each evaluation 12, RL 18), 93.4 on a slower one, at most 20.6 GB resident (the engine:
  44.3-72.4 minutes, 16.9 GB). Over seeds 0-2 held-out 0.657 -> 0.808 through the agent program
  (+0.152 [+0.061, +0.253], p = 0.004) and 0.657 -> 0.747 through the engine (+0.091, p = 0.035);
  the paths after RL +0.061 [-0.030, +0.162] apart (p = 0.31): no difference measured.
"""

import ml_collections

from configs import smollm


def get_config(arg: str = "") -> ml_collections.ConfigDict:
    """`arg`: "" (the agent program) or "engine" (the rollout engine on the same environment)."""
    if arg not in ("", "engine"):
        raise ValueError(f"configs/agent_movie.py takes '' or 'engine', got {arg!r}")
    config = smollm.get_config("textcraft")  # SmolLM2's model, optimizer and update settings
    config.workdir = "runs/engine_movie" if arg else "runs/agent_movie"
    config.env.name = "movie"
    config.env.tasks = "templates=movie_rating,movie_length,movie_budget,movie_mpaa,movie_genres"  # 117 train, 33 test
    config.curriculum.key, config.curriculum.max_grades = "", ()
    config.rollout.tool_calls = True
    config.rollout.action_format = "{action}"  # the oracle writes whole calls
    config.sft.oracle = "tool_call"
    config.sft.num_tasks = 32  # 8 updates of 4 (each ~1,500 positions a row at ~100 positions/s)
    config.sft.epochs = 1
    config.sft.batch_size = 4  # rows twice the SmolLM2 recipes' length: 8 of them ran out of 24 GB beside other jobs
    config.model.remat = "full"  # each layer keeps its input only: the backward pass over ~2,000-position rows fits
    config.rollout.max_tokens_per_turn = 48  # '<tool_call>\n{"name": "get_search_movie", "arguments": {...}}\n</tool_call>'
    config.rollout.max_response_length = 1024  # five calls and their JSON answers
    config.rollout.max_cache_len = 1536 + 1024  # the first prompt (instruction, tool block, observation: ~1,370 ids) + the episode
    config.rollout.batch_tasks = 2
    config.rollout.group_size = 4
    config.algo.num_microbatches = 2  # one group at a time: its 4 rows packed as one prefix tree (algo.shared_prefix,
    #   from configs/smollm.py), the ~1,370-id prompt once: ~2,700 positions
    config.horizon_schedule.horizons = (3, 5)
    config.train.steps = 6
    config.horizon_schedule.steps_per_stage = 3
    config.eval.horizon = 5
    config.eval.num_tasks = 33  # the whole test split of these kinds
    config.eval.temperature = 0.7
    if not arg:
        config.env.agent = "agents.openai_tools:play"
        config.env.agent_reward_range = (0.0, 1.0)
        config.env.agent_timeout_s = 1800.0  # a turn may wait behind an update on a CPU
    return config
