"""The KV cache: an explicit pytree passed into and returned from the decoder.

All rows share one write pointer (`index`), so appending a chunk is one `dynamic_update_slice`
with static shapes. Keys and values are stored head-major, `[layers, batch, kv_heads, max_len,
head_dim]`: the layout attention's batched dots consume, so no step transposes a layer's cache
before attending. Rows of different lengths are right-padded inside a chunk; a padded slot
keeps position -1 and is never attended to. Attention reads `positions`, not slot order:
a query at position p sees the cached keys with 0 <= position <= p in its own row. This is what
lets the sampler append each episode's environment tokens (different lengths per row) and keep
sampling without recomputing the history.
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
    index: jax.Array  # [] int32; next slot to write, shared by all rows

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
            index=jnp.zeros((), jnp.int32),
        )

    @property
    def max_len(self) -> int:
        return self.positions.shape[1]

    def next_positions(self) -> jax.Array:
        """[batch] the position each row's next token takes (1 + its largest cached position)."""
        return jnp.max(self.positions, axis=1) + 1


def attention_mask(query_positions: jax.Array, key_positions: jax.Array) -> jax.Array:
    """[batch, q, k] bool: causal by position; padded queries and keys (position -1) see nothing.

    Apply it with a large finite negative bias, not -inf: a padded query has no visible key and
    must give finite (ignored) values, or NaNs leak into gradients through masked sums.
    """
    q = query_positions[:, :, None]
    k = key_positions[:, None, :]
    return (k >= 0) & (q >= 0) & (k <= q)
