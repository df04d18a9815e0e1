"""The model step the sampler calls: new tokens in, next-token logits of one position per row out.

The sampler only ever needs one position's logits per row (the last real token of an appended
chunk; the single token of a decode step). Computing `[batch, seq, vocab]` logits for a whole
prefill chunk and keeping one column wastes most of the work and memory (16 rows x 1024 tokens
x a 150k vocabulary is 10 GB of float32), so the decoder's step projects only the kept hidden
states onto the vocabulary.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from agentgym_jax.models import decoder
from agentgym_jax.models.cache import KVCache
from agentgym_jax.models.config import ModelConfig
from agentgym_jax.models.kernels import AttentionKernels

Params = Any
# (params, tokens [B, T], positions [B, T], cache) -> (logits [B, T, V], cache advanced by T)
ForwardFn = Callable[[Params, jax.Array, jax.Array, KVCache], tuple[jax.Array, KVCache]]
# (params, tokens [B, T], positions [B, T], cache, last [B]) -> (logits at `last` [B, V] float32,
# cache, the experts the token at `last` was routed to [B, layers, k] or None for a dense model)
StepFn = Callable[[Params, jax.Array, jax.Array, KVCache, jax.Array], tuple[jax.Array, KVCache, jax.Array | None]]


def _at(x: jax.Array, last: jax.Array) -> jax.Array:
    """x [B, T, ...] -> x[b, last[b]] [B, ...]."""
    return jnp.take_along_axis(x, last.reshape(-1, *[1] * (x.ndim - 1)), axis=1)[:, 0]


def _forward_step(forward_fn: ForwardFn, params, tokens, positions, cache, last):
    logits, cache = forward_fn(params, tokens, positions, cache)
    return _at(logits, last).astype(jnp.float32), cache, None


def from_forward(forward_fn: ForwardFn) -> StepFn:
    """A step for any model with the decoder's `forward` signature (keeps one column of its logits)."""
    return functools.partial(_forward_step, forward_fn)


def _decoder_step(config: ModelConfig, dtype, activation_sharding, kernels, params, tokens, positions, cache, last):
    _, cache, hidden, routing = decoder.forward(  # the unused full logits are removed by XLA's dead-code pass
        params, tokens, positions, cache, config=config, dtype=dtype,
        activation_sharding=activation_sharding, return_hidden=True, kernels=kernels, return_routing=True,
    )
    hidden = _at(hidden, last)  # [B, hidden], after the final norm
    experts = None if routing is None else _at(routing.experts.transpose(1, 2, 0, 3), last)  # [B, layers, k]
    return decoder.project_logits(hidden, decoder.output_head(params, config), config), cache, experts


def decoder_step(
    config: ModelConfig,
    *,
    dtype: jnp.dtype | None = None,
    activation_sharding: jax.sharding.Sharding | None = None,
    kernels: AttentionKernels = AttentionKernels(),
) -> StepFn:
    """The step of `models.decoder` (compute `dtype`: default the parameters' dtype)."""
    return functools.partial(_decoder_step, config, dtype, activation_sharding, kernels)
