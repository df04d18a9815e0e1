r"""AgentGym's five tool environments played with function calling, clean and perturbed: a
policy's success, pass^k and the gap each perturbation opens (docs/tools.md, docs/evaluation.md).

    python -m agentgym_jax.launch --config=configs/tools_eval.py
    python -m agentgym_jax.launch --config=configs/tools_eval.py --config.policy=checkpoint:runs/movie_cpu \
        --config.envs=movie --config.rollout.tool_calls=False     # a text policy (AgentGym's `Action:` format)

Each environment's prompt carries its session's tools where the policy's chat template writes
them (`rollout.tool_calls`), replies are read as tool calls and results come back as tool
messages. The same 20 test tasks per environment, 4 samples each, are played against clean
servers and against each setting of `perturbations`; `out_dir/<setting>/` holds each run's
report, and `out_dir` the paired gap (last line: `summary: envs=... settings=... clean_success=...
largest_gap=... out_dir=...`).
"""

import ml_collections

from configs import eval as eval_config


def get_config(arg: str = "") -> ml_collections.ConfigDict:
    config = eval_config.get_config(arg)
    config.envs = "weather,movie,academia,todo,sheet"
    config.policy = "pretrained:smollm2-135m-instruct"
    config.task_ids = "20"  # the first 20 of each test split
    config.group_size = 4  # pass@k and pass^k for k = 1, 2, 4
    config.temperature = 1.0
    config.horizon = 12  # the oracle solves most tasks in 2-10 calls; the servers stop at 30
    config.out_dir = "runs/tools_eval"
    # One setting per kind of fault (environments/perturbation.py): noisy results, failing calls,
    # parameters renamed from the third turn, the last two tools unlisted until check_valid_actions.
    config.perturbations = "noise=0.05;tool_failure=0.2;schema_change=3;hidden_tools=2"
    config.rollout.tool_calls = True
    config.rollout.max_tokens_per_turn = 128  # a call with its arguments and a short thought
    config.rollout.max_response_length = 4096  # up to 12 calls and their JSON results
    config.rollout.max_cache_len = 6144  # the instruction and tools (~2k tokens) + the response
    return config
