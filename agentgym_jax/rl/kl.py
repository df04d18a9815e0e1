"""KL divergence to a frozen reference policy, per token, from sampled-token log-probabilities.

With `log_ratio = logprobs - ref_logprobs` on tokens sampled from the current policy, Schulman's
estimators ("Approximating KL divergence", 2020) of KL(policy || reference) are
  k1 = log_ratio                                   unbiased, high variance, can be negative
  k2 = log_ratio**2 / 2                            biased, low variance, >= 0
  k3 = exp(-log_ratio) + log_ratio - 1             unbiased, low variance, >= 0
and "low_var_kl" is k3 clamped to [-10, 10], as verl does (the clamp only bites from above, since
k3 >= 0; it caps the penalty of tokens the reference finds very unlikely).

The KL is used either as a loss term (`kl_loss`, GRPO style) or subtracted from the token rewards
before the advantages are computed (`apply_kl_penalty`, PPO/REINFORCE++ style).
Arrays are `[batch, seq]`; `loss_mask` is 1 on policy tokens and the KL is 0 everywhere else.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from agentgym_jax.rl.masked import aggregate_loss, check_same_shape


def k1(logprobs: jax.Array, ref_logprobs: jax.Array) -> jax.Array:
    """`log p - log q`."""
    return logprobs - ref_logprobs


def k2(logprobs: jax.Array, ref_logprobs: jax.Array) -> jax.Array:
    """`(log p - log q)**2 / 2`."""
    return 0.5 * jnp.square(logprobs - ref_logprobs)


def k3(logprobs: jax.Array, ref_logprobs: jax.Array) -> jax.Array:
    """`q/p - log(q/p) - 1`."""
    log_ref_ratio = ref_logprobs - logprobs
    return jnp.exp(log_ref_ratio) - log_ref_ratio - 1.0


def low_var_kl(logprobs: jax.Array, ref_logprobs: jax.Array) -> jax.Array:
    """k3 clamped to [-10, 10] (verl's `low_var_kl`)."""
    return jnp.clip(k3(logprobs, ref_logprobs), -10.0, 10.0)


KL_ESTIMATORS: dict[str, Callable[[jax.Array, jax.Array], jax.Array]] = {
    "k1": k1,
    "k2": k2,
    "k3": k3,
    "low_var_kl": low_var_kl,
}


def kl_divergence(
    logprobs: jax.Array,  # [batch, seq]
    ref_logprobs: jax.Array,  # [batch, seq]
    loss_mask: jax.Array,  # [batch, seq]
    estimator: str,
) -> jax.Array:
    """Per-token KL estimate `[batch, seq]` on policy tokens, 0 elsewhere."""
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {estimator!r}; valid: {', '.join(KL_ESTIMATORS)}")
    check_same_shape(logprobs=logprobs, ref_logprobs=ref_logprobs, loss_mask=loss_mask)
    # Zero both inputs off the mask first: every estimator is 0 at equal inputs, and exp() of
    # padding garbage can neither overflow nor poison the gradient.
    kl = KL_ESTIMATORS[estimator](
        jnp.where(loss_mask, logprobs, 0.0), jnp.where(loss_mask, ref_logprobs, 0.0)
    )
    return jnp.where(loss_mask, kl, 0.0)


def kl_loss(
    logprobs: jax.Array,  # [batch, seq] current policy, differentiated
    ref_logprobs: jax.Array,  # [batch, seq] frozen reference
    loss_mask: jax.Array,  # [batch, seq]
    *,
    estimator: str,
    agg_mode: str,
    norm_length: float | None = None,
) -> jax.Array:
    """KL to the reference as a scalar loss term (added with weight `kl_coef` by the caller)."""
    kl = kl_divergence(logprobs, ref_logprobs, loss_mask, estimator)
    return aggregate_loss(kl, loss_mask, agg_mode, norm_length)


def apply_kl_penalty(
    token_rewards: jax.Array,  # [batch, seq]
    old_logprobs: jax.Array,  # [batch, seq] the policy that sampled the batch
    ref_logprobs: jax.Array,  # [batch, seq]
    loss_mask: jax.Array,  # [batch, seq]
    *,
    kl_coef: float,
    estimator: str,
) -> tuple[jax.Array, jax.Array]:
    """KL-in-reward: `token_rewards - kl_coef * kl` on policy tokens.

    Returns the penalised rewards `[batch, seq]` and the per-token KL `[batch, seq]` (for metrics).
    Rewards off the mask are returned unchanged.
    """
    check_same_shape(token_rewards=token_rewards, loss_mask=loss_mask)
    kl = kl_divergence(old_logprobs, ref_logprobs, loss_mask, estimator)
    return token_rewards - kl_coef * kl, kl
