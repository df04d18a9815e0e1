"""Blockwise (flash) attention against a float64 NumPy softmax and the dense `grouped_attention`:
values and gradients, GQA, padding, positions that are not slot order, and tilings that pad."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentgym_jax.models.cache import attention_mask
from agentgym_jax.models.decoder import block_layout, flash_attention, grouped_attention

HEADS, KV_HEADS, DIM = 4, 2, 8


def numpy_attention(q, k, v, q_pos, k_pos):
    """float64 reference: q [b, t, h, d], k, v [b, kv, s, d]; visible iff 0 <= k_pos <= q_pos."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, t, h, d = q.shape
    group = h // k.shape[1]
    out = np.zeros((b, t, h, d))
    for row in range(b):
        for head in range(h):
            kh, vh = k[row, head // group], v[row, head // group]
            scores = q[row, :, head] @ kh.T / np.sqrt(d)  # [t, s]
            visible = (k_pos[row][None] >= 0) & (q_pos[row][:, None] >= 0) & (k_pos[row][None] <= q_pos[row][:, None])
            scores = np.where(visible, scores, -np.inf)
            for i in range(t):
                if visible[i].any():
                    p = np.exp(scores[i] - scores[i].max())
                    out[row, i, head] = (p / p.sum()) @ vh
    return out


def _inputs(batch, seq, keys, seed):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(batch, seq, HEADS, DIM)).astype(np.float32)
    k = rng.normal(size=(batch, KV_HEADS, keys, DIM)).astype(np.float32)
    v = rng.normal(size=(batch, KV_HEADS, keys, DIM)).astype(np.float32)
    return q, k, v


def _right_padded(batch, seq, lengths):
    positions = np.broadcast_to(np.arange(seq), (batch, seq))
    return np.where(positions < np.asarray(lengths)[:, None], positions, -1).astype(np.int32)


CASES = {
    # self-attention over right-padded rows, 5 x 5 tiles
    "self": dict(seq=20, keys=20, block=4, q_pos=lambda: _right_padded(3, 20, [20, 11, 4]), k_pos=None),
    # a chunk over a cache: keys at scattered slots (a shorter row's padding in between), empty slots -1
    "cache": dict(seq=6, keys=16, block=4, q_pos=lambda: np.array([[7, 8, 9, 10, -1, -1], [3, 4, 5, 6, 7, 8],
                                                                     [2, -1, -1, -1, -1, -1]], np.int32),
                  k_pos=lambda: np.array([[0, 1, 2, 3, -1, 4, 5, 6, 7, 8, 9, 10, -1, -1, -1, -1],
                                          [0, 1, 2, -1, -1, -1, 3, 4, 5, 6, 7, 8, -1, -1, -1, -1],
                                          [0, 1, -1, -1, -1, -1, 2, -1, -1, -1, -1, -1, -1, -1, -1, -1]], np.int32)),
    # lengths no tile size divides well: queries and keys padded up to whole tiles
    "padded tiles": dict(seq=13, keys=13, block=4, q_pos=lambda: _right_padded(3, 13, [13, 9, 1]), k_pos=None),
    # every row short: the last two query blocks are padding in every row (their outputs must stay finite)
    "short rows": dict(seq=20, keys=20, block=4, q_pos=lambda: _right_padded(3, 20, [11, 5, 2]), k_pos=None),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_flash_attention_matches_numpy_float64(case):
    c = CASES[case]
    q_pos = c["q_pos"]()
    k_pos = q_pos if c["k_pos"] is None else c["k_pos"]()
    q, k, v = _inputs(3, c["seq"], c["keys"], seed=0)
    got = np.asarray(jax.jit(flash_attention, static_argnames=("block_q", "block_k"))(
        q, k, v, q_pos, k_pos, block_q=c["block"], block_k=c["block"]))
    want = numpy_attention(q, k, v, q_pos, k_pos)
    assert np.isfinite(got).all()  # padded queries too
    real = q_pos >= 0
    np.testing.assert_allclose(got[real], want[real], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", sorted(CASES))
def test_flash_attention_gradients_match_dense_attention(case):
    """The custom backward against autodiff through the dense softmax, on a loss over real queries."""
    c = CASES[case]
    q_pos = c["q_pos"]()
    k_pos = q_pos if c["k_pos"] is None else c["k_pos"]()
    q, k, v = _inputs(3, c["seq"], c["keys"], seed=1)
    weights = np.random.default_rng(2).normal(size=q.shape).astype(np.float32) * (q_pos >= 0)[..., None, None]

    def flash_loss(q, k, v):
        return jnp.sum(weights * flash_attention(q, k, v, q_pos, k_pos, block_q=c["block"], block_k=c["block"]))

    def dense_loss(q, k, v):
        return jnp.sum(weights * grouped_attention(q, ((k, v, attention_mask(q_pos, k_pos)),)))

    got = jax.jit(jax.value_and_grad(flash_loss, argnums=(0, 1, 2)))(q, k, v)
    want = jax.jit(jax.value_and_grad(dense_loss, argnums=(0, 1, 2)))(q, k, v)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    for g, w, name in zip(got[1], want[1], "qkv"):
        scale = np.max(np.abs(w))
        assert np.max(np.abs(np.asarray(g) - np.asarray(w))) <= 1e-5 * scale, name


@pytest.mark.parametrize("block", [8, 32])  # several tiles, one tile
def test_flash_attention_in_bfloat16_stays_close_and_finite(block):
    """Values and gradients in bfloat16 (float32 accumulation) near the float32 ones."""
    q_pos = _right_padded(2, 32, [32, 7])
    q, k, v = _inputs(2, 32, 32, seed=3)
    weights = (q_pos >= 0)[..., None, None].astype(np.float32)

    def loss(q, k, v):
        out = flash_attention(q, k, v, q_pos, q_pos, block_q=block, block_k=block)
        return jnp.sum(weights * out.astype(jnp.float32)), out

    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
    (_, got), got_grads = grad(*(jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)))
    (_, _), want_grads = grad(q, k, v)
    assert got.dtype == jnp.bfloat16
    got = np.asarray(got, np.float32)
    assert np.isfinite(got).all()
    real = q_pos >= 0
    np.testing.assert_allclose(got[real], numpy_attention(q, k, v, q_pos, q_pos)[real], atol=3e-2)
    for g, w in zip(got_grads, want_grads):
        assert g.dtype == jnp.bfloat16
        np.testing.assert_allclose(np.asarray(g, np.float32), w, atol=5e-2 * np.max(np.abs(w)))


@pytest.mark.parametrize(
    "length, preferred, want",
    [(300, 512, (300, 300)), (768, 512, (256, 768)), (12288, 512, (512, 12288)), (10752, 512, (512, 10752)),
     (1000, 512, (512, 1024)), (13, 4, (4, 16))],
)
def test_block_layout_avoids_padding_where_a_large_divisor_exists(length, preferred, want):
    assert block_layout(length, preferred) == want


def test_block_layout_refuses_a_non_positive_block():
    with pytest.raises(ValueError, match="block size must be >= 1, got 0"):
        block_layout(8, 0)
