"""bench/scale.py on a tiny shape: the ahead-of-time path in process (its memory numbers checked
against the sharded arrays' own sizes) and the command line with `--run` on the CPU."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import re
import subprocess
import sys

import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from agentgym_jax.config import ConfigError
from agentgym_jax.job import setup
from agentgym_jax.models.config import ModelConfig, RopeConfig
from agentgym_jax.parallel.mesh import make_mesh
from configs import babyai_scalinginter, models, quickstart, textcraft_grpo

ROOT = pathlib.Path(__file__).resolve().parents[1]
# A 1-layer model, 8 episodes of at most 64 tokens: every step of the RL job, compiled in seconds.
TINY = dict(
    model=dict(num_layers=1, hidden_size=32, intermediate_size=64, num_heads=2, num_kv_heads=2, head_dim=16),
    rollout=dict(batch_tasks=1, group_size=8, max_tokens_per_turn=4, max_cache_len=64),
    algo=dict(ppo_epochs=1, num_minibatches=1, num_microbatches=1),
    tokenizer=dict(vocab_size=128),
)


@pytest.fixture(scope="module")
def scale():
    spec = importlib.util.spec_from_file_location("bench_scale", ROOT / "bench" / "scale.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tiny_config():
    config = quickstart.get_config()
    for group, values in TINY.items():
        config[group].update(values)
    return config


# The released checkpoints' config.json values (on the Hugging Face hub), written out here rather
# than read from configs/models.py.
QWEN = dict(family="qwen2", rms_norm_eps=1e-6, qkv_bias=True, o_bias=False, qk_norm=False, rope=RopeConfig(theta=1e6),
            max_position_embeddings=32768)
RELEASED = {
    "qwen2.5-1.5b": ModelConfig(**QWEN, vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_layers=28,
                                num_heads=12, num_kv_heads=2, head_dim=128, tie_word_embeddings=True),
    "qwen2.5-7b": ModelConfig(**QWEN, vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28,
                              num_heads=28, num_kv_heads=4, head_dim=128, tie_word_embeddings=False),
}
# google/gemma-3-1b-it and the text_config of google/gemma-3-4b-it: five local layers per global one.
GEMMA3 = dict(family="gemma3_text", rms_norm_eps=1e-6, qk_norm=True, hidden_act="gelu_pytorch_tanh", norm_plus_one=True,
              sandwich_norms=True, scale_embeddings=True, query_pre_attn_scalar=256, tie_word_embeddings=True,
              local_rope=RopeConfig(theta=1e4), head_dim=256)
RELEASED.update({
    "gemma-3-1b": ModelConfig(**GEMMA3, vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_layers=26,
                              num_heads=4, num_kv_heads=1, rope=RopeConfig(theta=1e6), max_position_embeddings=32768,
                              sliding_window=512, layer_types=tuple("sliding_attention" if (i + 1) % 6 else "full_attention"
                                                                    for i in range(26))),
    "gemma-3-4b": ModelConfig(**GEMMA3, vocab_size=262208, hidden_size=2560, intermediate_size=10240, num_layers=34,
                              num_heads=8, num_kv_heads=4, rope=RopeConfig(theta=1e6, type="linear", factor=8.0),
                              max_position_embeddings=131072, sliding_window=1024,
                              layer_types=tuple("sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(34))),
    # Qwen/Qwen3-30B-A3B
    "qwen3-30b-a3b": ModelConfig(family="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                                 num_layers=48, num_heads=32, num_kv_heads=4, head_dim=128, rms_norm_eps=1e-6,
                                 rope=RopeConfig(theta=1e6), max_position_embeddings=40960, qk_norm=True,
                                 num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True),
})


@pytest.mark.parametrize("preset", sorted(models.PRESETS))
@pytest.mark.parametrize("get_config", [textcraft_grpo.get_config, babyai_scalinginter.get_config])
def test_a_preset_is_the_job_model(scale, preset, get_config):
    """Every field a preset names reaches the job's ModelConfig (a tokenizer of 1024 ids does not
    shrink the vocabulary); bench/scale.py compiles the same model."""
    config = get_config(preset)
    assert setup.model_config(config, vocab_size=1024) == RELEASED[preset]
    assert scale.model_config(config) == RELEASED[preset]


def test_the_model_vocabulary_is_the_tokenizer_s_unless_the_config_names_one():
    config = quickstart.get_config()  # names no vocabulary, tied head, RoPE base or context
    model = setup.model_config(config, vocab_size=1031)
    assert (model.vocab_size, model.tie_word_embeddings, model.rope, model.max_position_embeddings) == (
        1031, False, RopeConfig(), 2048
    )
    with config.unlocked():
        config.model.vocab_size = 2048  # a padded table, as released checkpoints have
        config.model.rope_theta = 5e5
    model = setup.model_config(config, vocab_size=1031)
    assert (model.vocab_size, model.rope.theta) == (2048, 5e5)
    with pytest.raises(ConfigError, match=r"model.vocab_size=2048 is smaller than the tokenizer's 4000 ids"):
        setup.model_config(config, vocab_size=4000)


def test_a_preset_sets_the_engine_and_the_rows_per_micro_batch_its_devices_hold():
    for get_config, episodes in ((textcraft_grpo.get_config, 256), (babyai_scalinginter.get_config, 128)):
        small, large = get_config("qwen2.5-1.5b"), get_config("qwen2.5-7b")
        assert small.rollout.batch_tasks * small.rollout.group_size == episodes  # all of them, on one device too
        assert (small.rollout.num_slots, large.rollout.num_slots) == (16, 0)
        for config, rows in ((small, 4), (large, 8)):
            per_minibatch = episodes // config.algo.num_minibatches
            assert per_minibatch // config.algo.num_microbatches == rows
    config = quickstart.get_config()  # 8 tasks x 8 samples / 2 mini-batches = 32 rows
    assert models.apply(config, "qwen2.5-1.5b").algo.num_microbatches == 8
    config.rollout.batch_tasks = 3
    with pytest.raises(ValueError, match="a mini-batch of 12 rows does not split into micro-batches of 8 rows"):
        models.apply(config, "qwen2.5-7b")


@pytest.mark.slow
def test_compiled_memory_matches_the_sharded_arrays(scale):
    """XLA's per-device argument bytes are the shards' bytes; the KV cache and the batch split 8
    ways over fsdp; the update reuses the donated state's buffers."""
    config = tiny_config()
    model = scale.model_config(config)
    assert model.vocab_size == 128  # the tokenizer's size: quickstart names no vocabulary of its own
    mesh = make_mesh(1, 8, 1)
    _, steps, _, _ = scale.compile_steps(config, model, mesh, seq=64, chunk=16)
    by_name = {s.name: s for s in steps}
    assert list(by_name) == ["append", "decode", "prepare", "rl_update"]
    for step in steps:  # jit drops the arguments a step never reads (e.g. `scores` in the update)
        assert step.compiled.memory_analysis().argument_size_in_bytes <= scale.device_bytes(step.args)
    for name in ("append", "decode"):  # they read every argument
        assert by_name[name].compiled.memory_analysis().argument_size_in_bytes == scale.device_bytes(by_name[name].args)
    _, cache, logits, tokens, _ = by_name["append"].args
    assert cache.k.sharding.spec == P(None, ("data", "fsdp"), "tensor", None, None)
    full = 2 * 1 * 8 * 2 * 64 * 16 * 4  # k and v: [layers, rows, kv_heads, slots, head_dim] float32
    assert scale.device_bytes((cache.k, cache.v)) == full // 8
    state, rl_batch = by_name["rl_update"].args
    analysis = by_name["rl_update"].compiled.memory_analysis()
    assert analysis.alias_size_in_bytes >= scale.device_bytes(state.params) + scale.device_bytes(state.opt_state)
    assert scale.device_bytes(rl_batch.tokens) == 8 * 64 * 4 // 8
    assert scale.device_bytes(by_name["rl_update"].resident) == scale.device_bytes(by_name["prepare"].args[1])  # the reference
    config.rollout.fill_tokens = 8 * 16  # 8 rows x 16 tokens: a 32-token chunk is appended 16 tokens a row at a time
    append = scale.compile_steps(config, model, mesh, seq=64, chunk=32)[1][0]
    assert append.name == "append" and append.args[3].shape == (8, 16)


