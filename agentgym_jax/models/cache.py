"""The KV cache: an explicit pytree passed into and returned from the decoder.

Every row has its own write pointer (`index [batch]`): a chunk's real tokens go at slots
`index[b] .. index[b] + length[b]` of row b, so a row's slots hold its own tokens and nothing
else, whatever the other rows appended (no shared pointer that every row pays for). Keys and
values are stored head-major, `[layers, batch, kv_heads, max_len, head_dim]`: the layout
attention's batched dots consume, so no step transposes a layer's cache before attending.
Chunks are right-padded; the padding is written past the row's real tokens with position -1
(overwritten by the row's next chunk) and writes past `max_len` are dropped, never clamped.
Attention reads `positions`, not slot order: a query at position p sees the cached keys with
0 <= position <= p in its own row, so slots past a row's pointer (position -1) are never seen.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class KVCache:
    k: jax.Array  # [layers, batch, kv_heads, max_len, head_dim]
    v: jax.Array  # [layers, batch, kv_heads, max_len, head_dim]
    positions: jax.Array  # [batch, max_len] int32; -1 marks an empty or padded slot
    index: jax.Array  # [batch] int32; next slot to write in each row (= the row's real tokens)

    @classmethod
    def init(
        cls,
        num_layers: int,
        batch: int,
        max_len: int,
        kv_heads: int,
        head_dim: int,
        dtype: jnp.dtype = jnp.float32,
    ) -> KVCache:
        shape = (num_layers, batch, kv_heads, max_len, head_dim)
        return cls(
            k=jnp.zeros(shape, dtype),
            v=jnp.zeros(shape, dtype),
            positions=jnp.full((batch, max_len), -1, jnp.int32),
            index=jnp.zeros((batch,), jnp.int32),
        )

    @property
    def max_len(self) -> int:
        return self.positions.shape[1]

    def next_positions(self) -> jax.Array:
        """[batch] the position each row's next token takes (1 + its largest cached position)."""
        return jnp.max(self.positions, axis=1) + 1

    def written(self, k: jax.Array, v: jax.Array, positions: jax.Array) -> KVCache:
        """The cache with buffers `k, v` (the chunk already in them, see `write_rows`) and the
        chunk's `positions [batch, T]` recorded; each row's pointer moves by its real tokens."""
        return KVCache(
            k=k,
            v=v,
            positions=write_positions(self.positions, positions, self.index),
            index=self.index + jnp.sum(positions >= 0, axis=1, dtype=jnp.int32),
        )

    def slots(self, width: int) -> jax.Array:
        """[batch, width] the slot each column of a chunk of `width` tokens goes to, per row."""
        return self.index[:, None] + jnp.arange(width, dtype=jnp.int32)


def _rows(batch: int) -> jax.Array:
    return jnp.arange(batch, dtype=jnp.int32)[:, None]  # [batch, 1]


def _scatter(buf: jax.Array, *indices_and_value) -> jax.Array:
    *indices, value = indices_and_value
    return buf.at[tuple(indices)].set(value.astype(buf.dtype), mode="drop", unique_indices=True)


def write_positions(cache_positions: jax.Array, positions: jax.Array, index: jax.Array) -> jax.Array:
    """`cache_positions [batch, max_len]` with each row's chunk `positions [batch, T]` at its own
    slots `index[b] ..` (past max_len: dropped): the key positions attention sees after a write."""
    slots = index[:, None] + jnp.arange(positions.shape[1], dtype=jnp.int32)
    return _scatter(cache_positions, _rows(positions.shape[0]), slots, positions)


def write_rows(buf: jax.Array, new: jax.Array, index: jax.Array, layer: int | None = None) -> jax.Array:
    """Writes a chunk's keys or values at each row's own slots `index[b] ..` (past max_len: dropped).

    buf [batch, kv_heads, max_len, head_dim] with new [batch, kv_heads, T, head_dim]; or the
    stacked buf [layers, ...] with `layer=i` (new as above) or with new [layers, ...] (all layers).
    """
    batch, _, width, _ = new.shape[-4:]
    rows, slots = _rows(batch), index[:, None] + jnp.arange(width, dtype=jnp.int32)  # [B, 1], [B, T]
    if new.ndim == 4:  # indexed dims [B, T] come first, then kv_heads, head_dim
        lead = () if layer is None else (layer,)
        return _scatter(buf, *lead, rows, slice(None), slots, new.transpose(0, 2, 1, 3))
    return _scatter(buf, slice(None), rows, slice(None), slots, new.transpose(1, 3, 0, 2, 4))


def place_chunk_mask(cache_mask: jax.Array, mask: jax.Array, index: jax.Array) -> jax.Array:
    """cache_mask [batch, q, slots] with the chunk's own mask [batch, q, T] at each row's slots."""
    batch, _, width = mask.shape
    slots = index[:, None] + jnp.arange(width, dtype=jnp.int32)
    return _scatter(cache_mask, _rows(batch), slice(None), slots, mask.swapaxes(1, 2))


def attention_mask(query_positions: jax.Array, key_positions: jax.Array, window: jax.Array | int | None = None) -> jax.Array:
    """[batch, q, k] bool: causal by position; padded queries and keys (position -1) see nothing;
    with a sliding `window` (a scalar, traced or not), a query at p sees only keys at p - window < k.

    Apply it with a large finite negative bias, not -inf: a padded query has no visible key and
    must give finite (ignored) values, or NaNs leak into gradients through masked sums.
    """
    q = query_positions[:, :, None]
    k = key_positions[:, None, :]
    mask = (k >= 0) & (q >= 0) & (k <= q)
    return mask if window is None else mask & (q - k < window)
