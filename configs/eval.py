r"""Evaluation: a policy on the test split of one or many environments, with honest accounting.

    python -m agentgym_jax.launch --config=configs/eval.py --config.policy=checkpoint:runs/quickstart

`policy`: "oracle", "checkpoint:<RL workdir>" (as `mode=rl` leaves it: checkpoints/, tokenizer/,
config.json) or "hf:<Hugging Face folder>". `envs`: a comma list; one local server per
environment is started unless `env.urls` gives `name=url` pairs. Writes to `out_dir`:
trajectories.jsonl, summary.json, summary.md, success_by_env.png, success_vs_turns.png
(definitions: docs/evaluation.md). Last line: `summary: envs=... scheduled=... success=...
conditional_success=... infra_rate=... out_dir=...`. The oracle on 64 Maze test tasks takes
well under a minute on a 2-core CPU. Re-running the same command resumes.
"""

import ml_collections


def get_config(arg: str = "") -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()
    config.mode = "eval"
    config.seed = 0
    config.envs = "maze"  # comma list
    config.policy = "oracle"  # or "checkpoint:<RL workdir>" or "hf:<folder>"
    config.checkpoint_step = -1  # -1: the latest checkpoint
    config.split = "test"  # "" for every task id
    config.task_ids = "64"  # "" the whole split, "N" its first N, "a:b" ids a <= id < b
    config.group_size = 1  # pass@k needs k <= group_size
    config.temperature = 0.0  # greedy; with group_size > 1 use e.g. 1.0
    config.horizon = 12  # policy turns per episode
    config.max_attempts = 2  # an infra_error episode is played again, as attempt 1, ...
    config.batch_episodes = 64  # episodes played (and written) together
    config.out_dir = "runs/eval"
    config.perturbations = ""  # "noise=0.05;tool_failure=0.2": clean + each setting, and the gap (docs/evaluation.md)

    config.env = ml_collections.ConfigDict()
    config.env.urls = ""  # "maze=http://host:port,room=http://..."; empty: local servers
    config.env.num_servers = 1  # local servers per environment
    config.env.max_concurrency = 64
    config.env.max_sessions = 0  # live sessions (episodes) per server a pool holds at once; 0: the server's own cap (/health)
    config.env.request_timeout_s = 30.0
    config.env.episode_timeout_s = 600.0
    config.env.auth_token = ""  # sent as `Authorization: Bearer <token>` (servers run with --auth_token); local servers require it too
    config.env.perturbation = ""  # local servers started with --perturbation=<this> (docs/tools.md); set per setting by `perturbations`
    # An agent program plays each episode through an in-process gateway over `policy` (docs/agents.md):
    # "<module>:<function>" or a command line; "": the rollout engine plays the policy itself.
    config.env.agent = ""
    config.env.agent_workers = "threads"  # threads | processes
    config.env.agent_timeout_s = 600.0  # an episode still running then ends infra_error
    config.env.agent_kwargs = ""  # a JSON object of more keyword arguments for the agent
    config.env.agent_reward_range = (-1.0, 1.0)  # a reward outside it is refused (the episode ends infra_error)

    config.tokenizer = ml_collections.ConfigDict()
    config.tokenizer.dir = ""  # empty: the policy's own (oracle: one built from env text in out_dir)
    config.tokenizer.vocab_size = 1024
    config.tokenizer.template = "chatml"

    config.model = ml_collections.ConfigDict()
    config.model.hf_dir = ""  # set by policy="hf:<folder>"
    config.model.param_dtype = "float32"
    config.model.compute_dtype = "float32"
    config.model.attention_kernel = "auto"  # as in configs/quickstart.py: Pallas kernels where written for, else xla
    config.model.decode_kernel = "auto"
    # A mixture of experts (qwen3_moe, qwen2_moe; docs/models.md): its dispatch, auto: grouped matmuls
    # (ragged_dot) on accelerators, every expert on every token (dense) on the CPU; or ragged | dense.
    config.model.moe_dispatch = "auto"

    config.mesh = ml_collections.ConfigDict(dict(data=1, fsdp=-1, tensor=1))

    config.rollout = ml_collections.ConfigDict()
    config.rollout.max_tokens_per_turn = 16  # as in configs/quickstart.py; 512 for real models
    config.rollout.max_response_length = 1536
    config.rollout.max_cache_len = 2048
    config.rollout.invalid_action_limit = 0  # 0: off
    config.rollout.top_k = 0
    config.rollout.top_p = 1.0
    config.rollout.action_format = "Action: {action}"  # how the oracle's actions are phrased
    config.rollout.straggler_wait_s = 0.05  # sample for arrived episodes after this wait
    config.rollout.lock_step = False  # True: every turn waits for all episodes (reproducible sampling)
    config.rollout.num_slots = 0  # as in configs/quickstart.py: 0 turn-batched, > 0 continuous batching over that many rows
    config.rollout.decode_chunk = 8  # slots: decode steps between refills
    config.rollout.fill_tokens = 8192  # tokens one sampler fill (prompts, observations) computes at most: bounds its memory
    config.rollout.tool_calls = False  # function calling: tools in the prompt, replies read as calls (docs/tools.md)
    return config
