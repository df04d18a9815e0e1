"""PPO-family losses on token-level arrays: clipped policy surrogate, clipped value loss, entropy.

Every input is `[batch, seq]` (logits `[batch, seq, vocab]`) and aligned so that position t holds
the log-probability / value / advantage of token t. `loss_mask` is 1 only on tokens the policy
sampled; all other positions are ignored, whatever they hold. The reduction to a scalar is an
explicit `agg_mode` (one of `masked.LOSS_AGG_MODES`); metrics are token means over policy tokens.
The KL-to-reference loss term lives in `kl.py` (`kl_loss`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from agentgym_jax.rl.kl import kl_divergence
from agentgym_jax.rl.masked import aggregate_loss, check_hparams, check_same_shape, masked_mean

# Where the PPO ratio is formed: per token (PPO, DAPO) or per sequence (GSPO).
RATIO_LEVELS = ("token", "sequence")


def ppo_policy_loss(
    logprobs: jax.Array,  # [batch, seq] current policy, differentiated
    old_logprobs: jax.Array,  # [batch, seq] the policy that sampled the batch
    advantages: jax.Array,  # [batch, seq]
    loss_mask: jax.Array,  # [batch, seq]
    *,
    agg_mode: str,
    clip_eps_low: float = 0.2,
    clip_eps_high: float | None = None,
    dual_clip_c: float | None = None,
    token_weights: jax.Array | None = None,  # [batch, seq]
    ratio_level: str = "token",
    norm_length: float | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """PPO clipped surrogate `-min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)`, r = pi / pi_old.

    `clip_eps_high` defaults to `clip_eps_low` (set it higher for DAPO's clip-higher). With
    `dual_clip_c = c > 1` (dual-clip PPO), the loss of a token with A < 0 is also capped at `-c A`,
    so a huge ratio on a bad action cannot dominate the batch. `ratio_level="sequence"` is GSPO:
    every token of a row takes the row's ratio `exp(mean_t (log pi - log pi_old))`, clipped as a
    whole. `token_weights` (constants, e.g. importance weights of an off-policy correction)
    multiply each token's loss.
    Metrics: `clip_fraction` (tokens where the clipped term is the active one), `dual_clip_fraction`
    (tokens capped by the dual clip), `approx_kl` (k3 estimate of KL(pi_old || pi)).
    """
    check_same_shape(
        logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, loss_mask=loss_mask
    )
    clip_eps_high = clip_eps_low if clip_eps_high is None else clip_eps_high
    check_hparams(lambda v: v >= 0, ">= 0", clip_eps_low=clip_eps_low, clip_eps_high=clip_eps_high)
    check_hparams(lambda v: v > 1, "> 1", dual_clip_c=dual_clip_c)
    if ratio_level not in RATIO_LEVELS:
        raise ValueError(f"unknown ratio_level {ratio_level!r}; valid: {', '.join(RATIO_LEVELS)}")

    log_ratio = jnp.where(loss_mask, logprobs - old_logprobs, 0.0)
    if ratio_level == "sequence":  # GSPO: the length-normalised sequence likelihood ratio
        seq_log_ratio = masked_mean(log_ratio, loss_mask, axis=-1)  # [batch]
        log_ratio = jnp.where(loss_mask, seq_log_ratio[:, None], 0.0)
    ratio = jnp.exp(log_ratio)
    advantages = jnp.where(loss_mask, advantages, 0.0)
    unclipped = -advantages * ratio
    clipped = -advantages * jnp.clip(ratio, 1.0 - clip_eps_low, 1.0 + clip_eps_high)
    loss = jnp.maximum(unclipped, clipped)
    dual_clipped = jnp.zeros_like(loss, dtype=bool)
    if dual_clip_c is not None:
        cap = -advantages * dual_clip_c
        dual_clipped = (advantages < 0) & (loss > cap)
        loss = jnp.where(dual_clipped, cap, loss)
    if token_weights is not None:
        loss = loss * jax.lax.stop_gradient(jnp.where(loss_mask, token_weights, 0.0))

    metrics = {
        "clip_fraction": masked_mean(clipped > unclipped, loss_mask),
        "dual_clip_fraction": masked_mean(dual_clipped, loss_mask),
        "approx_kl": masked_mean(kl_divergence(old_logprobs, logprobs, loss_mask, "k3"), loss_mask),
    }
    return aggregate_loss(loss, loss_mask, agg_mode, norm_length), metrics


@dataclasses.dataclass(frozen=True)
class PolicyLoss:
    """A policy-gradient surrogate and its hyper-parameters.

    `fn(logprobs, old_logprobs, advantages, loss_mask, *, agg_mode, norm_length, token_weights,
    **hparams) -> (loss, metrics)`, every array `[batch, seq]` (see `ppo_policy_loss`).
    """

    fn: Callable[..., tuple[jax.Array, dict[str, jax.Array]]]
    hparams: tuple[str, ...] = ()  # keyword hyper-parameters a config may set (`config.algo.<name>`)


_PPO_CLIP = ("clip_eps_low", "clip_eps_high", "dual_clip_c")
# The surrogates a config names (`algo.policy_loss`). A new one is a function (in its own file) and
# one entry here; its hyper-parameters are config keys `algo.<name>`.
POLICY_LOSSES: dict[str, PolicyLoss] = {
    "ppo": PolicyLoss(ppo_policy_loss, hparams=_PPO_CLIP),  # a ratio per token (PPO, DAPO)
    "gspo": PolicyLoss(functools.partial(ppo_policy_loss, ratio_level="sequence"), hparams=_PPO_CLIP),  # per row
}


def value_loss(
    values: jax.Array,  # [batch, seq] current critic, differentiated
    old_values: jax.Array,  # [batch, seq] critic at rollout time
    returns: jax.Array,  # [batch, seq] targets
    loss_mask: jax.Array,  # [batch, seq]
    *,
    agg_mode: str,
    clip_eps_value: float = 0.5,
    norm_length: float | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Clipped value loss (PPO2 / verl): `0.5 * max((V - R)^2, (clip(V, V_old +- eps) - R)^2)`.

    Metric `value_clip_fraction`: tokens where the clipped error is the larger one.
    """
    check_same_shape(values=values, old_values=old_values, returns=returns, loss_mask=loss_mask)
    check_hparams(lambda v: v >= 0, ">= 0", clip_eps_value=clip_eps_value)
    values, old_values, returns = (
        jnp.where(loss_mask, x, 0.0) for x in (values, old_values, returns)
    )
    clipped_values = jnp.clip(values, old_values - clip_eps_value, old_values + clip_eps_value)
    unclipped_error = jnp.square(values - returns)
    clipped_error = jnp.square(clipped_values - returns)
    loss = 0.5 * aggregate_loss(jnp.maximum(unclipped_error, clipped_error), loss_mask, agg_mode, norm_length)
    return loss, {"value_clip_fraction": masked_mean(clipped_error > unclipped_error, loss_mask)}


def entropy_from_logits(logits: jax.Array) -> jax.Array:
    """Entropy of the categorical at each position, `[..., vocab] -> [...]` (finite logits)."""
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.sum(jnp.exp(logp) * logp, axis=-1)


def entropy_bonus(
    logits: jax.Array,  # [batch, seq, vocab]
    loss_mask: jax.Array,  # [batch, seq]
    *,
    agg_mode: str,
    norm_length: float | None = None,
) -> jax.Array:
    """Policy entropy over policy tokens; the caller subtracts `entropy_coef * entropy_bonus`."""
    if logits.shape[:-1] != loss_mask.shape:
        raise ValueError(f"logits {logits.shape} must be loss_mask {loss_mask.shape} + [vocab]")
    logits = jnp.where(loss_mask[..., None], logits, 0.0)  # padding garbage never reaches the grad
    return aggregate_loss(entropy_from_logits(logits), loss_mask, agg_mode, norm_length)
