"""Sharding on 8 simulated CPU devices: sharded forward / loss gradient == single device, sharded loading."""

from __future__ import annotations

import functools
import os
import socket
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from agentgym_jax.models.config import ModelConfig
from agentgym_jax.models.decoder import forward, init_cache, init_params
from agentgym_jax.models.hf_checkpoint import load_pretrained, param_shapes, save_pretrained
from agentgym_jax.parallel.distributed import initialize_distributed, multi_process_reason
from agentgym_jax.parallel.mesh import make_mesh, mesh_shape
from agentgym_jax.parallel.partition import (
    batch_sharding,
    cache_shardings,
    param_shardings,
    sharded_init,
)

BATCH, SEQ = 8, 12


def token_loss(params, tokens, positions, loss_mask, *, config, remat=False, activation_sharding=None):
    """(mean next-token cross-entropy over `loss_mask` [batch, seq], logits): a minimal training loss."""
    logits, _ = forward(
        params, tokens, positions, config=config, remat=remat, activation_sharding=activation_sharding
    )
    logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
    mask = loss_mask[:, 1:]
    return jnp.sum(nll * mask) / jnp.sum(mask), logits


def batch(config: ModelConfig):
    rng = np.random.default_rng(0)
    lengths = rng.integers(3, SEQ + 1, BATCH)
    tokens = rng.integers(0, config.vocab_size, (BATCH, SEQ)).astype(np.int32)
    positions = np.where(np.arange(SEQ)[None] < lengths[:, None], np.arange(SEQ)[None], -1).astype(np.int32)
    return tokens, positions, (positions >= 0).astype(np.float32)


def assert_close(got, want, tol=1e-5):
    """Each leaf: max |got - want| <= tol * max |want|."""
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        g, w = np.asarray(g), np.asarray(w)
        assert np.max(np.abs(g - w)) <= tol * max(np.max(np.abs(w)), 1e-30)


# Qwen3 with attention biases and an untied head: every kind of parameter the rules know.
CONFIG = ModelConfig.small("qwen3", qkv_bias=True, o_bias=True, tie_word_embeddings=False)


@functools.cache
def single_device_reference():
    """(params, batch, loss, logits, grads) computed without sharding, once for all meshes."""
    params = init_params(CONFIG, jax.random.key(1))
    data = batch(CONFIG)
    (loss, logits), grads = jax.jit(jax.value_and_grad(functools.partial(token_loss, config=CONFIG), has_aux=True))(
        params, *data
    )
    return params, data, loss, logits, grads


@pytest.mark.parametrize("shape", [(8, 1, 1), (2, 2, 2), (1, 2, 4)])
def test_sharded_forward_and_gradient_match_single_device(shape):
    params, data, want_loss, want_logits, want_grads = single_device_reference()
    mesh = make_mesh(*shape)
    p_shard, b_shard = param_shardings(params, mesh), batch_sharding(mesh)
    loss_fn = functools.partial(token_loss, config=CONFIG, remat=True, activation_sharding=b_shard)
    (loss, logits), grads = jax.jit(
        jax.value_and_grad(loss_fn, has_aux=True),
        in_shardings=(p_shard, b_shard, b_shard, b_shard),
        out_shardings=((None, b_shard), p_shard),
    )(jax.device_put(params, p_shard), *data)
    assert_close(logits, want_logits)
    assert_close(loss, want_loss)
    assert_close(grads, want_grads)
    assert grads["layers"]["attn"]["q_proj"]["kernel"].sharding.spec == P(None, "fsdp", "tensor", None)
    assert logits.sharding.spec == P(("data", "fsdp"))


def test_partition_rules_shard_heads_and_replicate_what_does_not_divide():
    config = ModelConfig.small("qwen2", num_heads=4, num_kv_heads=2, vocab_size=250)
    shardings = param_shardings(param_shapes(config), make_mesh(1, 2, 4))
    specs = jax.tree.map(lambda s: tuple(s.spec), shardings)
    attn, mlp = specs["layers"]["attn"], specs["layers"]["mlp"]
    assert attn["q_proj"]["kernel"] == (None, "fsdp", "tensor", None)  # 4 query heads over tensor=4
    assert attn["k_proj"]["kernel"] == (None, "fsdp", None, None)  # 2 kv heads: replicated over tensor
    assert attn["q_proj"]["bias"] == (None, "tensor", None)
    assert attn["o_proj"]["kernel"] == (None, "tensor", None, "fsdp")
    assert mlp["gate_proj"]["kernel"] == (None, "fsdp", "tensor") and mlp["down_proj"]["kernel"] == (None, "tensor", "fsdp")
    assert specs["embed"]["embedding"] == (None, None)  # vocab 250 is not divisible by 2 * 4
    assert specs["lm_head"] == ("fsdp", None)
    assert specs["final_norm"]["scale"] == (None,)


