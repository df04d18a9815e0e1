r"""CPU quickstart: SFT warm start on oracle demonstrations, then GRPO with the stepwise horizon.

    python -m agentgym_jax.launch --config=configs/quickstart.py

Runs on a 2-core CPU with no download: it starts a local `room` server, builds a byte-level BPE
tokenizer from environment text and a small Qwen2-style policy, clones oracle demonstrations of
training tasks (SFT), evaluates on held-out tasks, trains with GRPO while the allowed number of
turns grows (ScalingInter-RL), evaluates again on the same held-out tasks, and prints a
before/after table. Last line: `summary: env=... heldout_tasks=... success_before=...
success_after=... minutes=...`. The room pays partial credit for progress (success still means
reaching the goal), so GRPO learns from every group. Everything lands in `config.workdir` (checkpoints, metrics.jsonl,
TensorBoard events, trajectories, learning_curve.png); re-running the same command resumes.
"""

import ml_collections


def get_config(arg: str = "") -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()
    config.mode = "rl"
    config.seed = 0
    config.workdir = "runs/quickstart"

    config.env = ml_collections.ConfigDict()
    config.env.name = "room"
    config.env.urls = ""  # comma-separated servers; empty: start local servers for the run
    config.env.num_servers = 1
    config.env.max_concurrency = 64
    config.env.max_sessions = 0  # live sessions (episodes) per server a pool holds at once; 0: the server's own cap (/health)
    config.env.request_timeout_s = 30.0
    config.env.episode_timeout_s = 600.0
    config.env.auth_token = ""  # sent as `Authorization: Bearer <token>` (servers run with --auth_token); local servers require it too
    # Opt-in shaped rewards the servers pay (maze: "progress", potential-based partial credit); ""
    # the environment's own. Success is never changed; the report and summary line name it.
    config.env.reward_shaping = ""
    # Part of an environment: "<metadata key>=<value>[,...]" keeps, in the train and test splits,
    # the tasks whose per-task metadata matches (TextArena: "game=GuessTheNumber"); "": every task.
    config.env.tasks = ""
    # An agent program as the environment (docs/agents.md): "<module>:<function>" called as
    # fn(task, base_url, api_key, **kwargs) -> reward or {reward, success, status, metadata}, or a
    # command line; each episode plays through the job's in-process gateway. "": the rollout engine.
    config.env.agent = ""
    config.env.agent_workers = "threads"  # threads | processes (for agents that are not thread-safe)
    config.env.agent_timeout_s = 600.0  # an episode still running then ends infra_error (a process agent is killed)
    config.env.agent_kwargs = ""  # a JSON object of more keyword arguments for the agent
    config.env.agent_reward_range = (-1.0, 1.0)  # a reward outside it is refused (the episode ends infra_error)
    config.env.agent_conversations = 1  # training rows an episode may bring (its last conversations; more are dropped)

    config.tokenizer = ml_collections.ConfigDict()
    config.tokenizer.dir = ""  # a Hugging Face tokenizer folder; empty: build one in workdir
    config.tokenizer.vocab_size = 1024
    config.tokenizer.template = "chatml"

    config.model = ml_collections.ConfigDict()
    config.model.hf_dir = ""  # a Hugging Face model folder; empty: a random small model below
    config.model.family = "qwen2"
    config.model.num_layers = 2
    config.model.hidden_size = 128
    config.model.intermediate_size = 384
    config.model.num_heads = 4
    config.model.num_kv_heads = 2
    config.model.head_dim = 32
    config.model.param_dtype = "float32"
    config.model.compute_dtype = "float32"
    # What trains (models/tuning.py, docs/models.md): every parameter (both 0), LoRA adapters of rank
    # lora_rank on lora_targets (scaled by lora_alpha / lora_rank), and/or only the top trainable_layers
    # blocks (the backward pass stops below them). The frozen rest is held in compute_dtype.
    config.model.lora_rank = 0
    config.model.lora_alpha = 16.0
    config.model.lora_targets = "q,k,v,o,gate,up,down"
    config.model.trainable_layers = 0
    config.model.remat = "none"  # what a layer keeps for the backward: none (no remat) | full (its input) | dots
    config.model.logprob_chunk = 1024  # positions projected to the vocabulary at a time in the losses
    config.model.logprobs_at = "loss"  # the vocabulary projection only where the loss reads a log-prob | all (exact either way)
    # auto: the Pallas kernel where it is written for (splash attention on TPU for training rows, the
    # Triton ragged decode kernel on GPU for decode steps), the blockwise XLA path elsewhere; or xla.
    config.model.attention_kernel = "auto"
    config.model.decode_kernel = "auto"
    # A mixture of experts (qwen3_moe, qwen2_moe; docs/models.md): its dispatch, auto: grouped matmuls
    # (ragged_dot) on accelerators, every expert on every token (dense) on the CPU; or ragged | dense.
    config.model.moe_dispatch = "auto"
    config.model.router_aux_coef = 0.0  # the router's load-balancing loss weight in the losses; 0: off

    config.mesh = ml_collections.ConfigDict(dict(data=1, fsdp=-1, tensor=1))

    config.rollout = ml_collections.ConfigDict()
    config.rollout.batch_tasks = 8  # tasks per RL step (AgentGym-RL's train_batch_size)
    config.rollout.group_size = 8  # samples per task (AgentGym-RL's rollout.n)
    config.rollout.max_tokens_per_turn = 16  # AgentGym-RL's max_tokens (512 for real models)
    config.rollout.max_response_length = 1536  # policy + environment tokens per episode
    config.rollout.max_cache_len = 2048  # prompt + response; the sampler grows its cache up to it
    config.rollout.invalid_action_limit = 0  # 0: off
    config.rollout.temperature = 1.0
    config.rollout.top_k = 0
    config.rollout.top_p = 1.0
    config.rollout.action_format = "Action: {action}"  # how demonstrations phrase an action
    config.rollout.straggler_wait_s = 0.05  # sample for arrived episodes after this wait
    config.rollout.lock_step = True  # every turn waits for all episodes: reproducible, and on a local CPU server the wait is short
    # Continuous batching (docs/sampling.md): 0 keeps the turn-batched engine, every episode a sampler
    # row and each turn waiting for the batch: with turns of <= 16 tokens it wastes little. Measured
    # 2026-12-01 (3 RL steps, the same losses and rewards both ways): rollout 4.0-5.4 s per step
    # with 0, 17.9-53 s with 64 slots (two chunks and a fill call per turn, and new fill/decode
    # shapes still compiling at step 3); the short run took 3.5 vs 8.1 minutes. > 0 (e.g. 64): that
    # many rows over all episodes, refilled as episodes end; for long, ragged turns
    # (bench/rollout.py --workload=ragged).
    config.rollout.num_slots = 0
    config.rollout.decode_chunk = 8  # slots: decode steps between refills (shorter: rows idle less at turn ends)
    config.rollout.fill_tokens = 8192  # tokens one sampler fill (prompts, observations) computes at most: bounds its memory
    # Function calling (docs/tools.md): the tools in the prompt, replies read as calls, answers as tool
    # messages; for a tool environment's demonstrations set sft.oracle=tool_call and action_format={action}.
    config.rollout.tool_calls = False
    # A mixture of experts (docs/models.md): keep each policy token's experts (layers x top-k ids) in the
    # trajectories, so the update reports `routing_mismatch` (trainer vs sampler routing). Off: at
    # Qwen3-30B-A3B's 48 layers x 8 that is ~1.2 kB of JSON per policy token.
    config.rollout.record_experts = False
    # Asynchronous RL (docs/algorithms.md, "Asynchronous RL"): 0 samples every step's episodes with
    # the newest weights and then updates (synchronous). k > 0: the sampler keeps generating while the
    # trainer updates, with the newest weights it has (an episode in flight takes new weights as they
    # come), at most k updates behind; a group with a token older than that is dropped or resampled
    # (`stale_groups`). Needs continuous batching (`num_slots`) and an off-policy correction
    # (`algo.decoupled_ppo` or `algo.is_correction`). With `lock_step`, the stages alternate in a
    # fixed order (step s samples the episodes of step s + k, then updates on step s's): reproducible.
    config.rollout.max_staleness = 0
    config.rollout.stale_groups = "drop"  # drop | resample (the same task again, a new sample)
    # Where the sampler runs: 0 shares every device with the trainer (the two take turns); n > 0 gives
    # the last n devices of each process to the sampler and the others to the trainer (async RL),
    # the weights copied over after each update.
    config.rollout.sampler_devices = 0

    # The horizon (most turns an episode may take) as training goes on (rl/horizon.py).
    config.horizon_schedule = ml_collections.ConfigDict()
    config.horizon_schedule.kind = "stepwise"  # ScalingInter-RL: more turns allowed as training goes on; or fixed
    config.horizon_schedule.horizons = (4, 8, 12)  # one per stage (fixed: the last, throughout)
    config.horizon_schedule.steps_per_stage = 8

    # A curriculum over task difficulty (rl/curriculum.py), off here: stage k draws only training
    # tasks whose grade in the environment's task metadata is <= max_grades[k].
    config.curriculum = ml_collections.ConfigDict()
    config.curriculum.key = ""  # the grading list, e.g. textcraft's "depth"; "": every training task
    config.curriculum.max_grades = ()  # e.g. (1, 2, 4): depth-1 goals first, then up to 2, then all
    config.curriculum.steps_per_stage = 1  # steps per stage; the last stage lasts to the end
    # Pass-rate controls (rl/pass_rate.py, train/rl_signal.py; docs/algorithms.md "Groups that carry
    # signal"), off here: a GRPO group of binary rewards teaches most when about half of it succeeds.
    config.curriculum.target_pass_rate = 0.5  # the group success both controls below aim at
    # Which training tasks a step draws: uniform (seeded permutations) | pass_rate (weights peaked at the
    # target: tasks near it drawn more often, those always or never solved less, down to sampling_floor).
    config.curriculum.sampling = "uniform"
    config.curriculum.sampling_floor = 0.1  # pass_rate: a task solved always or never, against 1 at the target
    config.curriculum.pass_rate_memory = 0.5  # a task's pass rate keeps this much of its old value per new group
    # Replayed-prefix curriculum: an episode starts k turns into its task's oracle demonstration (the k
    # actions replayed into the real environment, their tokens in the prompt with loss_mask 0), the
    # policy plays on from there; k moves down a turn when a group succeeds above target + replay_band
    # and up one below target - replay_band, so it reaches 0 (training from the start) as success rises.
    # Held-out evaluation always starts at k = 0. Needs an environment oracle (sft.oracle, sft.horizon
    # and rollout.action_format say how it demonstrates) and synchronous rollout.
    config.curriculum.replay = False
    config.curriculum.replay_by = ""  # "": a k per task; a task-metadata grading (e.g. textcraft's "depth"): a k per grade
    config.curriculum.replay_start = 1.0  # a new task's k, as a fraction of its demonstration's turns before the last
    config.curriculum.replay_band = 0.25  # k moves once a group's success is beyond target +- this

    # Every key below is a field of train/steps.UpdateConfig or train/rl_batch.BatchFilter;
    # docs/algorithms.md has the formula and paper of each. A bad value is refused at start-up.
    config.algo = ml_collections.ConfigDict()
    config.algo.advantage = "grpo"  # grpo | dr_grpo | rloo | reinforce_plus_plus | gae | gigpo
    config.algo.advantage_epsilon = 0.0  # guard of the std divisor (grpo, reinforce_plus_plus, gigpo); 0: theirs (1e-6, 1e-8)
    config.algo.gamma = 1.0  # discount of reinforce_plus_plus, gae and gigpo's step returns (gigpo: 0.95, or a
    #   wasted turn in a successful episode returns what the move that followed it returns)
    config.algo.step_weight = 1.0  # gigpo: the weight of the step advantage beside the episode's
    config.algo.lam = 1.0  # GAE's lambda
    config.algo.discount = "token"  # gamma/lam applied per policy token, or per turn ("turn")
    config.algo.whiten = True  # GAE's advantages whitened over the batch (verl's default)
    config.algo.ppo_epochs = 2  # passes over each rollout batch
    config.algo.num_minibatches = 2  # optimizer updates per epoch
    config.algo.num_microbatches = 1  # gradient-accumulation chunks per mini-batch
    config.algo.length_buckets = 1  # > 1: micro-batches grouped by length, each run at the shortest of
    #   this many lengths (the batch's, its halvings) that holds it; exact, fewer padded positions
    config.algo.length_spacing = "halving"  # those lengths: the batch's and its halvings, or "even"ly spaced
    config.algo.shared_prefix = False  # True: each group's rows as one prefix tree, the prompt they share
    #   computed once, forward and backward (exact); mini- and micro-batches then count groups, not rows.
    #   Off for this 2-layer model's ~200-token episodes: its shortened run took 315 s packed, 235 s plain
    #   (more shapes to compile, longer packed rows); on for SmolLM2 (configs/smollm.py)
    config.algo.policy_loss = "ppo"  # ppo (per-token ratio) | gspo (per-sequence ratio)
    config.algo.clip_eps_low = 0.2  # ratio clipped to [1 - low, 1 + high]
    config.algo.clip_eps_high = 0.2  # DAPO's clip-higher: 0.28
    config.algo.dual_clip_c = 0.0  # dual-clip PPO's c (> 1, e.g. 3.0); 0: off
    config.algo.kl_coef = 0.001
    config.algo.kl_estimator = "low_var_kl"  # k1 | k2 | k3 | low_var_kl
    config.algo.kl_in_reward = False  # False: KL as a loss term (GRPO); True: a reward penalty
    config.algo.entropy_coef = 0.0
    config.algo.vf_coef = 0.5  # weight of the value loss (gae only)
    config.algo.clip_eps_value = 0.5  # value clip range around the rollout-time values (gae only)
    config.algo.critic = "shared"  # gae's value model: a head on the policy trunk, or "separate" (own params, optimizer)
    config.algo.critic_dir = ""  # the separate critic's Hugging Face folder; empty: a copy of the (warm-started) policy
    config.algo.critic_lr = 0.0  # the separate critic's learning rate; 0: optim.lr
    config.algo.agg_mode = "token-mean"  # token-mean | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm
    config.algo.loss_norm_length = 0  # seq-mean-token-sum-norm's constant (Dr. GRPO: the token budget); 0: unset
    config.algo.is_correction = "none"  # truncated importance sampling of trainer vs sampler: none | token | sequence
    config.algo.decoupled_ppo = False  # behaviour = sampler log-probs, proximal = recomputed old log-probs
    config.algo.is_cap = 2.0  # importance weights truncated at (TIS) or dropped above (decoupled) this
    config.algo.dynamic_sampling = False  # DAPO: leave out groups whose returns are all equal
    config.algo.max_extra_groups = 0  # with dynamic_sampling: draw and play up to this many more groups a step until
    #   every group of the batch has mixed returns (DAPO draws more batches; counted in metrics); 0: the batch as drawn
    config.algo.overlong = "off"  # token-budget-truncated episodes: off | mask | penalty (DAPO's soft punishment)
    config.algo.overlong_buffer = 256  # penalty ramps over the budget's last this-many tokens
    config.algo.overlong_penalty = 1.0  # the penalty at the token budget
    config.algo.turn_penalty = 0.0  # each policy turn costs this of the episode's return (success untouched)

    config.optim = ml_collections.ConfigDict()
    config.optim.lr = 2e-4
    config.optim.warmup_steps = 0  # counted in optimizer updates (RL: ppo_epochs x num_minibatches per step)
    config.optim.lr_schedule = "constant"
    config.optim.weight_decay = 0.0
    config.optim.grad_clip = 1.0
    config.optim.b1 = 0.9
    config.optim.b2 = 0.99

    config.sft = ml_collections.ConfigDict()
    config.sft.num_tasks = 200  # training tasks with an oracle demonstration
    config.sft.horizon = 100  # oracle episodes stop at this many turns; a longer demonstration is left out of SFT
    config.sft.oracle = ""  # which oracle demonstrates: "" the environment's own; or one it names (Maze: "local")
    config.sft.epochs = 6  # a weak start on purpose: 20 epochs reach ~86% held-out, leaving RL little to show
    config.sft.batch_size = 16
    config.sft.length_window = 8  # batches sorted by length within runs of 8, each padded to its own longest; 1: unsorted
    config.sft.lr = 3e-3

    config.train = ml_collections.ConfigDict()
    config.train.steps = 24
    config.train.checkpoint_every = 5
    config.train.keep_checkpoints = 2

    config.eval = ml_collections.ConfigDict()
    config.eval.num_tasks = 64  # held-out test tasks, evaluated before and after RL
    config.eval.horizon = 12
    config.eval.temperature = 0.0  # greedy
    # > 0: the same tasks also this many times each at rollout.temperature, before and after RL, on the
    # training sampler (report.json "sampled"; eval.compare's `:sampled_before` / `:sampled_after`)
    config.eval.sampled = 0
    return config