@pytest.mark.slow
def test_a_bfloat16_cache_takes_its_temp_from_the_float32_cache_twin(scale):
    """On the CPU a bfloat16 cache write is converted to float32 and back (no bfloat16 scatter):
    the as-compiled temp of the sampler's steps holds float32 copies of the stacked cache (more
    than the cache's own bytes on top), which the float32-cache twin's temp, the one the peak
    counts, does not."""
    config = tiny_config()
    config.model.compute_dtype = "bfloat16"
    config.model.num_layers = 2  # the writes go into the stacked cache of several layers
    config.rollout.max_cache_len = 2048  # the cache, not the tiny model, is what the temps hold
    model = scale.model_config(config)
    _, steps, _, _ = scale.compile_steps(config, model, make_mesh(1, 8, 1), seq=64, chunk=16, cpu_proxy=True)
    by_name = {s.name: s for s in steps}
    cache = by_name["append"].args[1]
    assert cache.k.dtype == jnp.bfloat16
    for name in ("append", "decode"):
        step = by_name[name]
        assert step.temp_from is not None
        own, twin = (c.memory_analysis().temp_size_in_bytes for c in (step.compiled, step.temp_from))
        assert own >= twin + scale.device_bytes((cache.k, cache.v))  # the conversions: more than the cache again
        gib = scale.peak_gib(step)
        assert gib["temp"] == twin / scale.GIB and gib["cpu_temp"] == own / scale.GIB
    assert by_name["prepare"].temp_from is None and by_name["rl_update"].temp_from is None
    _, plain, _, _ = scale.compile_steps(config, model, make_mesh(1, 8, 1), seq=64, chunk=16)
    assert all(step.temp_from is None for step in plain)  # on the accelerator itself: its own numbers