def test_loading_straight_into_shardings(tmp_path):
    config = CONFIG
    params = init_params(config, jax.random.key(2))
    save_pretrained(params, config, tmp_path, max_shard_bytes=50_000)  # several files + index
    mesh = make_mesh(2, 2, 2)
    shardings = param_shardings(param_shapes(config), mesh)
    _, loaded = load_pretrained(tmp_path, shardings=shardings)
    for got, want, sharding in zip(jax.tree.leaves(loaded), jax.tree.leaves(params), jax.tree.leaves(shardings)):
        assert got.sharding == sharding
        for shard in got.addressable_shards:  # each device holds exactly its slice
            np.testing.assert_array_equal(np.asarray(shard.data), np.asarray(want)[shard.index])
    q = loaded["layers"]["attn"]["q_proj"]["kernel"]
    assert q.addressable_shards[0].data.shape == (2, 32, 2, 16)  # [L, hidden/fsdp, heads/tensor, head_dim]
    assert loaded["embed"]["embedding"].addressable_shards[0].data.shape == (64, 64)  # vocab over fsdp * tensor


def test_sharded_init_and_sharded_cache_continuation():
    config = CONFIG
    mesh = make_mesh(2, 2, 2)
    params = sharded_init(functools.partial(init_params, config), jax.random.key(3), mesh)
    jax.tree.map(np.testing.assert_array_equal, params, init_params(config, jax.random.key(3)))
    assert params["layers"]["mlp"]["up_proj"]["kernel"].sharding.spec == P(None, "fsdp", "tensor")

    tokens, positions, _ = batch(config)
    step = functools.partial(forward, config=config)
    cache = init_cache(config, BATCH, 16)
    c_shard = cache_shardings(cache, mesh)
    assert c_shard.k.spec == P(None, ("data", "fsdp"), "tensor", None, None)
    sharded_step = jax.jit(
        step, in_shardings=(param_shardings(params, mesh), batch_sharding(mesh), batch_sharding(mesh), c_shard),
        out_shardings=(batch_sharding(mesh), c_shard),
    )
    want, _ = jax.jit(step)(jax.device_get(params), tokens, positions)
    cache = jax.device_put(cache, c_shard)
    first, cache = sharded_step(params, tokens[:, :5], positions[:, :5], cache)
    second, cache = sharded_step(params, tokens[:, 5:10], positions[:, 5:10], cache)
    valid = positions[:, :10] >= 0  # padded queries give finite values that nobody reads
    assert_close(np.asarray(jnp.concatenate([first, second], 1))[valid], np.asarray(want)[:, :10][valid])


def test_mesh_shape_fills_and_checks_device_count():
    assert mesh_shape(2, -1, 2, 8) == (2, 2, 2)
    assert make_mesh(tensor=4).shape == {"data": 1, "fsdp": 2, "tensor": 4}
    with pytest.raises(ValueError, match=r"needs 6 devices, but there are 8"):
        make_mesh(1, 3, 2)
    with pytest.raises(ValueError, match="not divisible by 3"):
        make_mesh(3, -1, 1)
    with pytest.raises(ValueError, match="at most one -1"):
        make_mesh(-1, -1, 1)


@pytest.mark.parametrize(
    "env, multi",
    [
        ({}, False),
        ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "1"}, False),
        ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4"}, True),
        ({"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234"}, True),
        ({"OMPI_COMM_WORLD_SIZE": "2"}, True),
        ({"TPU_WORKER_HOSTNAMES": "localhost"}, False),
        ({"TPU_WORKER_HOSTNAMES": "t1-w-0,t1-w-1,t1-w-2,t1-w-3"}, True),
    ],
)
def test_multi_process_detection(env, multi):
    assert (multi_process_reason(env, tpu_workers=0) is not None) == multi


def test_initialize_distributed_is_a_no_op_on_one_host():
    assert initialize_distributed({}) is False
    assert jax.process_count() == 1


@pytest.mark.slow
def test_two_processes_join_one_job():
    """Two real CPU processes meet through JAX_COORDINATOR_ADDRESS and see each other's devices."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = textwrap.dedent("""
        import jax
        from agentgym_jax.parallel.distributed import initialize_distributed
        assert initialize_distributed()
        print(jax.process_index(), jax.process_count(), jax.device_count(), jax.local_device_count())
    """)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES="2")
    procs = [
        subprocess.Popen([sys.executable, "-c", script], env={**env, "JAX_PROCESS_ID": str(i)},
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for i in range(2)
    ]
    outputs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert sorted(out.split()[:4] for out, _ in outputs) == [["0", "2", "2", "1"], ["1", "2", "2", "1"]]
