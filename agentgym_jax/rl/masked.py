"""Masked reductions used by all of `rl/` (sums, means, variance, whitening, loss aggregation),
and the input checks they share.

Masks are binary (`1`/`True` = the token counts). Values at masked-out positions never reach the
result, not even as `0 * inf`: they are replaced with zeros by `jnp.where` before any arithmetic, so
padding may hold garbage (huge, `inf`) without producing NaN values or NaN gradients.
A reduction over no tokens at all is defined as 0 (not NaN).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

# How a `[batch, seq]` per-token loss becomes a scalar (the names verl and tunix use).
#   token-mean           sum of all policy-token losses / number of policy tokens in the batch
#   seq-mean-token-sum   mean over sequences of each sequence's summed policy-token loss
#   seq-mean-token-mean  mean over sequences of each sequence's mean policy-token loss
#   seq-mean-token-sum-norm  mean over sequences of each sequence's summed loss / `norm_length`,
#                        a constant (the generation budget): Dr. GRPO's length-unbiased normaliser
# The seq-mean modes average over sequences with at least one policy token: an all-masked row
# (padding, or an episode the policy never acted in) contributes nothing and does not count in the
# denominator. With no policy token in the whole batch every mode returns 0.
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def masked_sum(x: jax.Array, mask: jax.Array, axis: int | None = None) -> jax.Array:
    """Sum of `x` where `mask` is set."""
    return jnp.sum(jnp.where(mask, x, 0.0), axis=axis)


def masked_count(mask: jax.Array, axis: int | None = None) -> jax.Array:
    """Number of set mask entries, as a float."""
    return jnp.sum(jnp.asarray(mask, bool), axis=axis, dtype=jnp.float32)


def masked_mean(x: jax.Array, mask: jax.Array, axis: int | None = None) -> jax.Array:
    """Mean of `x` over the set mask entries; 0 where there are none."""
    return masked_sum(x, mask, axis) / jnp.maximum(masked_count(mask, axis), 1.0)


def masked_var(x: jax.Array, mask: jax.Array, ddof: int = 1) -> jax.Array:
    """Variance (scalar) of `x` over all set mask entries, dividing by `max(n - ddof, 1)`."""
    centered = _masked_center(x, mask)
    return masked_sum(centered**2, mask) / jnp.maximum(masked_count(mask) - ddof, 1.0)


def masked_whiten(x: jax.Array, mask: jax.Array, epsilon: float = 1e-8) -> jax.Array:
    """`(x - mean) / sqrt(var + epsilon)`, statistics over all set entries (ddof=1); 0 off mask."""
    whitened = _masked_center(x, mask) * jax.lax.rsqrt(masked_var(x, mask) + epsilon)
    return jnp.where(mask, whitened, 0.0)


def aggregate_loss(loss: jax.Array, mask: jax.Array, agg_mode: str, norm_length: float | None = None) -> jax.Array:
    """Reduces a per-token loss `[batch, seq]` to a scalar with one of `LOSS_AGG_MODES`.

    `norm_length` is the constant of "seq-mean-token-sum-norm" (required there, unused elsewhere).
    """
    if agg_mode == "token-mean":
        return masked_mean(loss, mask)
    if agg_mode == "seq-mean-token-sum-norm":
        if norm_length is None or norm_length <= 0:
            raise ValueError(f"agg_mode {agg_mode!r} needs a norm_length > 0, got {norm_length}")
        per_seq = masked_sum(loss, mask, axis=-1) / norm_length  # [batch]
    elif agg_mode == "seq-mean-token-sum":
        per_seq = masked_sum(loss, mask, axis=-1)  # [batch]
    elif agg_mode == "seq-mean-token-mean":
        per_seq = masked_mean(loss, mask, axis=-1)  # [batch]
    else:
        raise ValueError(f"unknown agg_mode {agg_mode!r}; valid: {', '.join(LOSS_AGG_MODES)}")
    return masked_mean(per_seq, jnp.any(mask, axis=-1))


def check_same_shape(**arrays: jax.Array) -> None:
    """Raises `ValueError` naming the arrays when their shapes differ (checked at trace time)."""
    shapes = {name: jnp.shape(a) for name, a in arrays.items()}
    if len(set(shapes.values())) > 1:
        raise ValueError("shape mismatch: " + ", ".join(f"{k} {v}" for k, v in shapes.items()))


def check_hparams(ok: Callable[[float], bool], requirement: str, **hparams) -> None:
    """Raises `ValueError` for a plain-number hyper-parameter failing `ok`; traced values pass."""
    for name, value in hparams.items():
        if isinstance(value, (int, float)) and not ok(value):
            raise ValueError(f"{name} must be {requirement}, got {value}")


def _masked_center(x: jax.Array, mask: jax.Array) -> jax.Array:
    """`x` minus its masked mean, computed on data shifted by one of its own entries (the masked
    maximum) so that a constant input centres to exactly 0 in float32, not to a rounding residue
    that whitening would then blow up."""
    shift = jnp.where(jnp.any(mask), jnp.max(jnp.where(mask, x, -jnp.inf)), 0.0)
    shifted = x - shift
    return shifted - masked_mean(shifted, mask)
