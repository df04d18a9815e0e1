"""The decoder-only transformer of the Llama / Qwen2 / Qwen3 families, as pure functions over a pytree.

Pre-norm blocks (RMSNorm → grouped-query attention with RoPE → residual, RMSNorm → SwiGLU MLP →
residual), stacked with `nn.scan` so compile time does not grow with depth. Attention is causal by
*position*, not by slot (see `cache.attention_mask`): the same code serves training (no cache,
right-padded rows) and multi-turn sampling (new chunks appended to a `KVCache`).

Parameter pytree (layer parameters carry a leading `[layers]` axis):
  embed/embedding [vocab, hidden]            lm_head [hidden, vocab] (absent when tied)
  layers/attn_norm/scale [L, hidden]          layers/mlp_norm/scale [L, hidden]
  layers/attn/{q,k,v}_proj/kernel [L, hidden, heads, head_dim] (+ bias [L, heads, head_dim])
  layers/attn/o_proj/kernel [L, heads, head_dim, hidden] (+ bias [L, hidden])
  layers/attn/{q,k}_norm/scale [L, head_dim] (Qwen3)
  layers/mlp/{gate,up}_proj/kernel [L, hidden, mlp]   layers/mlp/down_proj/kernel [L, mlp, hidden]
  final_norm/scale [hidden]                  value_head/{kernel [hidden], bias []} (optional)
Dtype policy: parameters are stored in `param_dtype` (float32 or bfloat16); matmuls run in the
compute `dtype`; norms, softmax and logits are computed in float32.
Memory policy: a chunk of more than one token attends blockwise (`flash_attention`: online
softmax over key blocks, never the whole [heads, seq, keys] score matrix, forward or backward;
on TPU, training rows by splash attention, see `models.kernels`);
`remat` picks what each layer keeps for the backward pass (`REMAT_POLICIES`).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from agentgym_jax.models.cache import KVCache, attention_mask, write_positions, write_rows
from agentgym_jax.models.config import ModelConfig, RopeConfig
from agentgym_jax.models.kernels import ATTENTION_BLOCK, AttentionKernels, ragged_decode_attention, splash_attention

Params = dict[str, Any]
_INIT = nn.initializers.normal(0.02)  # Hugging Face's initializer_range
_MASKED = float(np.finfo(np.float32).min)  # finite: a query with no visible key stays finite
# What a layer keeps for its backward pass: everything ("none": no remat), only its input, the
# residual stream ("full"), or also the outputs of its projections, i.e. dots without batch
# dimensions but not attention's batched score dots ("dots").
REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def remat_name(remat: str | bool) -> str:
    """The `REMAT_POLICIES` key of `remat`; a bool is the older flag (True: "full", False: "none")."""
    if isinstance(remat, bool):
        return "full" if remat else "none"
    if remat not in REMAT_POLICIES:
        raise ValueError(f"unknown remat policy {remat!r}; valid: {', '.join(REMAT_POLICIES)} (or a bool)")
    return remat


def block_layout(length: int, preferred: int) -> tuple[int, int]:
    """(block, padded length) to cut `length` positions into blocks of about `preferred`.

    One block when it fits; else the largest common divisor of the two if it is at least half
    of `preferred` (bucketed lengths such as 768 or 12288 need no padding); else blocks of
    `preferred` and the length padded up to their multiple.
    """
    if preferred < 1:
        raise ValueError(f"block size must be >= 1, got {preferred}")
    if length <= preferred:
        return length, length
    block = math.gcd(length, preferred)
    if 2 * block >= preferred:
        return block, length
    return preferred, -(-length // preferred) * preferred


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> np.ndarray:
    """[head_dim // 2] float32 inverse frequencies, with linear or Llama-3 context scaling."""
    inv_freq = 1.0 / (rope.theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    inv_freq = inv_freq.astype(np.float32)
    if rope.type == "linear":
        return inv_freq / np.float32(rope.factor)
    if rope.type == "llama3":
        # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
        old_len = rope.original_max_position_embeddings
        wavelen = 2 * np.pi / inv_freq
        slowed = np.where(wavelen > old_len / rope.low_freq_factor, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * slowed / rope.factor + smooth * slowed
        medium = (wavelen >= old_len / rope.high_freq_factor) & (wavelen <= old_len / rope.low_freq_factor)
        return np.where(medium, smoothed, slowed).astype(np.float32)
    return inv_freq


def rope_tables(positions: jax.Array, inv_freq: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """cos, sin [batch, seq, 1, head_dim] float32 for the rotate-half RoPE convention."""
    angles = positions[..., None].astype(jnp.float32) * inv_freq  # [batch, seq, head_dim // 2]
    angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotates x [batch, seq, heads, head_dim] by its positions' angles."""
    x1, x2 = jnp.split(x, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return x * cos.astype(x.dtype) + rotated * sin.astype(x.dtype)


def grouped_attention(
    q: jax.Array, segments: tuple[tuple[jax.Array, jax.Array, jax.Array], ...]
) -> jax.Array:
    """Softmax attention where each group of query heads shares one key/value head.

    q [batch, seq, heads, head_dim]; `segments` are (k, v [batch, kv_heads, keys_i, head_dim],
    mask [batch, seq, keys_i]) blocks of keys that one softmax spans, e.g. the cached keys and
    the chunk's own new ones: attending to each block where it lies is what spares a decode step
    from copying the cache to append its key first. Keys are head-major (the cache's layout), so
    the batched dots read them in place. Returns [batch, seq, heads, head_dim].
    """
    batch, seq, heads, head_dim = q.shape
    kv_heads = segments[0][0].shape[1]
    q = q.reshape(batch, seq, kv_heads, heads // kv_heads, head_dim)  # head h uses kv head h // group
    scores = [
        jnp.where(
            mask[:, None, None],
            jnp.einsum("btkgd,bksd->bkgts", q, k, preferred_element_type=jnp.float32) * head_dim**-0.5,
            _MASKED,
        )
        for k, _, mask in segments
    ]
    probs = jax.nn.softmax(jnp.concatenate(scores, axis=-1), axis=-1)  # [batch, kv, group, seq, keys]
    splits = np.cumsum([k.shape[2] for k, _, _ in segments])[:-1]
    out = sum(
        jnp.einsum("bkgts,bksd->btkgd", p.astype(v.dtype), v)
        for p, (_, v, _) in zip(jnp.split(probs, splits, axis=-1), segments)
    )
    return out.reshape(batch, seq, heads, head_dim)


def _block_mask(q_pos, k_pos, tree):
    """[batch, 1, 1, q_block, k_block] bool: which keys of a tile each query sees.

    Positions [batch, q_block] and [batch, k_block] give `cache.attention_mask`; `tree` (rows
    packed as prefix trees, see `flash_attention`) is (query indices [q_block], key indices
    [k_block], key ends [batch, k_block]) and keeps key j for query i only where j <= i < end[j].
    """
    mask = attention_mask(q_pos, k_pos)
    if tree is not None:
        q_idx, k_idx, k_end = tree
        mask &= (k_idx[None, None, :] <= q_idx[None, :, None]) & (q_idx[None, :, None] < k_end[:, None, :])
    return mask[:, None, None]


def _block_scores(q, k, mask):
    """Scaled, masked scores [batch, kv, group, q_block, k_block] float32 of one tile.

    q [batch, q_block, kv, group, head_dim], k [batch, kv, k_block, head_dim], mask as `_block_mask`.
    """
    scores = jnp.einsum("btkgd,bksd->bkgts", q, k, preferred_element_type=jnp.float32) * q.shape[-1] ** -0.5
    return jnp.where(mask, scores, _MASKED)


def _tiles(q, k, v, q_pos, k_pos, k_end, block_q, block_k):
    """Queries [nq, batch, block_q, kv, group, head_dim] and keys, values [nk, batch, kv, block_k,
    head_dim] cut into blocks, with their positions [nq, batch, block_q] and [nk, batch, block_k]
    and what `_block_mask` reads of a tree: indices [nq, block_q] and [nk, block_k], key ends
    [nk, batch, block_k] (None without a tree)."""
    batch, seq, kv, group, dim = q.shape
    keys = k.shape[2]
    nq, nk = seq // block_q, keys // block_k
    qb = q.reshape(batch, nq, block_q, kv, group, dim).swapaxes(0, 1)
    kb, vb = (x.reshape(batch, kv, nk, block_k, dim).transpose(2, 0, 1, 3, 4) for x in (k, v))
    q_tree = k_tree = None
    if k_end is not None:
        q_tree = jnp.arange(seq, dtype=jnp.int32).reshape(nq, block_q)
        k_tree = (jnp.arange(keys, dtype=jnp.int32).reshape(nk, block_k), k_end.reshape(batch, nk, block_k).swapaxes(0, 1))
    return (qb, kb, vb, q_pos.reshape(batch, nq, block_q).swapaxes(0, 1), k_pos.reshape(batch, nk, block_k).swapaxes(0, 1),
            q_tree, k_tree)


def _tree(q_tree, k_tree):
    """`_block_mask`'s tree argument of one tile (None without a tree)."""
    return None if q_tree is None else (q_tree, *k_tree)


def _untile_queries(x):
    """[nq, batch, block_q, ...] -> [batch, nq * block_q, ...]."""
    return x.swapaxes(0, 1).reshape(x.shape[1], -1, *x.shape[3:])


def _flash_forward(q, k, v, q_pos, k_pos, k_end, block_q, block_k):
    """out [batch, seq, kv, group, head_dim] (q's dtype) and logsumexp [batch, kv, group, seq] float32."""
    qb, kb, vb, qpb, kpb, qtb, ktb = _tiles(q, k, v, q_pos, k_pos, k_end, block_q, block_k)

    def query_block(inputs):
        qi, qpi, qti = inputs  # [batch, block_q, kv, group, head_dim], [batch, block_q], tree indices

        def key_block(carry, kv_block):
            running_max, total, acc = carry  # [batch, kv, group, block_q] (x2), [..., head_dim]
            kj, vj, kpj, ktj = kv_block
            scores = _block_scores(qi, kj, _block_mask(qpi, kpj, _tree(qti, ktj)))
            new_max = jnp.maximum(running_max, jnp.max(scores, axis=-1))
            probs = jnp.exp(scores - new_max[..., None])
            rescale = jnp.exp(running_max - new_max)
            total = total * rescale + jnp.sum(probs, axis=-1)
            acc = acc * rescale[..., None] + jnp.einsum(
                "bkgts,bksd->bkgtd", probs.astype(vj.dtype), vj, preferred_element_type=jnp.float32
            )
            return (new_max, total, acc), None

        stats_shape = (qi.shape[0], qi.shape[2], qi.shape[3], qi.shape[1])
        init = (
            jnp.full(stats_shape, _MASKED, jnp.float32),
            jnp.zeros(stats_shape, jnp.float32),
            jnp.zeros((*stats_shape, qi.shape[-1]), jnp.float32),
        )
        (running_max, total, acc), _ = jax.lax.scan(key_block, init, (kb, vb, kpb, ktb))
        out = (acc / total[..., None]).transpose(0, 3, 1, 2, 4).astype(q.dtype)  # [batch, block_q, kv, group, d]
        return out, running_max + jnp.log(total)

    out, lse = jax.lax.map(query_block, (qb, qpb, qtb))  # [nq, batch, block_q, ...], [nq, batch, kv, group, block_q]
    lse = lse.transpose(1, 2, 3, 0, 4)  # [batch, kv, group, nq, block_q]
    return _untile_queries(out), lse.reshape(*lse.shape[:3], -1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _flash(q, k, v, q_pos, k_pos, k_end, block_q, block_k):
    return _flash_forward(q, k, v, q_pos, k_pos, k_end, block_q, block_k)[0]


def _flash_fwd(q, k, v, q_pos, k_pos, k_end, block_q, block_k):
    out, lse = _flash_forward(q, k, v, q_pos, k_pos, k_end, block_q, block_k)
    return out, (q, k, v, q_pos, k_pos, k_end, out, lse)


def _flash_bwd(block_q, block_k, residuals, d_out):
    """FlashAttention-2's backward: each tile's probabilities recomputed from the saved logsumexp,
    one pass over query blocks for dq and one over key blocks for dk, dv."""
    q, k, v, q_pos, k_pos, k_end, out, lse = residuals
    # [batch, kv, group, seq]: rowsum(d_out * out), the softmax's Jacobian term
    delta = jnp.einsum("btkgd,btkgd->bkgt", d_out.astype(jnp.float32), out.astype(jnp.float32))
    qb, kb, vb, qpb, kpb, qtb, ktb = _tiles(q, k, v, q_pos, k_pos, k_end, block_q, block_k)
    dob = _tiles(d_out, k, v, q_pos, k_pos, None, block_q, block_k)[0]
    nq = qb.shape[0]
    lse_b, delta_b = (x.reshape(*x.shape[:3], nq, block_q).transpose(3, 0, 1, 2, 4) for x in (lse, delta))
    scale = q.shape[-1] ** -0.5

    def tile(qi, doi, lse_i, delta_i, kj, vj, mask):
        """probs and d(scores) [batch, kv, group, block_q, block_k] float32 of one tile."""
        probs = jnp.exp(_block_scores(qi, kj, mask) - lse_i[..., None])
        d_probs = jnp.einsum("btkgd,bksd->bkgts", doi, vj, preferred_element_type=jnp.float32)
        return probs, jnp.where(mask, probs * (d_probs - delta_i[..., None]), 0.0)

    def dq_block(inputs):
        qi, doi, lse_i, delta_i, qpi, qti = inputs

        def step(dq, kv_block):  # dq [batch, kv, group, block_q, head_dim], like the forward's acc
            kj, vj, kpj, ktj = kv_block
            _, d_scores = tile(qi, doi, lse_i, delta_i, kj, vj, _block_mask(qpi, kpj, _tree(qti, ktj)))
            return dq + jnp.einsum("bkgts,bksd->bkgtd", d_scores.astype(kj.dtype), kj,
                                   preferred_element_type=jnp.float32), None

        batch, block, kv, group, dim = qi.shape
        dq, _ = jax.lax.scan(step, jnp.zeros((batch, kv, group, block, dim), jnp.float32), (kb, vb, kpb, ktb))
        return (dq * scale).transpose(0, 3, 1, 2, 4).astype(q.dtype)

    def dkv_block(inputs):
        kj, vj, kpj, ktj = inputs

        def step(carry, q_block):
            dk, dv = carry
            qi, doi, lse_i, delta_i, qpi, qti = q_block
            probs, d_scores = tile(qi, doi, lse_i, delta_i, kj, vj, _block_mask(qpi, kpj, _tree(qti, ktj)))
            dk = dk + jnp.einsum("bkgts,btkgd->bksd", d_scores.astype(qi.dtype), qi, preferred_element_type=jnp.float32)
            dv = dv + jnp.einsum("bkgts,btkgd->bksd", probs.astype(doi.dtype), doi, preferred_element_type=jnp.float32)
            return (dk, dv), None

        zeros = jnp.zeros(kj.shape, jnp.float32)
        (dk, dv), _ = jax.lax.scan(step, (zeros, zeros), (qb, dob, lse_b, delta_b, qpb, qtb))
        return (dk * scale).astype(k.dtype), dv.astype(v.dtype)

    dq = _untile_queries(jax.lax.map(dq_block, (qb, dob, lse_b, delta_b, qpb, qtb)))
    dk, dv = jax.lax.map(dkv_block, (kb, vb, kpb, ktb))  # [nk, batch, kv, block_k, head_dim]
    untile_keys = lambda x: x.transpose(1, 2, 0, 3, 4).reshape(k.shape)  # noqa: E731
    return dq, untile_keys(dk), untile_keys(dv), None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def flash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_positions: jax.Array,
    k_positions: jax.Array,
    *,
    k_ends: jax.Array | None = None,
    block_q: int = ATTENTION_BLOCK,
    block_k: int = ATTENTION_BLOCK,
) -> jax.Array:
    """Grouped-query attention by tiles, causal by position, in O(seq x block) memory.

    q [batch, seq, heads, head_dim]; k, v [batch, kv_heads, keys, head_dim] (head-major, the
    cache's layout); positions [batch, seq] and [batch, keys] int (-1: padding, never attended).
    The same attention as `grouped_attention` with `cache.attention_mask(q_positions,
    k_positions)`: an online softmax over key blocks (FlashAttention), and a custom backward that
    recomputes each tile from the saved logsumexp, so neither pass holds the [heads, seq, keys]
    scores. Plain XLA, so it runs on every backend (every tile is computed, masked: a `lax.cond`
    skip of the tiles no query sees raised the 7B update's temporaries 24.5 -> 41.4 GiB, see
    docs/experiments.md). Returns [batch, seq, heads, head_dim].

    `k_ends` [batch, keys] (self-attention of rows packed as prefix trees, `rollout/packing.py`):
    key j is seen by query i of its row only where j <= i < k_ends[b, j], i.e. by the rest of
    its own run and by the subtrees that branch off after it, never by a sibling branch or
    another tree of the row; positions still restart in each tree and give RoPE its depths.
    """
    batch, seq, heads, head_dim = q.shape
    kv_heads, keys = k.shape[1], k.shape[2]
    block_q, seq_pad = block_layout(seq, block_q)
    block_k, keys_pad = block_layout(keys, block_k)
    q = q.reshape(batch, seq, kv_heads, heads // kv_heads, head_dim)  # head h uses kv head h // group
    q_positions, k_positions = q_positions.astype(jnp.int32), k_positions.astype(jnp.int32)
    if k_ends is not None:
        if keys != seq:
            raise ValueError(f"k_ends is for a row's self-attention: {seq} queries, {keys} keys")
        k_ends = k_ends.astype(jnp.int32)
    if seq_pad > seq:
        q = jnp.pad(q, ((0, 0), (0, seq_pad - seq), (0, 0), (0, 0), (0, 0)))
        q_positions = jnp.pad(q_positions, ((0, 0), (0, seq_pad - seq)), constant_values=-1)
    if keys_pad > keys:
        k, v = (jnp.pad(x, ((0, 0), (0, 0), (0, keys_pad - keys), (0, 0))) for x in (k, v))
        k_positions = jnp.pad(k_positions, ((0, 0), (0, keys_pad - keys)), constant_values=-1)
    if k_ends is not None and keys_pad > keys:
        k_ends = jnp.pad(k_ends, ((0, 0), (0, keys_pad - keys)))
    if k_ends is not None and seq_pad != keys_pad:  # one tiling for both, so query and key indices agree
        raise ValueError(f"k_ends needs one tiling of queries and keys, got blocks {block_q} and {block_k}")
    out = _flash(q, k, v, q_positions, k_positions, k_ends, block_q, block_k)
    return out[:, :seq].reshape(batch, seq, heads, head_dim)


class RMSNorm(nn.Module):
    eps: float
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), self.param_dtype)
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return scale.astype(x.dtype) * normed.astype(x.dtype)


class LoRA(nn.Module):
    """The low-rank update `scale * (x @ a) @ b` of one projection (`models/tuning.py`): reads the
    adapters `a` [*in, rank], `b` [rank, *out] the parameters carry (they are made by
    `tuning.init_adapters`, never initialised here)."""

    scale: float
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        a, b = self.get_variable("params", "a"), self.get_variable("params", "b")
        n_in, rank = a.ndim - 1, a.shape[-1]
        low = x.reshape(*x.shape[: x.ndim - n_in], -1) @ a.reshape(-1, rank).astype(self.dtype)  # [..., rank]
        out = low @ b.reshape(rank, -1).astype(self.dtype)
        return self.scale * out.reshape(*low.shape[:-1], *b.shape[1:])


def _adapted(y: jax.Array, x: jax.Array, name: str, targets: tuple[str, ...], scale: float, dtype: jnp.dtype) -> jax.Array:
    """`y` (the projection `name` of `x`) plus its LoRA update where `name` is adapted."""
    return y + LoRA(scale, dtype, name=f"{name}_lora")(x) if name in targets else y


class Attention(nn.Module):
    """Grouped-query attention; with a cache, also the chunk's keys and values to store.

    `layer=None` (under `nn.scan`): `layer_cache` is this layer's cached (k, v) [batch, kv_heads,
    slots, head_dim], read only, and the chunk's new (k, v) [batch, kv_heads, seq, head_dim] are
    returned for the caller to write. `layer=i` (layers as a Python loop): `layer_cache` is the
    whole stacked (k, v) [layers, batch, kv_heads, slots, head_dim]; the chunk is written into
    layer i in place and the updated stack is returned. A one-token chunk (a decode step) attends
    with `grouped_attention`; longer chunks with `flash_attention`.
    """

    config: ModelConfig
    dtype: jnp.dtype
    param_dtype: jnp.dtype
    layer: int | None = None
    kernels: AttentionKernels = AttentionKernels()
    activation_sharding: jax.sharding.Sharding | None = None  # its mesh runs the Pallas kernels per shard
    lora_targets: tuple[str, ...] = ()  # adapted projections ("q", "k", "v", "o"), see `LoRA`
    lora_scale: float = 0.0

    @nn.compact
    def __call__(self, x, layer_cache, cos, sin, positions, cache_positions, index, ends=None):
        """x [batch, seq, hidden] at `positions` [batch, seq]; `cache_positions` [batch, slots]
        are the cached slots' positions before this chunk is written (-1: empty); `ends`
        [batch, seq]: rows packed as prefix trees (no cache; see `flash_attention`)."""
        c = self.config
        dense = dict(dtype=self.dtype, param_dtype=self.param_dtype, kernel_init=_INIT)
        lora = functools.partial(_adapted, targets=self.lora_targets, scale=self.lora_scale, dtype=self.dtype)
        q = lora(nn.DenseGeneral((c.num_heads, c.head_dim), use_bias=c.qkv_bias, name="q_proj", **dense)(x), x, "q")
        k = lora(nn.DenseGeneral((c.num_kv_heads, c.head_dim), use_bias=c.qkv_bias, name="k_proj", **dense)(x), x, "k")
        v = lora(nn.DenseGeneral((c.num_kv_heads, c.head_dim), use_bias=c.qkv_bias, name="v_proj", **dense)(x), x, "v")
        if c.qk_norm:
            q = RMSNorm(c.rms_norm_eps, self.param_dtype, name="q_norm")(q)
            k = RMSNorm(c.rms_norm_eps, self.param_dtype, name="k_norm")(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k, v = k.swapaxes(1, 2), v.swapaxes(1, 2)  # head-major, like the cache
        blocks = dict(block_q=self.kernels.block, block_k=self.kernels.block)
        sharded = self.activation_sharding
        pallas = dict(interpret=self.kernels.interpret, mesh=sharded and sharded.mesh,
                      batch_axes=sharded and sharded.spec[0])
        if layer_cache is None and self.kernels.training == "splash" and ends is None:
            out, new_kv = splash_attention(q, k, v, positions, block=self.kernels.block, **pallas), None
        elif layer_cache is None:  # prefix trees on every backend (splash's masks cannot say a tree)
            out = flash_attention(q, k, v, positions, positions, k_ends=ends, **blocks)
            new_kv = None
        elif self.layer is None and x.shape[1] == 1:
            # decode under the scan: the cached keys (read only) and the new one, written after
            cache_k, cache_v = layer_cache
            segments = (
                (cache_k.astype(self.dtype), cache_v.astype(self.dtype), attention_mask(positions, cache_positions)),
                (k, v, attention_mask(positions, positions)),
            )
            out, new_kv = grouped_attention(q, segments), (k, v)
        else:
            # write the chunk first (each row's slots >= its index are empty and masked), then
            # attend over the layer's slots: max_len keys, not max_len + seq (twice for a prefill).
            # Under the scan the write goes into a local copy of the layer's slice; in the loop,
            # into the stack.
            written = tuple(write_rows(buf, new, index, self.layer) for buf, new in zip(layer_cache, (k, v)))
            cache_k, cache_v = written if self.layer is None else (buf[self.layer] for buf in written)
            cache_k, cache_v = cache_k.astype(self.dtype), cache_v.astype(self.dtype)
            key_positions = write_positions(cache_positions, positions.astype(jnp.int32), index)
            if x.shape[1] == 1 and self.kernels.decode == "triton":  # the row's slots 0 .. index
                out = ragged_decode_attention(q, cache_k, cache_v, index + 1, **pallas)
            elif x.shape[1] == 1:
                out = grouped_attention(q, ((cache_k, cache_v, attention_mask(positions, key_positions)),))
            else:
                out = flash_attention(q, cache_k, cache_v, positions, key_positions, **blocks)
            new_kv = (k, v) if self.layer is None else written
        out = lora(nn.DenseGeneral(c.hidden_size, axis=(-2, -1), use_bias=c.o_bias, name="o_proj", **dense)(out), out, "o")
        return out, new_kv


class MLP(nn.Module):
    config: ModelConfig
    dtype: jnp.dtype
    param_dtype: jnp.dtype
    lora_targets: tuple[str, ...] = ()  # adapted projections ("gate", "up", "down"), see `LoRA`
    lora_scale: float = 0.0

    @nn.compact
    def __call__(self, x):
        dense = dict(use_bias=False, dtype=self.dtype, param_dtype=self.param_dtype, kernel_init=_INIT)
        lora = functools.partial(_adapted, targets=self.lora_targets, scale=self.lora_scale, dtype=self.dtype)
        gate = lora(nn.Dense(self.config.intermediate_size, name="gate_proj", **dense)(x), x, "gate")
        up = lora(nn.Dense(self.config.intermediate_size, name="up_proj", **dense)(x), x, "up")
        hidden = nn.silu(gate) * up
        return lora(nn.Dense(self.config.hidden_size, name="down_proj", **dense)(hidden), hidden, "down")


class Block(nn.Module):
    """One pre-norm decoder layer; the scan carry is the residual stream [batch, seq, hidden]."""

    config: ModelConfig
    dtype: jnp.dtype
    param_dtype: jnp.dtype
    activation_sharding: jax.sharding.Sharding | None = None
    layer: int | None = None  # set when the layers run as a Python loop (see `Attention`)
    kernels: AttentionKernels = AttentionKernels()
    lora_targets: tuple[str, ...] = ()  # adapted projections, see `LoRA`
    lora_scale: float = 0.0

    @nn.compact
    def __call__(self, x, layer_cache, cos, sin, positions, cache_positions, index, ends=None):
        c, kw = self.config, dict(dtype=self.dtype, param_dtype=self.param_dtype)
        lora = dict(lora_scale=self.lora_scale)
        h, new_kv = Attention(c, layer=self.layer, kernels=self.kernels, activation_sharding=self.activation_sharding,
                              lora_targets=tuple(t for t in self.lora_targets if t in ("q", "k", "v", "o")), name="attn", **lora, **kw)(
            RMSNorm(c.rms_norm_eps, self.param_dtype, name="attn_norm")(x), layer_cache, cos, sin, positions,
            cache_positions, index, ends,
        )
        x = x + h
        mlp_targets = tuple(t for t in self.lora_targets if t in ("gate", "up", "down"))
        x = x + MLP(c, lora_targets=mlp_targets, name="mlp", **lora, **kw)(
            RMSNorm(c.rms_norm_eps, self.param_dtype, name="mlp_norm")(x))
        if self.activation_sharding is not None:
            x = jax.lax.with_sharding_constraint(x, self.activation_sharding)
        return x, new_kv


class Decoder(nn.Module):
    """tokens, positions [batch, seq] (+ optional cache) -> logits [batch, seq, vocab] float32.

    Without a cache, `ends` [batch, seq] runs rows packed as prefix trees (`rollout/packing.py`):
    each token attends to its own path from the tree's root (`flash_attention`'s `k_ends`).

    `scan_layers=False` runs the layers as a Python loop over per-layer parameters `layers_<i>`
    (see `unstack_layers`) instead of `nn.scan` over the stacked `layers`. `project=False` stops
    at the final hidden states (logits None): the training losses project them to the vocabulary
    a chunk of positions at a time (`output_head`).
    """

    config: ModelConfig
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32
    remat: str | bool = "none"  # a key of REMAT_POLICIES (or the older bool)
    activation_sharding: jax.sharding.Sharding | None = None
    scan_layers: bool = True
    project: bool = True
    kernels: AttentionKernels = AttentionKernels()
    # Tuned training (`models/tuning.py`): the bottom `frozen_layers` blocks run as their own scan
    # (`frozen_layers` params) with the gradient stopped at their output; the `layers` above carry
    # the LoRA adapters of `lora_targets`.
    frozen_layers: int = 0
    lora_targets: tuple[str, ...] = ()
    lora_scale: float = 0.0

    @nn.compact
    def __call__(self, tokens, positions, cache: KVCache | None, ends=None):
        c = self.config
        if cache is not None and (self.frozen_layers or self.lora_targets):
            raise ValueError("parameters split for training (frozen_layers, LoRA adapters) do not decode with a cache: "
                             "merge them first (models.tuning.merge)")
        embed = nn.Embed(
            c.vocab_size, c.hidden_size, dtype=self.dtype, param_dtype=self.param_dtype,
            embedding_init=_INIT, name="embed",
        )
        x = embed(tokens)  # [batch, seq, hidden]
        if self.activation_sharding is not None:
            x = jax.lax.with_sharding_constraint(x, self.activation_sharding)
        cos, sin = rope_tables(positions, rope_inv_freq(c.rope, c.head_dim))
        positions = positions.astype(jnp.int32)
        layer_cache = cache_positions = index = None
        if cache is not None:  # the cached keys; row b's slots >= index[b] are empty (position -1)
            layer_cache, cache_positions, index = (cache.k, cache.v), cache.positions, cache.index

        policy = remat_name(self.remat)
        block = Block if policy == "none" else nn.remat(Block, prevent_cse=False, policy=REMAT_POLICIES[policy])
        block_args = (c, self.dtype, self.param_dtype, self.activation_sharding)
        block_kw = dict(kernels=self.kernels)
        # Under the scan the cache is a read-only input (each layer reads its slice) and only the
        # chunk's new keys and values come out, [layers, batch, kv_heads, seq, head_dim]: a step
        # never copies the cache through the scan; they go in below with one in-place update.
        if self.scan_layers:
            def scan(length: int, name: str, **kw):
                return nn.scan(
                    block,
                    variable_axes={"params": 0},
                    split_rngs={"params": True},
                    in_axes=(0, nn.broadcast, nn.broadcast, nn.broadcast, nn.broadcast, nn.broadcast, nn.broadcast),
                    length=length,
                )(*block_args, **block_kw, **kw, name=name)

            if self.frozen_layers:  # no gradient below: the backward pass stops at their output
                x, _ = scan(self.frozen_layers, "frozen_layers")(x, None, cos, sin, positions, None, None, ends)
                x = jax.lax.stop_gradient(x)
            layers = scan(c.num_layers - self.frozen_layers, "layers", lora_targets=self.lora_targets,
                          lora_scale=self.lora_scale)
            x, new_kv = layers(x, layer_cache, cos, sin, positions, cache_positions, index, ends)
        else:  # each layer writes its keys into the stacked cache in place, then attends
            for i in range(c.num_layers):
                x, layer_cache = block(*block_args, layer=i, **block_kw, name=f"layers_{i}")(
                    x, layer_cache, cos, sin, positions, cache_positions, index, ends
                )
        hidden = RMSNorm(c.rms_norm_eps, self.param_dtype, name="final_norm")(x)

        logits = None
        if self.project:
            if c.tie_word_embeddings:
                head = embed.embedding.T  # [hidden, vocab]
            else:
                head = self.param("lm_head", _INIT, (c.hidden_size, c.vocab_size), self.param_dtype)
            logits = jnp.einsum(
                "btd,dv->btv", hidden, head.astype(self.dtype), preferred_element_type=jnp.float32
            )
        new_cache = None
        if cache is not None:  # row b's chunk goes at its slots index[b] .. index[b] + seq
            write = lambda buf, x: write_rows(buf, x, index)
            k, v = (write(cache.k, new_kv[0]), write(cache.v, new_kv[1])) if self.scan_layers else layer_cache
            new_cache = cache.written(k, v, positions)
        return logits, hidden, new_cache


@functools.partial(jax.jit, static_argnames=("config", "param_dtype", "value_head"))
def init_params(
    config: ModelConfig, rng: jax.Array, *, param_dtype: jnp.dtype = jnp.float32, value_head: bool = False
) -> Params:
    """Random parameters (normal(0.02) matrices, unit norms, zero biases) as a plain pytree.

    Jitted (one compile per config, not one per operation); under `jax.jit(..., out_shardings=...)`
    each device only creates its own shards (`parallel.partition.sharded_init`).
    """
    decoder_rng, head_rng = jax.random.split(rng)
    tokens = jnp.zeros((1, 1), jnp.int32)
    variables = Decoder(config, param_dtype=param_dtype).init(decoder_rng, tokens, tokens, None)
    params = dict(variables["params"])
    if value_head:
        params["value_head"] = init_value_head(config, head_rng, param_dtype=param_dtype)
    return params


def init_value_head(config: ModelConfig, rng: jax.Array, *, param_dtype: jnp.dtype = jnp.float32) -> Params:
    """A scalar head on the final hidden state (PPO's critic), kept apart from the backbone."""
    return {
        "kernel": _INIT(rng, (config.hidden_size,), param_dtype),
        "bias": jnp.zeros((), param_dtype),
    }


def value_head(params: Params, hidden: jax.Array) -> jax.Array:
    """values [batch, seq] float32 from the final hidden states [batch, seq, hidden]."""
    head = params["value_head"]
    values = jnp.einsum("btd,d->bt", hidden, head["kernel"].astype(hidden.dtype), preferred_element_type=jnp.float32)
    return values + head["bias"].astype(jnp.float32)


def unstack_layers(params: Params) -> Params:
    """The same parameters with the stacked `layers` split into `layers_0 .. layers_{L-1}`.

    `forward` on these runs the layers as a Python loop, each reading its own weight arrays.
    Under `nn.scan` a step reads layer i's weights through a dynamic slice of the stack, which
    XLA CPU materialises: inside a decode loop that copies every weight once per token. The
    sampler unstacks once per turn, outside its loop (`sampler.decode`).
    """
    params = dict(params)
    stacked = params.pop("layers")
    num_layers = jax.tree.leaves(stacked)[0].shape[0]
    for i in range(num_layers):
        params[f"layers_{i}"] = jax.tree.map(lambda x: x[i], stacked)
    return params


def init_cache(config: ModelConfig, batch: int, max_len: int, dtype: jnp.dtype = jnp.float32) -> KVCache:
    """An empty cache (all positions -1) for `batch` rows of up to `max_len` tokens."""
    return KVCache.init(config.num_layers, batch, max_len, config.num_kv_heads, config.head_dim, dtype)


def forward(
    params: Params,
    tokens: jax.Array,
    positions: jax.Array,
    cache: KVCache | None = None,
    *,
    config: ModelConfig,
    dtype: jnp.dtype | None = None,
    remat: str | bool = "none",
    return_hidden: bool = False,
    activation_sharding: jax.sharding.Sharding | None = None,
    kernels: AttentionKernels = AttentionKernels(),
    lora_scale: float = 0.0,
):
    """Runs the decoder on tokens [batch, seq] int32 at positions [batch, seq] int32 (-1 = padding).

    With a cache, row b's chunk is written at its slots `cache.index[b] ..` (right-padded rows: real
    tokens first; writes past the cache's length are dropped) and its index advances by its real
    tokens (positions >= 0). Without one, attention stays within the given rows (training).
    `dtype` is the compute dtype (default: the parameters' dtype); `remat` is what each layer keeps
    for the backward pass (a key of `REMAT_POLICIES`); `activation_sharding` pins the residual stream
    [batch, seq, hidden] (see `parallel.partition.activation_sharding`); `kernels` picks the
    attention implementations (`models.kernels`; the XLA paths by default). `params` may have
    their layers stacked (`layers`, as initialised and loaded) or split by `unstack_layers`.
    Returns (logits [batch, seq, vocab] float32, new cache or None), plus the final hidden states
    [batch, seq, hidden] (input of `value_head`) when `return_hidden`. Without a cache, `params`
    may be split for tuned training (`models/tuning.combine`, adapters scaled by `lora_scale`).
    """
    logits, hidden, new_cache = _decoder(params, dtype, remat, activation_sharding, kernels, True, config, lora_scale).apply(
        {"params": _backbone(params)}, tokens, positions, cache
    )
    return (logits, new_cache, hidden) if return_hidden else (logits, new_cache)


def hidden_states(
    params: Params,
    tokens: jax.Array,
    positions: jax.Array,
    *,
    config: ModelConfig,
    dtype: jnp.dtype | None = None,
    remat: str | bool = "none",
    activation_sharding: jax.sharding.Sharding | None = None,
    kernels: AttentionKernels = AttentionKernels(),
    lora_scale: float = 0.0,
    ends: jax.Array | None = None,
) -> jax.Array:
    """The final (normed) hidden states [batch, seq, hidden] of `forward` without a cache, in the
    compute dtype, without projecting to the vocabulary (see `output_head`). `params` may be split
    for tuned training (`models/tuning.combine`); `lora_scale` scales their adapters. `ends`: the
    rows are prefix trees (`Decoder`)."""
    _, hidden, _ = _decoder(params, dtype, remat, activation_sharding, kernels, False, config, lora_scale).apply(
        {"params": _backbone(params)}, tokens, positions, None, ends
    )
    return hidden


def output_head(params: Params, config: ModelConfig) -> jax.Array:
    """[hidden, vocab] in the parameters' dtype: logits = hidden states @ this (tied or `lm_head`)."""
    return params["embed"]["embedding"].T if config.tie_word_embeddings else params["lm_head"]


def _backbone(params: Params) -> Params:
    return {name: p for name, p in params.items() if name != "value_head"}


def _decoder(params, dtype, remat, activation_sharding, kernels, project, config, lora_scale=0.0) -> Decoder:
    """The module for `params`: stacked or per-layer, and split for tuned training (frozen bottom
    layers, LoRA adapters; `models/tuning.py`) as the tree shows."""
    frozen = jax.tree.leaves(params["frozen_layers"])[0].shape[0] if "frozen_layers" in params else 0
    layers = params.get("layers", {})
    targets = tuple(name.removesuffix("_lora") for module in ("attn", "mlp") for name in layers.get(module, {})
                    if name.endswith("_lora"))
    if targets and not lora_scale:
        raise ValueError(f"the parameters carry LoRA adapters ({', '.join(targets)}) but lora_scale is 0")
    return Decoder(
        config, dtype=dtype or params["embed"]["embedding"].dtype, remat=remat,
        activation_sharding=activation_sharding, scan_layers="layers" in params, project=project,
        kernels=kernels, frozen_layers=frozen, lora_targets=targets, lora_scale=lora_scale,
    )
