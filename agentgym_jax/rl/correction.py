"""Off-policy corrections: importance weights of the trainer's policy against the sampler's.

The sampler and the trainer compute the same policy by two code paths (bf16 decode vs f32
training forward; later, stale sampler weights), so the tokens were drawn from a behaviour policy
mu that is close to, but not, the policy pi_old the PPO ratio is taken against. Two known fixes:

- truncated importance sampling (TIS; Yao et al. 2025, "Your efficient RL framework secretly
  brings you off-policy RL training"): weight each token's loss by `min(pi_old / mu, cap)`, the
  ratio taken per token or per sequence (`exp(sum_t log pi_old - log mu)` on every token of a row);
- decoupled PPO (Hilton et al. 2022, "Batch size-invariance for policy optimization"): the PPO
  ratio is taken against the proximal policy (pi_old, recomputed by the trainer) and each token's
  loss is weighted by `pi_old / mu`; tokens whose weight exceeds `cap` are dropped (weight 0),
  as AReaL does, instead of truncated.

Everything here is `[batch, seq]` with the usual `loss_mask`; weights are 0 off the mask.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from agentgym_jax.rl.masked import check_hparams, check_same_shape, masked_count, masked_mean, masked_sum

IS_LEVELS = ("token", "sequence")
IS_MODES = ("truncate", "drop")  # TIS truncates at the cap; decoupled PPO drops tokens above it
_MAX_LOG_WEIGHT = 80.0  # exp(80) ~ 5e34: finite in float32, far above any cap


def importance_weights(
    logprobs: jax.Array,  # [batch, seq] trainer log-probs (pi_old / proximal)
    behaviour_logprobs: jax.Array,  # [batch, seq] sampler log-probs (mu)
    loss_mask: jax.Array,  # [batch, seq]
    *,
    level: str,
    cap: float,
    mode: str,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """`pi_old / mu` per token (or per sequence), truncated at or dropped above `cap`.

    Returns the weights `[batch, seq]` (0 off the mask) and metrics over policy tokens:
    `is_weight_mean` and `is_weight_max` of the raw weights, `is_capped_fraction` (tokens whose raw
    weight exceeds `cap`) and `is_ess_fraction` (the effective sample size of the used weights over
    the token count).
    """
    check_same_shape(logprobs=logprobs, behaviour_logprobs=behaviour_logprobs, loss_mask=loss_mask)
    check_hparams(lambda v: v > 0, "> 0", cap=cap)
    if level not in IS_LEVELS:
        raise ValueError(f"unknown importance-sampling level {level!r}; valid: {', '.join(IS_LEVELS)}")
    if mode not in IS_MODES:
        raise ValueError(f"unknown importance-sampling mode {mode!r}; valid: {', '.join(IS_MODES)}")
    log_weight = jnp.where(loss_mask, logprobs - behaviour_logprobs, 0.0)
    if level == "sequence":
        log_weight = jnp.broadcast_to(masked_sum(log_weight, loss_mask, axis=-1)[:, None], log_weight.shape)
    raw = jnp.exp(jnp.minimum(log_weight, _MAX_LOG_WEIGHT))
    capped = raw > cap
    weights = jnp.minimum(raw, cap) if mode == "truncate" else jnp.where(capped, 0.0, raw)
    metrics = {
        "is_weight_mean": masked_mean(raw, loss_mask),
        "is_weight_max": jnp.max(jnp.where(loss_mask, raw, 0.0)),
        "is_capped_fraction": masked_mean(capped, loss_mask),
        # Kish's effective sample size of the weights the loss uses, as a fraction of the tokens:
        # (sum w)^2 / (n sum w^2); 1 when they are all equal, small when a few tokens dominate.
        "is_ess_fraction": masked_sum(weights, loss_mask) ** 2
        / jnp.maximum(masked_count(loss_mask) * masked_sum(weights**2, loss_mask), 1e-30),
    }
    return jnp.where(loss_mask, weights, 0.0), metrics
