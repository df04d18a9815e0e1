r"""An OpenAI-compatible gateway: agents written against the OpenAI API play through the JAX
sampler, and every conversation is recorded token-exact for training (docs/gateway.md).

    python -m agentgym_jax.launch --config=configs/gateway.py --config.policy=pretrained:smollm2-135m-instruct
    python -m agentgym_jax.launch --config=configs/gateway.py --config.policy=checkpoint:runs/academia_cpu \
        --config.auth_token=secret --config.port=8000

`policy`: "checkpoint:<job folder>", "hf:<folder>", "hf:<org>/<name>" or "pretrained:<name>".
Prints `serving the gateway on http://127.0.0.1:<port>/v1` (the `base_url` of an OpenAI client)
and serves until Ctrl-C; rewarded conversations go to `<out_dir>/trajectories.jsonl`.
"""

import ml_collections


def get_config(arg: str = "") -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()
    config.mode = "gateway"
    config.seed = 0  # the sampling key: a conversation's n-th token of turn t folds (seed, conversation, t, n)
    config.policy = "pretrained:smollm2-135m-instruct"
    config.checkpoint_step = -1  # checkpoint: policies; -1 the latest
    config.policy_version = 0  # written into every trajectory (the RL step of these params)
    config.model_name = "policy"  # what requests name as `model`
    config.host = "127.0.0.1"  # loopback only; anything else should set auth_token
    config.port = 8000  # 0: a free port (printed)
    config.auth_token = ""  # when set, every request but /health needs `Authorization: Bearer <token>` (an OpenAI api_key)
    config.out_dir = "runs/gateway"
    config.max_conversations = 8  # sampler rows: conversations sampled at once; idle ones give theirs up
    config.max_queue = 256  # requests in flight beyond which the gateway answers 429
    config.idle_timeout_s = 900.0  # a conversation unused this long is dropped unrecorded
    config.temperature = 1.0  # the policy's sampling temperature (requests may repeat it, not change it)
    config.max_body_bytes = 4 * 2**20  # a larger request body is refused (413) before it is read
    config.warmup_tokens = 1024  # first prompts up to this long compile at start-up (/health: 503 until done); 0: none
    config.write_unrewarded = False  # at Ctrl-C, write open conversations to <out_dir>/unrewarded.jsonl (else counted only)

    config.tokenizer = ml_collections.ConfigDict()
    config.tokenizer.dir = ""  # empty: the policy's own
    config.tokenizer.vocab_size = 1024
    config.tokenizer.template = "chatml"

    config.model = ml_collections.ConfigDict()
    config.model.hf_dir = ""  # set from policy
    config.model.param_dtype = "float32"
    config.model.compute_dtype = "float32"
    config.model.attention_kernel = "auto"
    config.model.decode_kernel = "auto"
    # A mixture of experts (qwen3_moe, qwen2_moe; docs/models.md): its dispatch, auto: grouped matmuls
    # (ragged_dot) on accelerators, every expert on every token (dense) on the CPU; or ragged | dense.
    config.model.moe_dispatch = "auto"

    config.mesh = ml_collections.ConfigDict(dict(data=1, fsdp=-1, tensor=1))

    config.rollout = ml_collections.ConfigDict()
    config.rollout.max_tokens_per_turn = 512  # a request's max_tokens is capped here
    config.rollout.max_cache_len = 4096  # tokens a conversation may hold (a longer one is refused, 400)
    config.rollout.top_k = 0
    config.rollout.top_p = 1.0
    config.rollout.decode_chunk = 16  # decode steps between admitting new requests
    config.rollout.fill_tokens = 8192  # tokens one sampler fill (prompts, observations) computes at most: bounds its memory
    return config
