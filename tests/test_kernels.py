"""The Pallas attention kernels (`models.kernels`) against the decoder's XLA paths, which are the
reference: values and gradients, one device and sharded over 8, kernels interpreted on this CPU."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentgym_jax.config import ConfigError
from agentgym_jax.job import settings
from agentgym_jax.models.cache import attention_mask
from agentgym_jax.models.decoder import flash_attention, grouped_attention
from agentgym_jax.models.kernels import AttentionKernels, ragged_decode_attention, splash_attention
from agentgym_jax.parallel.mesh import BATCH_AXES, make_mesh

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16


def _qkv(rng, batch, seq, slots=None):
    q = rng.normal(size=(batch, seq, HEADS, HEAD_DIM))
    k, v = (rng.normal(size=(batch, KV_HEADS, slots or seq, HEAD_DIM)) for _ in range(2))
    return tuple(jnp.asarray(x, jnp.float32) for x in (q, k, v))


def _right_padded(lengths, seq):
    positions = np.arange(seq)[None].repeat(len(lengths), 0)
    return jnp.asarray(np.where(positions < np.asarray(lengths)[:, None], positions, -1), jnp.int32)


@pytest.mark.parametrize("seq, block, lengths", [(200, 512, [200, 131, 7, 0]), (300, 128, [300, 256, 129, 1])])
def test_splash_matches_flash_attention_in_values_and_gradients(seq, block, lengths):
    """One tile (seq padded to 256) and several (300 -> three tiles of 128); a fully padded row."""
    q, k, v = _qkv(np.random.default_rng(0), len(lengths), seq)
    positions = _right_padded(lengths, seq)
    real = (positions >= 0)[:, :, None, None]
    weights = jnp.asarray(np.random.default_rng(1).normal(size=q.shape), jnp.float32) * real

    def loss(attend, q, k, v):  # a weighted sum over the real queries only
        return jnp.sum(attend(q, k, v, positions) * weights)

    reference = lambda q, k, v, p: flash_attention(q, k, v, p, p, block_q=block, block_k=block)  # noqa: E731
    kernel = functools.partial(splash_attention, block=block, interpret=True)
    want, got = (np.asarray(f(q, k, v, positions)) for f in (reference, kernel))
    np.testing.assert_allclose(got * real, want * real, atol=1e-5, rtol=1e-5)
    grads = [jax.grad(functools.partial(loss, f), argnums=(0, 1, 2))(q, k, v) for f in (reference, kernel)]
    for want_g, got_g in zip(*grads):
        assert float(jnp.abs(want_g).max()) > 0.1  # the gradient is not trivially zero
        np.testing.assert_allclose(np.asarray(got_g), np.asarray(want_g), atol=1e-5, rtol=1e-5)


def _cache_after_write(rng, lengths, slots):
    """A cache whose row b holds lengths[b] real keys (slots past them stale: empty in the
    positions, garbage in the buffers), as the decode loop sees it after writing its key."""
    q, k, v = _qkv(rng, len(lengths), 1, slots)
    key_positions = _right_padded(lengths, slots)
    query_positions = jnp.asarray(np.asarray(lengths)[:, None] - 1, jnp.int32)
    return q, k, v, query_positions, key_positions


def test_ragged_decode_matches_the_positional_decode_step():
    lengths = np.array([1, 17, 64, 200, 256, 5])
    q, k, v, query_positions, key_positions = _cache_after_write(np.random.default_rng(2), lengths, 256)
    want = grouped_attention(q, ((k, v, attention_mask(query_positions, key_positions)),))
    got = ragged_decode_attention(q, k, v, jnp.asarray(lengths), interpret=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="multiple of 16 slots, got 40"):
        ragged_decode_attention(q, k[:, :, :40], v[:, :, :40], jnp.asarray(lengths), interpret=True)


@pytest.mark.parametrize("tensor", [1, 2])
def test_kernels_run_per_shard_and_match_one_device(tensor):
    """On 8 devices, rows over the batch axes and (tensor=2) heads over "tensor": each shard runs
    its own kernel on its rows and heads, and the result is the unsharded one."""
    mesh = make_mesh(data=1, fsdp=-1, tensor=tensor)
    rng = np.random.default_rng(3)
    batch = 8 // tensor
    q, k, v = _qkv(rng, batch, 130)
    positions = _right_padded(rng.integers(1, 131, batch), 130)
    sharded = dict(mesh=mesh, batch_axes=BATCH_AXES, interpret=True)
    want = splash_attention(q, k, v, positions, interpret=True)
    got = jax.jit(functools.partial(splash_attention, **sharded))(q, k, v, positions)
    assert got.sharding.shard_shape(got.shape) == (1, 130, HEADS // tensor, HEAD_DIM)  # a row and its heads per device
    real = np.asarray(positions >= 0)[:, :, None, None]
    np.testing.assert_allclose(np.asarray(got) * real, np.asarray(want) * real, atol=1e-6)

    lengths = jnp.asarray(rng.integers(1, 129, batch))
    q, k, v, _, _ = _cache_after_write(rng, np.asarray(lengths), 128)
    want = ragged_decode_attention(q, k, v, lengths, interpret=True)
    got = jax.jit(functools.partial(ragged_decode_attention, **sharded))(q, k, v, lengths)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6)


def test_auto_picks_each_kernel_on_its_backend_and_a_wrong_one_is_a_config_error():
    assert AttentionKernels.for_backend(backend="cpu") == AttentionKernels()
    # a mixture of experts: grouped matmuls on accelerators, every expert on every token on the CPU
    assert AttentionKernels.for_backend(backend="tpu") == AttentionKernels(training="splash", moe_dispatch="ragged")
    assert AttentionKernels.for_backend(backend="gpu") == AttentionKernels(decode="triton", moe_dispatch="ragged")
    assert AttentionKernels.for_backend("xla", "xla", backend="tpu", moe_dispatch="dense") == AttentionKernels()
    config = setup_config(attention_kernel="splash")
    with pytest.raises(ConfigError, match="config.model: training attention kernel 'splash' runs on tpu, not cpu"):
        settings.attention_kernels(config)
    with pytest.raises(ConfigError, match="decode attention kernel 'paged' is not one of xla, triton"):
        settings.attention_kernels(setup_config(decode_kernel="paged"))
    with pytest.raises(ConfigError, match="moe_dispatch 'sorted' is not one of dense, ragged"):
        settings.attention_kernels(setup_config(moe_dispatch="sorted"))


def setup_config(**model):
    from configs import quickstart

    config = quickstart.get_config()
    config.model.update(model)
    return config
