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
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from agentgym_jax.models.cache import KVCache, attention_mask, place_chunk_mask, write_rows
from agentgym_jax.models.config import ModelConfig, RopeConfig

Params = dict[str, Any]
_INIT = nn.initializers.normal(0.02)  # Hugging Face's initializer_range
_MASKED = float(np.finfo(np.float32).min)  # finite: a query with no visible key stays finite


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


class RMSNorm(nn.Module):
    eps: float
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), self.param_dtype)
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return scale.astype(x.dtype) * normed.astype(x.dtype)


class Attention(nn.Module):
    """Grouped-query attention; with a cache, also the chunk's keys and values to store.

    `layer=None` (under `nn.scan`): `layer_cache` is this layer's cached (k, v) [batch, kv_heads,
    slots, head_dim], read only, and the chunk's new (k, v) [batch, kv_heads, seq, head_dim] are
    returned for the caller to write. `layer=i` (layers as a Python loop): `layer_cache` is the
    whole stacked (k, v) [layers, batch, kv_heads, slots, head_dim]; the chunk is written into
    layer i in place and the updated stack is returned.
    """

    config: ModelConfig
    dtype: jnp.dtype
    param_dtype: jnp.dtype
    layer: int | None = None

    @nn.compact
    def __call__(self, x, layer_cache, cos, sin, mask, cache_mask, index):
        """x [batch, seq, hidden]; cached keys are visible by `cache_mask` [batch, seq, slots]."""
        c = self.config
        dense = dict(dtype=self.dtype, param_dtype=self.param_dtype, kernel_init=_INIT)
        q = nn.DenseGeneral((c.num_heads, c.head_dim), use_bias=c.qkv_bias, name="q_proj", **dense)(x)
        k = nn.DenseGeneral((c.num_kv_heads, c.head_dim), use_bias=c.qkv_bias, name="k_proj", **dense)(x)
        v = nn.DenseGeneral((c.num_kv_heads, c.head_dim), use_bias=c.qkv_bias, name="v_proj", **dense)(x)
        if c.qk_norm:
            q = RMSNorm(c.rms_norm_eps, self.param_dtype, name="q_norm")(q)
            k = RMSNorm(c.rms_norm_eps, self.param_dtype, name="k_norm")(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k, v = k.swapaxes(1, 2), v.swapaxes(1, 2)  # head-major, like the cache
        if layer_cache is None:
            out = grouped_attention(q, ((k, v, mask),))
            new_kv = None
        elif self.layer is None and x.shape[1] == 1:
            # decode under the scan: the cached keys (read only) and the new one, written after
            cache_k, cache_v = layer_cache
            segments = ((cache_k.astype(self.dtype), cache_v.astype(self.dtype), cache_mask), (k, v, mask))
            out, new_kv = grouped_attention(q, segments), (k, v)
        else:
            # write the chunk first (each row's slots >= its index are empty and masked), then
            # attend over the layer's slots: max_len keys, not max_len + seq (twice for a prefill).
            # Under the scan the write goes into a local copy of the layer's slice; in the loop,
            # into the stack.
            written = tuple(write_rows(buf, new, index, self.layer) for buf, new in zip(layer_cache, (k, v)))
            cache_k, cache_v = written if self.layer is None else (buf[self.layer] for buf in written)
            chunk_mask = place_chunk_mask(cache_mask, mask, index)
            out = grouped_attention(q, ((cache_k.astype(self.dtype), cache_v.astype(self.dtype), chunk_mask),))
            new_kv = (k, v) if self.layer is None else written
        out = nn.DenseGeneral(c.hidden_size, axis=(-2, -1), use_bias=c.o_bias, name="o_proj", **dense)(out)
        return out, new_kv


class MLP(nn.Module):
    config: ModelConfig
    dtype: jnp.dtype
    param_dtype: jnp.dtype

    @nn.compact
    def __call__(self, x):
        dense = dict(use_bias=False, dtype=self.dtype, param_dtype=self.param_dtype, kernel_init=_INIT)
        gate = nn.Dense(self.config.intermediate_size, name="gate_proj", **dense)(x)
        up = nn.Dense(self.config.intermediate_size, name="up_proj", **dense)(x)
        return nn.Dense(self.config.hidden_size, name="down_proj", **dense)(nn.silu(gate) * up)


class Block(nn.Module):
    """One pre-norm decoder layer; the scan carry is the residual stream [batch, seq, hidden]."""

    config: ModelConfig
    dtype: jnp.dtype
    param_dtype: jnp.dtype
    activation_sharding: jax.sharding.Sharding | None = None
    layer: int | None = None  # set when the layers run as a Python loop (see `Attention`)

    @nn.compact
    def __call__(self, x, layer_cache, cos, sin, mask, cache_mask, index):
        c, kw = self.config, dict(dtype=self.dtype, param_dtype=self.param_dtype)
        h, new_kv = Attention(c, layer=self.layer, name="attn", **kw)(
            RMSNorm(c.rms_norm_eps, self.param_dtype, name="attn_norm")(x), layer_cache, cos, sin, mask, cache_mask, index
        )
        x = x + h
        x = x + MLP(c, name="mlp", **kw)(RMSNorm(c.rms_norm_eps, self.param_dtype, name="mlp_norm")(x))
        if self.activation_sharding is not None:
            x = jax.lax.with_sharding_constraint(x, self.activation_sharding)
        return x, new_kv


class Decoder(nn.Module):
    """tokens, positions [batch, seq] (+ optional cache) -> logits [batch, seq, vocab] float32.

    `scan_layers=False` runs the layers as a Python loop over per-layer parameters `layers_<i>`
    (see `unstack_layers`) instead of `nn.scan` over the stacked `layers`.
    """

    config: ModelConfig
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32
    remat: bool = False
    activation_sharding: jax.sharding.Sharding | None = None
    scan_layers: bool = True

    @nn.compact
    def __call__(self, tokens, positions, cache: KVCache | None):
        c = self.config
        embed = nn.Embed(
            c.vocab_size, c.hidden_size, dtype=self.dtype, param_dtype=self.param_dtype,
            embedding_init=_INIT, name="embed",
        )
        x = embed(tokens)  # [batch, seq, hidden]
        if self.activation_sharding is not None:
            x = jax.lax.with_sharding_constraint(x, self.activation_sharding)
        cos, sin = rope_tables(positions, rope_inv_freq(c.rope, c.head_dim))
        mask = attention_mask(positions, positions)  # [batch, seq, seq]: the chunk's own keys
        layer_cache = cache_mask = index = None
        if cache is not None:  # the cached keys; row b's slots >= index[b] are empty (position -1)
            layer_cache, cache_mask = (cache.k, cache.v), attention_mask(positions, cache.positions)
            index = cache.index

        block = nn.remat(Block, prevent_cse=False) if self.remat else Block
        block_args = (c, self.dtype, self.param_dtype, self.activation_sharding)
        # Under the scan the cache is a read-only input (each layer reads its slice) and only the
        # chunk's new keys and values come out, [layers, batch, kv_heads, seq, head_dim]: a step
        # never copies the cache through the scan; they go in below with one in-place update.
        if self.scan_layers:
            layers = nn.scan(
                block,
                variable_axes={"params": 0},
                split_rngs={"params": True},
                in_axes=(0, nn.broadcast, nn.broadcast, nn.broadcast, nn.broadcast, nn.broadcast),
                length=c.num_layers,
            )(*block_args, name="layers")
            x, new_kv = layers(x, layer_cache, cos, sin, mask, cache_mask, index)
        else:  # each layer writes its keys into the stacked cache in place, then attends
            for i in range(c.num_layers):
                x, layer_cache = block(*block_args, layer=i, name=f"layers_{i}")(
                    x, layer_cache, cos, sin, mask, cache_mask, index
                )
        hidden = RMSNorm(c.rms_norm_eps, self.param_dtype, name="final_norm")(x)

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
            new_cache = cache.written(k, v, positions.astype(jnp.int32))
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
    remat: bool = False,
    return_hidden: bool = False,
    activation_sharding: jax.sharding.Sharding | None = None,
):
    """Runs the decoder on tokens [batch, seq] int32 at positions [batch, seq] int32 (-1 = padding).

    With a cache, row b's chunk is written at its slots `cache.index[b] ..` (right-padded rows: real
    tokens first; writes past the cache's length are dropped) and its index advances by its real
    tokens (positions >= 0). Without one, attention stays within the given rows (training).
    `dtype` is the compute dtype (default: the parameters' dtype); `remat` recomputes each layer's
    activations in the backward pass; `activation_sharding` pins the residual stream
    [batch, seq, hidden] (see `parallel.partition.activation_sharding`). `params` may have their
    layers stacked (`layers`, as initialised and loaded) or split by `unstack_layers`.
    Returns (logits [batch, seq, vocab] float32, new cache or None), plus the final hidden states
    [batch, seq, hidden] (input of `value_head`) when `return_hidden`.
    """
    backbone = {name: p for name, p in params.items() if name != "value_head"}
    dtype = dtype or backbone["embed"]["embedding"].dtype
    model = Decoder(
        config, dtype=dtype, remat=remat, activation_sharding=activation_sharding,
        scan_layers="layers" in backbone,
    )
    logits, hidden, new_cache = model.apply({"params": backbone}, tokens, positions, cache)
    return (logits, new_cache, hidden) if return_hidden else (logits, new_cache)
