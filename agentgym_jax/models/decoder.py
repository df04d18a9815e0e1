"""The decoder-only transformer of every family in `models/families/`, as pure functions over a pytree.

Pre-norm blocks (RMSNorm → grouped-query attention with RoPE → residual, RMSNorm → gated MLP or a
mixture of experts (`models.moe`) → residual), stacked with `nn.scan` so compile time does not
grow with depth. Attention is causal by *position*, not by slot (see `cache.attention_mask`): the
same code serves training (no cache, right-padded rows) and multi-turn sampling (new chunks
appended to a `KVCache`). What the families change is a `ModelConfig` field read by the module
it concerns: the norm (`RMSNorm`, Gemma's `(1 + w)`, `sandwich_norms`), the MLP's activation
(`ACTIVATIONS`), the scores' scale and soft cap (`ScoreSpec`), the sliding window (a mask term,
a per-layer flag under the scan), a second RoPE table for sliding layers, the experts.

Parameter pytree (layer parameters carry a leading `[layers]` axis):
  embed/embedding [vocab, hidden]            lm_head [hidden, vocab] (absent when tied)
  layers/attn_norm/scale [L, hidden]          layers/mlp_norm/scale [L, hidden]
  layers/{post_attn,post_mlp}_norm/scale [L, hidden] (Gemma)
  layers/attn/{q,k,v}_proj/kernel [L, hidden, heads, head_dim] (+ bias [L, heads, head_dim])
  layers/attn/o_proj/kernel [L, heads, head_dim, hidden] (+ bias [L, hidden])
  layers/attn/{q,k}_norm/scale [L, head_dim] (Qwen3, Gemma 3)
  layers/mlp/{gate,up}_proj/kernel [L, hidden, mlp]   layers/mlp/down_proj/kernel [L, mlp, hidden]
  layers/moe/... (instead of mlp: `models.moe`)  layers/shared_expert/..., shared_expert_gate (Qwen2-MoE)
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
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from agentgym_jax.models.cache import KVCache, attention_mask, write_positions, write_rows
from agentgym_jax.models.config import ModelConfig, RopeConfig
from agentgym_jax.models.kernels import ATTENTION_BLOCK, AttentionKernels, ragged_decode_attention, splash_attention
from agentgym_jax.models.moe import EXPERT_PROJECTIONS, MoE, Routing

Params = dict[str, Any]
_INIT = nn.initializers.normal(0.02)  # Hugging Face's initializer_range
_MASKED = float(np.finfo(np.float32).min)  # finite: a query with no visible key stays finite
_NO_WINDOW = int(np.iinfo(np.int32).max)  # the window of a global layer among sliding ones
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


def soft_cap(x: jax.Array, cap: float | None) -> jax.Array:
    """`cap * tanh(x / cap)` (Gemma 2's attention scores and logits); x itself where cap is None."""
    return x if cap is None else cap * jnp.tanh(x / cap)


def grouped_attention(
    q: jax.Array, segments: tuple[tuple[jax.Array, jax.Array, jax.Array], ...], scale: float | None = None,
    softcap: float | None = None,
) -> jax.Array:
    """Softmax attention where each group of query heads shares one key/value head.

    q [batch, seq, heads, head_dim]; `segments` are (k, v [batch, kv_heads, keys_i, head_dim],
    mask [batch, seq, keys_i]) blocks of keys that one softmax spans, e.g. the cached keys and
    the chunk's own new ones: attending to each block where it lies is what spares a decode step
    from copying the cache to append its key first. Keys are head-major (the cache's layout), so
    the batched dots read them in place. Scores are scaled by `scale` (default head_dim ** -0.5)
    and soft-capped by `softcap`. Returns [batch, seq, heads, head_dim].
    """
    batch, seq, heads, head_dim = q.shape
    kv_heads = segments[0][0].shape[1]
    scale = head_dim**-0.5 if scale is None else scale
    q = q.reshape(batch, seq, kv_heads, heads // kv_heads, head_dim)  # head h uses kv head h // group
    scores = [
        jnp.where(
            mask[:, None, None],
            soft_cap(jnp.einsum("btkgd,bksd->bkgts", q, k, preferred_element_type=jnp.float32) * scale, softcap),
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


class ScoreSpec(NamedTuple):
    """How a layer turns q . k into scores (static): the scale, the soft cap (None: none)."""

    scale: float
    softcap: float | None = None


def _block_scores(q, k, q_pos, k_pos, window, spec: ScoreSpec, tree=None):
    """Scaled, capped, masked scores [batch, kv, group, q_block, k_block] float32 of one tile, and its mask.

    q [batch, q_block, kv, group, head_dim], k [batch, kv, k_block, head_dim], positions
    [batch, q_block] and [batch, k_block]: the mask is `cache.attention_mask` of the tile; `tree`
    (rows packed as prefix trees, see `flash_attention`) is (query indices [q_block], key indices
    [k_block], key ends [batch, k_block]) and keeps key j for query i only where j <= i < end[j].
    """
    mask = attention_mask(q_pos, k_pos, window)
    if tree is not None:
        q_idx, k_idx, k_end = tree
        mask &= (k_idx[None, None, :] <= q_idx[None, :, None]) & (q_idx[None, :, None] < k_end[:, None, :])
    mask = mask[:, None, None]  # [batch, 1, 1, q_block, k_block]
    scores = jnp.einsum("btkgd,bksd->bkgts", q, k, preferred_element_type=jnp.float32) * spec.scale
    return jnp.where(mask, soft_cap(scores, spec.softcap), _MASKED), mask


def _tiles(q, k, v, q_pos, k_pos, k_end, block_q, block_k):
    """Queries [nq, batch, block_q, kv, group, head_dim] and keys, values [nk, batch, kv, block_k,
    head_dim] cut into blocks, with their positions [nq, batch, block_q] and [nk, batch, block_k]
    and what `_block_scores` reads of a tree: indices [nq, block_q] and [nk, block_k], key ends
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
    """`_block_scores`'s tree argument of one tile (None without a tree)."""
    return None if q_tree is None else (q_tree, *k_tree)


def _untile_queries(x):
    """[nq, batch, block_q, ...] -> [batch, nq * block_q, ...]."""
    return x.swapaxes(0, 1).reshape(x.shape[1], -1, *x.shape[3:])


def _flash_forward(q, k, v, q_pos, k_pos, k_end, window, block_q, block_k, spec):
    """out [batch, seq, kv, group, head_dim] (q's dtype) and logsumexp [batch, kv, group, seq] float32."""
    qb, kb, vb, qpb, kpb, qtb, ktb = _tiles(q, k, v, q_pos, k_pos, k_end, block_q, block_k)

    def query_block(inputs):
        qi, qpi, qti = inputs  # [batch, block_q, kv, group, head_dim], [batch, block_q], tree indices

        def key_block(carry, kv_block):
            running_max, total, acc = carry  # [batch, kv, group, block_q] (x2), [..., head_dim]
            kj, vj, kpj, ktj = kv_block
            scores, _ = _block_scores(qi, kj, qpi, kpj, window, spec, _tree(qti, ktj))
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


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9))
def _flash(q, k, v, q_pos, k_pos, k_end, window, block_q, block_k, spec):
    return _flash_forward(q, k, v, q_pos, k_pos, k_end, window, block_q, block_k, spec)[0]


def _flash_fwd(q, k, v, q_pos, k_pos, k_end, window, block_q, block_k, spec):
    out, lse = _flash_forward(q, k, v, q_pos, k_pos, k_end, window, block_q, block_k, spec)
    return out, (q, k, v, q_pos, k_pos, k_end, window, out, lse)


def _flash_bwd(block_q, block_k, spec, residuals, d_out):
    """FlashAttention-2's backward: each tile's probabilities recomputed from the saved logsumexp,
    one pass over query blocks for dq and one over key blocks for dk, dv."""
    q, k, v, q_pos, k_pos, k_end, window, out, lse = residuals
    # [batch, kv, group, seq]: rowsum(d_out * out), the softmax's Jacobian term
    delta = jnp.einsum("btkgd,btkgd->bkgt", d_out.astype(jnp.float32), out.astype(jnp.float32))
    qb, kb, vb, qpb, kpb, qtb, ktb = _tiles(q, k, v, q_pos, k_pos, k_end, block_q, block_k)
    dob = _tiles(d_out, k, v, q_pos, k_pos, None, block_q, block_k)[0]
    nq = qb.shape[0]
    lse_b, delta_b = (x.reshape(*x.shape[:3], nq, block_q).transpose(3, 0, 1, 2, 4) for x in (lse, delta))
    scale = spec.scale

    def tile(qi, doi, lse_i, delta_i, qpi, kj, vj, kpj, tree):
        """probs and d(scaled scores) [batch, kv, group, block_q, block_k] float32 of one tile."""
        scores, mask = _block_scores(qi, kj, qpi, kpj, window, spec, tree)
        probs = jnp.exp(scores - lse_i[..., None])
        d_probs = jnp.einsum("btkgd,bksd->bkgts", doi, vj, preferred_element_type=jnp.float32)
        d_scores = probs * (d_probs - delta_i[..., None])
        if spec.softcap is not None:  # through cap * tanh(s / cap): times 1 - tanh^2
            d_scores = d_scores * (1.0 - jnp.square(scores / spec.softcap))
        return probs, jnp.where(mask, d_scores, 0.0)

    def dq_block(inputs):
        qi, doi, lse_i, delta_i, qpi, qti = inputs

        def step(dq, kv_block):  # dq [batch, kv, group, block_q, head_dim], like the forward's acc
            kj, vj, kpj, ktj = kv_block
            _, d_scores = tile(qi, doi, lse_i, delta_i, qpi, kj, vj, kpj, _tree(qti, ktj))
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
            probs, d_scores = tile(qi, doi, lse_i, delta_i, qpi, kj, vj, kpj, _tree(qti, ktj))
            dk = dk + jnp.einsum("bkgts,btkgd->bksd", d_scores.astype(qi.dtype), qi, preferred_element_type=jnp.float32)
            dv = dv + jnp.einsum("bkgts,btkgd->bksd", probs.astype(doi.dtype), doi, preferred_element_type=jnp.float32)
            return (dk, dv), None

        zeros = jnp.zeros(kj.shape, jnp.float32)
        (dk, dv), _ = jax.lax.scan(step, (zeros, zeros), (qb, dob, lse_b, delta_b, qpb, qtb))
        return (dk * scale).astype(k.dtype), dv.astype(v.dtype)

    dq = _untile_queries(jax.lax.map(dq_block, (qb, dob, lse_b, delta_b, qpb, qtb)))
    dk, dv = jax.lax.map(dkv_block, (kb, vb, kpb, ktb))  # [nk, batch, kv, block_k, head_dim]
    untile_keys = lambda x: x.transpose(1, 2, 0, 3, 4).reshape(k.shape)  # noqa: E731
    return dq, untile_keys(dk), untile_keys(dv), None, None, None, None


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
    window: jax.Array | int | None = None,
    scale: float | None = None,
    softcap: float | None = None,
) -> jax.Array:
    """Grouped-query attention by tiles, causal by position, in O(seq x block) memory.

    q [batch, seq, heads, head_dim]; k, v [batch, kv_heads, keys, head_dim] (head-major, the
    cache's layout); positions [batch, seq] and [batch, keys] int (-1: padding, never attended).
    The same attention as `grouped_attention` with `cache.attention_mask(q_positions,
    k_positions, window)`: an online softmax over key blocks (FlashAttention), and a custom
    backward that recomputes each tile from the saved logsumexp, so neither pass holds the
    [heads, seq, keys] scores. Plain XLA, so it runs on every backend; a sliding `window` is a
    term of the mask (the tiles outside the band are computed and masked, see docs/models.md).
    Scores are scaled by `scale` (default head_dim ** -0.5) and soft-capped by `softcap`.
    Every tile is computed, masked: a `lax.cond` skip of the tiles no query sees raised the 7B
    update's temporaries 24.5 -> 41.4 GiB (docs/experiments.md). Returns [batch, seq, heads, head_dim].

    `k_ends` [batch, keys] (self-attention of rows packed as prefix trees, `rollout/packing.py`):
    key j is seen by query i of its row only where j <= i < k_ends[b, j], i.e. by the rest of
    its own run and by the subtrees that branch off after it, never by a sibling branch or
    another tree of the row; positions restart in each tree and give RoPE (and a window) depths.
    """
    batch, seq, heads, head_dim = q.shape
    kv_heads, keys = k.shape[1], k.shape[2]
    block_q, seq_pad = block_layout(seq, block_q)
    block_k, keys_pad = block_layout(keys, block_k)
    q = q.reshape(batch, seq, kv_heads, heads // kv_heads, head_dim)  # head h uses kv head h // group
    q_positions, k_positions = q_positions.astype(jnp.int32), k_positions.astype(jnp.int32)
    if k_ends is not None:
        if keys != seq or block_q != block_k:
            raise ValueError(f"k_ends is for a row's self-attention in one tiling: {seq} queries, {keys} keys")
        k_ends = jnp.pad(k_ends.astype(jnp.int32), ((0, 0), (0, keys_pad - keys)))
    if seq_pad > seq:
        q = jnp.pad(q, ((0, 0), (0, seq_pad - seq), (0, 0), (0, 0), (0, 0)))
        q_positions = jnp.pad(q_positions, ((0, 0), (0, seq_pad - seq)), constant_values=-1)
    if keys_pad > keys:
        k, v = (jnp.pad(x, ((0, 0), (0, 0), (0, keys_pad - keys), (0, 0))) for x in (k, v))
        k_positions = jnp.pad(k_positions, ((0, 0), (0, keys_pad - keys)), constant_values=-1)
    spec = ScoreSpec(head_dim**-0.5 if scale is None else scale, softcap)
    out = _flash(q, k, v, q_positions, k_positions, k_ends, window, block_q, block_k, spec)
    return out[:, :seq].reshape(batch, seq, heads, head_dim)


class RMSNorm(nn.Module):
    """RMSNorm in float32. Llama's scales the normed input, cast to x's dtype, by `scale`; Gemma's
    (`plus_one`) stores `scale` as w, multiplies in float32 by (1 + w) and then casts."""

    eps: float
    param_dtype: jnp.dtype = jnp.float32
    plus_one: bool = False

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        init = nn.initializers.zeros if self.plus_one else nn.initializers.ones
        scale = self.param("scale", init, (x.shape[-1],), self.param_dtype)
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        if self.plus_one:
            return (normed * (1.0 + scale.astype(jnp.float32))).astype(x.dtype)
        return scale.astype(x.dtype) * normed.astype(x.dtype)


def norm(config: ModelConfig, param_dtype: jnp.dtype, name: str) -> RMSNorm:
    """The family's RMSNorm (`ModelConfig.norm_plus_one`), named `name`."""
    return RMSNorm(config.rms_norm_eps, param_dtype, config.norm_plus_one, name=name)


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
    with `grouped_attention`; longer chunks with `flash_attention`. `sliding` (a bool, traced
    under the scan) says whether this layer attends through `config.sliding_window`.
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
    def __call__(self, x, layer_cache, rope, sliding, positions, cache_positions, index, ends=None):
        """x [batch, seq, hidden] at `positions` [batch, seq], rotated by `rope` = (cos, sin);
        `cache_positions` [batch, slots] are the cached slots' positions before this chunk is
        written (-1: empty); `ends` [batch, seq]: rows packed as prefix trees (no cache; see
        `flash_attention`)."""
        c = self.config
        dense = dict(dtype=self.dtype, param_dtype=self.param_dtype, kernel_init=_INIT)
        lora = functools.partial(_adapted, targets=self.lora_targets, scale=self.lora_scale, dtype=self.dtype)
        q = lora(nn.DenseGeneral((c.num_heads, c.head_dim), use_bias=c.qkv_bias, name="q_proj", **dense)(x), x, "q")
        k = lora(nn.DenseGeneral((c.num_kv_heads, c.head_dim), use_bias=c.qkv_bias, name="k_proj", **dense)(x), x, "k")
        v = lora(nn.DenseGeneral((c.num_kv_heads, c.head_dim), use_bias=c.qkv_bias, name="v_proj", **dense)(x), x, "v")
        if c.qk_norm:
            q = norm(c, self.param_dtype, "q_norm")(q)
            k = norm(c, self.param_dtype, "k_norm")(k)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        k, v = k.swapaxes(1, 2), v.swapaxes(1, 2)  # head-major, like the cache
        scores = dict(scale=score_scale(c), softcap=c.attn_softcap)
        # The layer's window as a mask term: `sliding_window` on sliding layers, none on global ones.
        window = None if c.sliding_window is None else jnp.where(sliding, c.sliding_window, _NO_WINDOW)
        blocks = dict(block_q=self.kernels.block, block_k=self.kernels.block, window=window, **scores)
        sharded = self.activation_sharding
        pallas = dict(interpret=self.kernels.interpret, mesh=sharded and sharded.mesh,
                      batch_axes=sharded and sharded.spec[0])
        if layer_cache is None and self.kernels.training == "splash" and ends is None:
            splash = functools.partial(splash_attention, q, k, v, positions, block=self.kernels.block, **scores, **pallas)
            out = splash() if window is None else jax.lax.cond(
                sliding, lambda: splash(window=c.sliding_window), lambda: splash())
            new_kv = None
        elif layer_cache is None:  # prefix trees on every backend (splash's masks cannot say a tree)
            out = flash_attention(q, k, v, positions, positions, k_ends=ends, **blocks)
            new_kv = None
        elif self.layer is None and x.shape[1] == 1:
            # decode under the scan: the cached keys (read only) and the new one, written after
            cache_k, cache_v = layer_cache
            segments = (
                (cache_k.astype(self.dtype), cache_v.astype(self.dtype), attention_mask(positions, cache_positions, window)),
                (k, v, attention_mask(positions, positions, window)),
            )
            out, new_kv = grouped_attention(q, segments, **scores), (k, v)
        else:
            # write the chunk first (each row's slots >= its index are empty and masked), then
            # attend over the layer's slots: max_len keys, not max_len + seq (twice for a prefill).
            # Under the scan the write goes into a local copy of the layer's slice; in the loop,
            # into the stack.
            written = tuple(write_rows(buf, new, index, self.layer) for buf, new in zip(layer_cache, (k, v)))
            cache_k, cache_v = written if self.layer is None else (buf[self.layer] for buf in written)
            cache_k, cache_v = cache_k.astype(self.dtype), cache_v.astype(self.dtype)
            key_positions = write_positions(cache_positions, positions.astype(jnp.int32), index)
            if x.shape[1] == 1 and self.kernels.decode == "triton" and c.attn_softcap is None:
                # the row's slots 0 .. index (a sliding layer's last `window` of them: slot = position in a row)
                starts = None if window is None else jnp.maximum(index + 1 - window, 0)
                out = ragged_decode_attention(q, cache_k, cache_v, index + 1, starts, scale=scores["scale"], **pallas)
            elif x.shape[1] == 1:
                out = grouped_attention(q, ((cache_k, cache_v, attention_mask(positions, key_positions, window)),), **scores)
            else:
                out = flash_attention(q, cache_k, cache_v, positions, key_positions, **blocks)
            new_kv = (k, v) if self.layer is None else written
        out = lora(nn.DenseGeneral(c.hidden_size, axis=(-2, -1), use_bias=c.o_bias, name="o_proj", **dense)(out), out, "o")
        return out, new_kv


def score_scale(config: ModelConfig) -> float:
    """What q . k is multiplied by: query_pre_attn_scalar ** -0.5 (Gemma), else head_dim ** -0.5."""
    return (config.query_pre_attn_scalar or config.head_dim) ** -0.5


ACTIVATIONS = {"silu": nn.silu, "gelu_pytorch_tanh": functools.partial(jax.nn.gelu, approximate=True)}


class MLP(nn.Module):
    """The gated MLP: down(act(gate(x)) * up(x)), SwiGLU or GeGLU (`ModelConfig.hidden_act`), of
    `intermediate_size` (default the config's; a shared expert has its own)."""

    config: ModelConfig
    dtype: jnp.dtype
    param_dtype: jnp.dtype
    lora_targets: tuple[str, ...] = ()  # adapted projections ("gate", "up", "down"), see `LoRA`
    lora_scale: float = 0.0
    intermediate_size: int | None = None

    @nn.compact
    def __call__(self, x):
        dense = dict(use_bias=False, dtype=self.dtype, param_dtype=self.param_dtype, kernel_init=_INIT)
        lora = functools.partial(_adapted, targets=self.lora_targets, scale=self.lora_scale, dtype=self.dtype)
        size = self.intermediate_size or self.config.intermediate_size
        gate = lora(nn.Dense(size, name="gate_proj", **dense)(x), x, "gate")
        up = lora(nn.Dense(size, name="up_proj", **dense)(x), x, "up")
        hidden = ACTIVATIONS[self.config.hidden_act](gate) * up
        return lora(nn.Dense(self.config.hidden_size, name="down_proj", **dense)(hidden), hidden, "down")


class Block(nn.Module):
    """One pre-norm decoder layer; the scan carry is the residual stream [batch, seq, hidden].

    Attention, then the MLP (a mixture of experts where `config.num_experts`), each behind its
    own norm; with `sandwich_norms` (Gemma) each output is normed again before the residual add.
    `ropes` are the (cos, sin) tables of full-attention layers and, where the sliding layers have
    their own RoPE (Gemma 3), theirs second. Returns (x, (new_kv, `moe.Routing` or None)).
    """

    config: ModelConfig
    dtype: jnp.dtype
    param_dtype: jnp.dtype
    activation_sharding: jax.sharding.Sharding | None = None
    layer: int | None = None  # set when the layers run as a Python loop (see `Attention`)
    kernels: AttentionKernels = AttentionKernels()
    lora_targets: tuple[str, ...] = ()  # adapted projections, see `LoRA`
    lora_scale: float = 0.0

    @nn.compact
    def __call__(self, x, layer_cache, sliding, ropes, positions, cache_positions, index, ends=None):
        c, kw = self.config, dict(dtype=self.dtype, param_dtype=self.param_dtype)
        lora = dict(lora_scale=self.lora_scale)
        targets = lambda names: tuple(t for t in self.lora_targets if t in names)  # noqa: E731
        rope = ropes[0] if len(ropes) == 1 else jax.tree.map(lambda g, s: jnp.where(sliding, s, g), *ropes)
        h, new_kv = Attention(c, layer=self.layer, kernels=self.kernels, activation_sharding=self.activation_sharding,
                              lora_targets=targets(("q", "k", "v", "o")), name="attn", **lora, **kw)(
            norm(c, self.param_dtype, "attn_norm")(x), layer_cache, rope, sliding, positions, cache_positions, index, ends,
        )
        if c.sandwich_norms:
            h = norm(c, self.param_dtype, "post_attn_norm")(h)
        x = x + h
        h, routing = norm(c, self.param_dtype, "mlp_norm")(x), None
        if c.moe:
            adapted = tuple(p for p in EXPERT_PROJECTIONS if f"expert_{p}" in self.lora_targets)
            out, routing = MoE(c, dispatch=self.kernels.moe_dispatch, lora_targets=adapted, name="moe", **lora, **kw)(
                h, positions)
            if c.shared_expert_intermediate_size:  # Qwen2-MoE: every token through one more expert, gated
                gate = nn.Dense(1, use_bias=False, name="shared_expert_gate", kernel_init=_INIT, **kw)(h)
                out = out + jax.nn.sigmoid(gate) * MLP(c, intermediate_size=c.shared_expert_intermediate_size,
                                                       name="shared_expert", **kw)(h)
            h = out
        else:
            h = MLP(c, lora_targets=targets(("gate", "up", "down")), name="mlp", **lora, **kw)(h)
        if c.sandwich_norms:
            h = norm(c, self.param_dtype, "post_mlp_norm")(h)
        x = x + h
        if self.activation_sharding is not None:
            x = jax.lax.with_sharding_constraint(x, self.activation_sharding)
        return x, (new_kv, routing)


class Decoder(nn.Module):
    """tokens, positions [batch, seq] (+ optional cache) -> logits [batch, seq, vocab] float32.

    `scan_layers=False` runs the layers as a Python loop over per-layer parameters `layers_<i>`
    (see `unstack_layers`) instead of `nn.scan` over the stacked `layers`. `project=False` stops
    at the final hidden states (logits None): the training losses project them to the vocabulary
    a chunk of positions at a time (`output_head`). Without a cache, `ends` [batch, seq] runs rows
    packed as prefix trees (`rollout/packing.py`): each token attends to its own path from the
    tree's root (`flash_attention`'s `k_ends`).
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
        if c.scale_embeddings:  # Gemma: the normalizer rounded to the compute dtype, as transformers does
            x = x * jnp.asarray(math.sqrt(c.hidden_size), x.dtype)
        if self.activation_sharding is not None:
            x = jax.lax.with_sharding_constraint(x, self.activation_sharding)
        ropes = tuple(rope_tables(positions, rope_inv_freq(rope, c.head_dim)) for rope in layer_ropes(c))
        positions = positions.astype(jnp.int32)
        sliding = np.asarray(c.sliding_layers)  # [layers] bool: a per-layer input of the scan
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
                    in_axes=(0, 0, nn.broadcast, nn.broadcast, nn.broadcast, nn.broadcast, nn.broadcast),
                    length=length,
                )(*block_args, **block_kw, **kw, name=name)

            routings = []
            if self.frozen_layers:  # no gradient below: the backward pass stops at their output
                x, (_, routing) = scan(self.frozen_layers, "frozen_layers")(
                    x, None, sliding[: self.frozen_layers], ropes, positions, None, None, ends)
                x = jax.lax.stop_gradient(x)
                routings.append(routing)
            layers = scan(c.num_layers - self.frozen_layers, "layers", lora_targets=self.lora_targets,
                          lora_scale=self.lora_scale)
            x, (new_kv, routing) = layers(x, layer_cache, sliding[self.frozen_layers :], ropes, positions,
                                          cache_positions, index, ends)
            routing = _concat_layers([*routings, routing])
        else:  # each layer writes its keys into the stacked cache in place, then attends
            routings = []
            for i in range(c.num_layers):
                x, (layer_cache, routing) = block(*block_args, layer=i, **block_kw, name=f"layers_{i}")(
                    x, layer_cache, sliding[i], ropes, positions, cache_positions, index, ends
                )
                routings.append(None if routing is None else jax.tree.map(lambda r: r[None], routing))
            routing = _concat_layers(routings)
        hidden = norm(c, self.param_dtype, "final_norm")(x)

        logits = None
        if self.project:
            if c.tie_word_embeddings:
                head = embed.embedding.T  # [hidden, vocab]
            else:
                head = self.param("lm_head", _INIT, (c.hidden_size, c.vocab_size), self.param_dtype)
            logits = project_logits(hidden, head, c)
        new_cache = None
        if cache is not None:  # row b's chunk goes at its slots index[b] .. index[b] + seq
            write = lambda buf, x: write_rows(buf, x, index)
            k, v = (write(cache.k, new_kv[0]), write(cache.v, new_kv[1])) if self.scan_layers else layer_cache
            new_cache = cache.written(k, v, positions)
        return logits, hidden, new_cache, routing


def layer_ropes(config: ModelConfig) -> tuple[RopeConfig, ...]:
    """The RoPE of full-attention layers, and a second one where sliding layers have their own."""
    local = config.local_rope
    return (config.rope,) if local is None or local == config.rope or config.sliding_window is None else (config.rope, local)


def project_logits(hidden: jax.Array, head: jax.Array, config: ModelConfig) -> jax.Array:
    """logits [..., vocab] float32 of final hidden states [..., hidden] through `head` [hidden, vocab],
    soft-capped where the family caps them (Gemma 2)."""
    logits = jnp.einsum("...d,dv->...v", hidden, head.astype(hidden.dtype), preferred_element_type=jnp.float32)
    return soft_cap(logits, config.final_softcap)


def _concat_layers(routings: list) -> Routing | None:
    """Per-part `Routing`s with a leading [layers] axis (frozen and trained scans, or single
    layers) as one; None for a dense model."""
    if routings[0] is None:
        return None
    return jax.tree.map(lambda *parts: jnp.concatenate(parts), *routings)


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
    return_routing: bool = False,
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
    A mixture of experts' `moe.Routing` ([layers, ...] leaves) comes last with `return_routing`.
    """
    logits, hidden, new_cache, routing = _decoder(
        params, dtype, remat, activation_sharding, kernels, True, config, lora_scale
    ).apply({"params": _backbone(params)}, tokens, positions, cache)
    out = (logits, new_cache, hidden) if return_hidden else (logits, new_cache)
    return (*out, routing) if return_routing else out


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
    return_routing: bool = False,
    ends: jax.Array | None = None,
):
    """The final (normed) hidden states [batch, seq, hidden] of `forward` without a cache, in the
    compute dtype, without projecting to the vocabulary (see `output_head`, `project_logits`).
    `params` may be split for tuned training (`models/tuning.combine`); `lora_scale` scales their
    adapters. With `return_routing`: (hidden, `moe.Routing` or None). `ends`: the rows are prefix
    trees (`Decoder`)."""
    _, hidden, _, routing = _decoder(params, dtype, remat, activation_sharding, kernels, False, config, lora_scale).apply(
        {"params": _backbone(params)}, tokens, positions, None, ends
    )
    return (hidden, routing) if return_routing else hidden


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
    targets = tuple(name.removesuffix("_lora") for module in ("attn", "mlp", "moe") for name in layers.get(module, {})
                    if name.endswith("_lora"))
    if targets and not lora_scale:
        raise ValueError(f"the parameters carry LoRA adapters ({', '.join(targets)}) but lora_scale is 0")
    return Decoder(
        config, dtype=dtype or params["embed"]["embedding"].dtype, remat=remat,
        activation_sharding=activation_sharding, scan_layers="layers" in params, project=project,
        kernels=kernels, frozen_layers=frozen, lora_targets=targets, lora_scale=lora_scale,
    )
