"""Direct Preference Optimization (Rafailov et al., 2023) on whole multi-turn trajectories.

A pair is a chosen (successful) and a rejected (failed) trajectory of the same task. With
`delta = sum over policy tokens of (logprobs - ref_logprobs)` of a trajectory, against a frozen
reference policy,
    loss = -log sigmoid(beta * (delta_chosen - delta_rejected)),
averaged over pairs. Only tokens the policy sampled count (`loss_mask`); environment and template
tokens never enter the sums. Chosen and rejected rows are `[pairs, seq]` each and may have
different sequence lengths. A pair in which either side has no policy token (padding rows) does
not count; with no valid pair the loss is 0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from agentgym_jax.rl.masked import check_hparams, check_same_shape, masked_mean, masked_sum


def sequence_log_ratio(
    logprobs: jax.Array,  # [pairs, seq] policy log-probs of the tokens, differentiated
    ref_logprobs: jax.Array,  # [pairs, seq] frozen reference
    loss_mask: jax.Array,  # [pairs, seq]
) -> jax.Array:
    """Sum over policy tokens of `logprobs - ref_logprobs`, `[pairs]` (no gradient to the reference)."""
    check_same_shape(logprobs=logprobs, ref_logprobs=ref_logprobs, loss_mask=loss_mask)
    ref_logprobs = jax.lax.stop_gradient(ref_logprobs)
    return masked_sum(logprobs, loss_mask, axis=-1) - masked_sum(ref_logprobs, loss_mask, axis=-1)


def dpo_loss(
    chosen_logprobs: jax.Array,  # [pairs, seq_c]
    chosen_ref_logprobs: jax.Array,  # [pairs, seq_c]
    chosen_mask: jax.Array,  # [pairs, seq_c]
    rejected_logprobs: jax.Array,  # [pairs, seq_r]
    rejected_ref_logprobs: jax.Array,  # [pairs, seq_r]
    rejected_mask: jax.Array,  # [pairs, seq_r]
    *,
    beta: float = 0.1,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The DPO loss, a scalar, and metrics averaged over valid pairs.

    Metrics: `chosen_reward` and `rejected_reward` (the implicit rewards `beta * delta`),
    `reward_margin` (their difference), `reward_accuracy` (share of pairs with a positive margin).
    """
    if jnp.shape(chosen_mask)[0] != jnp.shape(rejected_mask)[0]:
        raise ValueError(f"{jnp.shape(chosen_mask)[0]} chosen rows but {jnp.shape(rejected_mask)[0]} rejected rows")
    check_hparams(lambda v: v > 0, "> 0", beta=beta)
    chosen_reward = beta * sequence_log_ratio(chosen_logprobs, chosen_ref_logprobs, chosen_mask)  # [pairs]
    rejected_reward = beta * sequence_log_ratio(rejected_logprobs, rejected_ref_logprobs, rejected_mask)
    margin = chosen_reward - rejected_reward  # [pairs]
    valid = jnp.any(chosen_mask, axis=-1) & jnp.any(rejected_mask, axis=-1)  # [pairs]
    loss = masked_mean(-jax.nn.log_sigmoid(margin), valid)
    metrics = {
        "chosen_reward": masked_mean(chosen_reward, valid),
        "rejected_reward": masked_mean(rejected_reward, valid),
        "reward_margin": masked_mean(margin, valid),
        "reward_accuracy": masked_mean(margin > 0, valid),
    }
    return loss, metrics
