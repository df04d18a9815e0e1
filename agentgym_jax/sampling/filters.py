"""The sampling distribution: temperature, top-k and top-p (nucleus) filtering, and one draw.

Log-probabilities returned with a sample are taken under the distribution the token was actually
drawn from: `log_softmax(filter_logits(logits))` (after temperature, top-k and top-p). That is the
behaviour policy of the filtered sampler. Greedy decoding is a point mass, so its log-probability
is 0. The raw log-probs (at the sampling temperature, nothing filtered; temperature 1 when greedy)
are the policy the trainer recomputes (`train/scoring.score` divides its logits by the same
temperature), so their difference measures only the sampler-vs-trainer mismatch.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from agentgym_jax.sampling.config import SamplingConfig


class Sample(NamedTuple):
    tokens: jax.Array  # [batch] int32
    logprobs: jax.Array  # [batch] float32, under the sampling distribution
    raw_logprobs: jax.Array  # [batch] float32, log_softmax(logits / temperature), unfiltered


def filter_logits(logits: jax.Array, config: SamplingConfig) -> jax.Array:
    """[batch, vocab] -> [batch, vocab] float32 logits of the sampling distribution.

    Tokens outside the top-k or the nucleus get -inf. The nucleus is the smallest set of the most
    likely tokens (after temperature and top-k) whose probability reaches `top_p`; the most likely
    token is always kept. Tokens tied with the last kept value are kept too.
    """
    x = logits.astype(jnp.float32) / config.temperature
    if not config.top_k and config.top_p >= 1.0:
        return x
    if config.top_k:  # lax.top_k returns values sorted in descending order
        candidates = jax.lax.top_k(x, min(config.top_k, x.shape[-1]))[0]  # [batch, k]
    else:
        candidates = -jnp.sort(-x, axis=-1)  # [batch, vocab], descending
    threshold = candidates[:, -1:]  # [batch, 1]
    if config.top_p < 1.0:
        probs = jax.nn.softmax(candidates, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs  # mass of strictly more likely tokens
        kept = jnp.where(mass_before < config.top_p, candidates, jnp.inf)
        threshold = jnp.maximum(threshold, jnp.min(kept, axis=-1, keepdims=True))
    return jnp.where(x >= threshold, x, -jnp.inf)


def _take(logprobs: jax.Array, tokens: jax.Array) -> jax.Array:
    return jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]


def sample(keys: jax.Array, logits: jax.Array, config: SamplingConfig) -> Sample:
    """One token per row from `logits [batch, vocab]`, with its log-probabilities.

    `keys [batch]`: one key per row, so a row's draw does not depend on which other rows share
    the batch (what lets the slot scheduler reproduce a lock-step rollout token for token).
    """
    scale = 1.0 if config.greedy else config.temperature
    raw = jax.nn.log_softmax(logits.astype(jnp.float32) / scale, axis=-1)
    if config.greedy:
        tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        return Sample(tokens, jnp.zeros(tokens.shape, jnp.float32), _take(raw, tokens))
    filtered = filter_logits(logits, config)
    tokens = jax.vmap(jax.random.categorical)(keys, filtered).astype(jnp.int32)
    return Sample(tokens, _take(jax.nn.log_softmax(filtered, axis=-1), tokens), _take(raw, tokens))