@pytest.mark.slow
def test_command_line_with_run_on_the_cpu():
    """`--run` allocates random weights, runs each step once and prints its time; the summary line."""
    overrides = [f"--config.{group}.{key}={value}" for group, values in TINY.items() for key, value in values.items()]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "bench/scale.py", "--config=configs/quickstart.py", "--num_devices=2", "--chunk=16", "--run", *overrides],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    measured = [line for line in lines if re.match(r"\| (append|decode|prepare|rl_update) \| [0-9.]+ \| n/a \|$", line)]
    assert len(measured) == 4, out.stdout
    summary = re.fullmatch(
        r"summary: config=quickstart model=L1-d32 seq=64 max_device_gib=([0-9.]+) fits_h100_80g=1", lines[-1]
    )
    assert summary and float(summary.group(1)) < 0.1, lines[-1]
    bad = subprocess.run(
        [sys.executable, "bench/scale.py", "--config=configs/quickstart.py", "--config.model.num_layer=2"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )
    assert bad.returncode != 0 and "unknown config key(s): 'model.num_layer'" in bad.stderr


@pytest.mark.slow
def test_with_slots_the_sampler_steps_are_compiled_at_the_slot_batch(scale):
    """`rollout.num_slots`: the cache holds the slots' rows, not the episodes'; a fill writes a
    chunk into every slot at once; the decode runs a chunk of `decode_chunk` steps."""
    config = tiny_config()
    config.rollout.batch_tasks = 4  # 32 episodes
    config.rollout.num_slots = 12  # bucketed to 16 rows on 8 shards
    model = scale.model_config(config)
    _, steps, _, _ = scale.compile_steps(config, model, make_mesh(1, 8, 1), seq=64, chunk=16)
    by_name = {s.name: s for s in steps}
    assert list(by_name) == ["fill", "decode_rows", "prepare", "rl_update"]
    slots, _, cache, logits, rows, fresh, tokens, lengths = by_name["fill"].args
    assert cache.k.shape == (1, 16, 2, 64, 16) and logits.shape == (16, 128) and slots == 64
    assert tokens.shape == (16, 16) and rows.shape == fresh.shape == lengths.shape == (16,)
    steps_arg, _, cache_len, *_, decoded = by_name["decode_rows"].args
    assert (steps_arg, cache_len, decoded.shape) == (config.rollout.decode_chunk, 64, (16,))  # every slot decoding
    for name in ("fill", "decode_rows"):
        assert by_name[name].compiled.memory_analysis().argument_size_in_bytes == scale.device_bytes(by_name[name].args)
    assert by_name["prepare"].args[2].tokens.shape == (32, 64)  # the update still trains on every episode
