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
(Qwen/Qwen2.5-7B-Instruct, Qwen/Qwen2.5-1.5B-Instruct).
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
