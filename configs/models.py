r"""Model-shape presets: the released checkpoints' shapes, each with the mesh it is sized for.

A preset fills `config.model.*` (shape, vocabulary, tied head, RoPE base) and `config.mesh`, so a
config can name a model without a checkpoint: `bench/scale.py` compiles it at its real shape, and
`--config.model.*` overrides any field (e.g. `--config.model.num_layers=4` for a quick look).
With `model.hf_dir` set, the checkpoint's own config.json decides the shape instead. It also
sets what the memory of the devices it is sized for decides: the sampler's engine
(`rollout.num_slots`) and the rows per micro-batch (`algo.num_microbatches`, from the config's
batch), so `apply` comes last in a config's `get_config`.

    python bench/scale.py --config=configs/textcraft_grpo.py               # Qwen2.5-7B (the default)
    python bench/scale.py --config=configs/textcraft_grpo.py:qwen2.5-1.5b

The numbers are those of the checkpoints' config.json on the Hugging Face hub
(Qwen/Qwen2.5-7B-Instruct, Qwen/Qwen2.5-1.5B-Instruct, google/gemma-3-1b-it, google/gemma-3-4b-it's
text_config, Qwen/Qwen3-30B-A3B); `hf_config` holds a family's keys beyond the shape, read as
its config.json would be (`job.setup.model_config`).
"""

import ml_collections

PRESETS = {
    # 1.5B parameters, tied head: float32 weights, AdamW moments and gradients take ~25 GB, so
    # one 80 GB device holds a whole replica; more devices split the batch (pure data parallel).
    "qwen2.5-1.5b": dict(
        model=dict(
            family="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_layers=28,
            num_heads=12, num_kv_heads=2, head_dim=128, tie_word_embeddings=True, rope_theta=1e6,
            max_position_embeddings=32768,
        ),
        mesh=dict(data=-1, fsdp=1, tensor=1),
        # One device holds every episode's rows only through continuous batching: 16 sampler rows
        # (a 4.6 GiB KV cache at 10752 slots) whatever the number of episodes; 256 rows of 10752
        # slots would take 74 GiB. Micro-batches of 4 rows of 12288 tokens: the update peaks at
        # 54 GiB (8 rows: 74). bench/README.md has the table.
        rollout=dict(num_slots=16),
        microbatch_rows=4,
    ),
    # 7.6B parameters: ~122 GB of float32 weights, moments and gradients, so it is sized for 8
    # devices with everything sharded over fsdp (8 x 80 GB GPUs, or a TPU v5p-16's 8 chips).
    "qwen2.5-7b": dict(
        model=dict(
            family="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28,
            num_heads=28, num_kv_heads=4, head_dim=128, tie_word_embeddings=False, rope_theta=1e6,
            max_position_embeddings=32768,
        ),
        mesh=dict(data=1, fsdp=-1, tensor=1),
        rollout=dict(num_slots=0),  # every episode a sampler row: the KV cache, split 8 ways, fits
        microbatch_rows=8,  # one row per device of an 8-device mesh (a micro-batch needs one per batch shard)
    ),
}


PRESETS.update({
    # Gemma 3 1B (google/gemma-3-1b-it, text only): 1.0B parameters, a 262k vocabulary (a 1.2 GB
    # float32 embedding, tied), 5 local layers (window 512) per global one. One device holds a
    # replica (~16 GB of float32 weights, moments and gradients), as for Qwen2.5-1.5B.
    "gemma-3-1b": dict(
        model=dict(
            family="gemma3_text", vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_layers=26,
            num_heads=4, num_kv_heads=1, head_dim=256, tie_word_embeddings=True, rope_theta=1e6,
            max_position_embeddings=32768,
            hf_config=dict(query_pre_attn_scalar=256, sliding_window=512, sliding_window_pattern=6,
                           rope_local_base_freq=10000.0),
        ),
        mesh=dict(data=-1, fsdp=1, tensor=1),
        rollout=dict(num_slots=16),
        microbatch_rows=4,
    ),
    # Gemma 3 4B's language model (the text_config of google/gemma-3-4b-it, whose checkpoint also
    # holds a vision tower and is refused: models/families): 3.9B parameters, window 1024, global
    # RoPE 1M with linear scaling 8. Everything over fsdp on 8 devices; its KV cache per token is
    # 2.4x the 7B's (34 layers x 4 x 256) and every layer keeps all its slots (docs/models.md), so
    # 256 episodes of 10752 slots take 44.7 GiB a device and the append peaks at 89% of an H100
    # (bench/README.md): at the edge of its 90%, with room on an H200 or a v5p chip.
    "gemma-3-4b": dict(
        model=dict(
            family="gemma3_text", vocab_size=262208, hidden_size=2560, intermediate_size=10240, num_layers=34,
            num_heads=8, num_kv_heads=4, head_dim=256, tie_word_embeddings=True, rope_theta=1e6,
            max_position_embeddings=131072,
            hf_config=dict(query_pre_attn_scalar=256, sliding_window=1024, sliding_window_pattern=6,
                           rope_local_base_freq=10000.0, rope_scaling=dict(rope_type="linear", factor=8.0)),
        ),
        mesh=dict(data=1, fsdp=-1, tensor=1),
        rollout=dict(num_slots=0),
        microbatch_rows=8,
    ),
    # Qwen3-30B-A3B (Qwen/Qwen3-30B-A3B): 30.5B parameters, 3.3B active, 48 layers of 128 experts
    # (8 per token). Its float32 weights, moments and gradients alone are ~488 GB: 61 GB per device
    # of 8, the experts over fsdp (bench/README.md has what fits where).
    "qwen3-30b-a3b": dict(
        model=dict(
            family="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_layers=48,
            num_heads=32, num_kv_heads=4, head_dim=128, tie_word_embeddings=False, rope_theta=1e6,
            max_position_embeddings=40960,
            hf_config=dict(num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True),
        ),
        mesh=dict(data=1, fsdp=-1, tensor=1),
        rollout=dict(num_slots=0),
        microbatch_rows=8,
    ),
})


def apply(config: ml_collections.ConfigDict, name: str) -> ml_collections.ConfigDict:
    """`config` with the model shape, mesh, sampler engine and micro-batches of preset `name`
    (keys the preset adds are created): `algo.num_microbatches` splits each mini-batch of the
    config's `batch_tasks x group_size / num_minibatches` rows into micro-batches of the preset's
    `microbatch_rows`."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; valid: {', '.join(sorted(PRESETS))}")
    preset = PRESETS[name]
    rows = config.rollout.batch_tasks * config.rollout.group_size // config.algo.num_minibatches
    if rows % preset["microbatch_rows"]:
        raise ValueError(
            f"preset {name!r}: a mini-batch of {rows} rows does not split into micro-batches of "
            f"{preset['microbatch_rows']} rows; change rollout.batch_tasks, group_size or algo.num_minibatches"
        )
    with config.unlocked():
        config.model.preset = name  # what the shape is, for reports (bench/scale.py's summary)
        for key, value in preset["model"].items():
            config.model[key] = value
        config.mesh = ml_collections.ConfigDict(preset["mesh"])
        config.rollout.update(preset["rollout"])
        config.algo.num_microbatches = rows // preset["microbatch_rows"]
    return config
