"""Advantage estimators for multi-turn trajectories: GRPO, Dr. GRPO, RLOO, REINFORCE++, GAE, GiGPO.

Data layout (shared by everything in `rl/` and by the trainer). A batch of multi-turn trajectories
is stored as token-level arrays `[batch, seq]`, one row per trajectory, turns concatenated:
  loss_mask      1 only on tokens the policy sampled, including the end-of-turn token it sampled;
                 system / user / environment / template tokens and padding are 0
  token_rewards  the outcome reward on the LAST policy token of the trajectory; optional per-turn
                 rewards on the last policy token of their turn; 0 elsewhere
  old_logprobs   log-prob of each token under the policy that sampled it
  ref_logprobs   log-prob of each token under the frozen reference policy
  values         critic value at each token (PPO with GAE)
and per trajectory `[batch]`:
  group_ids      integer id of the task a trajectory answers; the n samples of one task share it
                 (GRPO / RLOO groups). Any integers, in any order, not necessarily contiguous
  scores         the trajectory's scalar outcome (by default the sum of its policy-token rewards)
and, for GiGPO, per token `[batch, seq]`:
  step_groups    the anchor state of each policy token's turn: turns of one group that start from
                 identical observations share an id (`rollout/batch.py`); -1 off the policy tokens

Only rewards on policy tokens count: every estimator reads `token_rewards` through `loss_mask`.
Each estimator returns `(advantages, returns)`, both `[batch, seq]` and 0 off the mask. The
recursions (REINFORCE++, GAE) run as a reversed `jax.lax.scan` over the sequence axis in which
an environment token passes the running quantities through unchanged, so the credit of turn t+1
reaches turn t across the environment's reply. See docs/algorithms.md for the formulas.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable

import jax
import jax.numpy as jnp

from agentgym_jax.rl.masked import check_hparams, check_same_shape, masked_sum, masked_whiten


def sequence_scores(token_rewards: jax.Array, loss_mask: jax.Array) -> jax.Array:
    """`[batch, seq] -> [batch]`: the sum of each trajectory's policy-token rewards."""
    return masked_sum(token_rewards, loss_mask, axis=-1)


def grpo(
    scores: jax.Array,  # [batch]
    loss_mask: jax.Array,  # [batch, seq]
    group_ids: jax.Array,  # [batch] int
    *,
    num_groups: int | None = None,
    epsilon: float = 1e-6,
    scale_by_std: bool = True,
) -> tuple[jax.Array, jax.Array]:
    """GRPO: `(r - mean_g) / (std_g + epsilon)` (unbiased std, ddof=1) on every policy token.

    `scale_by_std=False` gives Dr. GRPO's `r - mean_g`. A group of one trajectory gets advantage 0
    (its std is undefined and it carries no relative signal); rows without policy tokens do not
    count as members. `num_groups` bounds the number of distinct ids (a static size for the
    segment ops); it defaults to the batch size, always enough.
    """
    check_hparams(lambda v: v > 0, "> 0", epsilon=epsilon)
    centered, group_size, index, num_groups = _group_centered(
        scores, loss_mask, group_ids, num_groups
    )
    advantages = centered
    if scale_by_std:
        sum_sq = jax.ops.segment_sum(centered**2, index, num_groups)[index]  # invalid rows are 0
        std = jnp.sqrt(sum_sq / jnp.maximum(group_size - 1.0, 1.0))
        advantages = centered / (std + epsilon)
    advantages = jnp.where(group_size > 1, advantages, 0.0)
    advantages = jnp.where(loss_mask, advantages[:, None], 0.0)
    return advantages, advantages


def rloo(
    scores: jax.Array,  # [batch]
    loss_mask: jax.Array,  # [batch, seq]
    group_ids: jax.Array,  # [batch] int
    *,
    num_groups: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """RLOO: `r_i - mean_{j != i} r_j` within the group, = n/(n-1) (r_i - mean_g).

    A group of one trajectory (no other sample to compare with) gets advantage 0; rows without
    policy tokens do not count as members.
    """
    centered, group_size, _, _ = _group_centered(scores, loss_mask, group_ids, num_groups)
    leave_one_out_scale = group_size / jnp.maximum(group_size - 1.0, 1.0)
    advantages = jnp.where(group_size > 1, centered * leave_one_out_scale, 0.0)
    advantages = jnp.where(loss_mask, advantages[:, None], 0.0)
    return advantages, advantages


# How `gamma` (and GAE's `lam`) discount: once per policy token, or once per turn (the step of
# the environment's MDP: within a turn the factors are 1, between a turn's last token and the
# next turn's first they are gamma and lam).
DISCOUNTS = ("token", "turn")


def turn_ends(loss_mask: jax.Array) -> jax.Array:
    """`[batch, seq]` bool: the last policy token of each turn (a policy token followed by a
    non-policy token or the end of the row), where a turn's reward sits."""
    mask = jnp.asarray(loss_mask, bool)
    return mask & ~jnp.pad(mask[:, 1:], ((0, 0), (0, 1)))


def _discount_factors(loss_mask: jax.Array, discount: str, **factors: float) -> list[jax.Array]:
    """Per token `[batch, seq]` each factor: everywhere (token) or at turn ends, else 1 (turn)."""
    if discount not in DISCOUNTS:
        raise ValueError(f"unknown discount {discount!r}; valid: {', '.join(DISCOUNTS)}")
    at = jnp.ones(loss_mask.shape, bool) if discount == "token" else turn_ends(loss_mask)
    return [jnp.where(at, value, 1.0) for value in factors.values()]


def reinforce_plus_plus(
    token_rewards: jax.Array,  # [batch, seq]
    loss_mask: jax.Array,  # [batch, seq]
    *,
    gamma: float = 1.0,
    discount: str = "token",
    epsilon: float = 1e-8,
) -> tuple[jax.Array, jax.Array]:
    """REINFORCE++: return-to-go over policy tokens, whitened over the batch's policy tokens.

    `G_t = r_t + g_t * G_next` on a policy token, where G_next is the return of the next policy
    token (environment tokens pass it through undiscounted) and `g_t` is gamma on every token
    (`discount="token"`) or only on a turn's last token (`"turn"`); then `masked_whiten(G)`.
    Per-turn rewards sit on their turn's last token. A KL penalty in the reward is the caller's
    (`kl.apply_kl_penalty` before this).
    """
    check_same_shape(token_rewards=token_rewards, loss_mask=loss_mask)
    check_hparams(lambda v: 0 <= v <= 1, "in [0, 1]", gamma=gamma)
    check_hparams(lambda v: v > 0, "> 0", epsilon=epsilon)
    [gammas] = _discount_factors(loss_mask, discount, gamma=gamma)

    def step(running_return, inputs):  # [batch]
        reward, mask, g = inputs
        running_return = jnp.where(mask, reward + g * running_return, running_return)
        return running_return, jnp.where(mask, running_return, 0.0)

    init = jnp.zeros(token_rewards.shape[:1], _float_dtype(token_rewards))
    returns = _reverse_scan_over_seq(step, init, token_rewards, loss_mask, gammas)
    return masked_whiten(returns, loss_mask, epsilon), returns


def gae(
    token_rewards: jax.Array,  # [batch, seq]
    values: jax.Array,  # [batch, seq]
    loss_mask: jax.Array,  # [batch, seq]
    *,
    gamma: float = 1.0,
    lam: float = 1.0,
    discount: str = "token",
    whiten: bool = True,
    epsilon: float = 1e-8,
) -> tuple[jax.Array, jax.Array]:
    """GAE over the policy tokens of multi-turn episodes.

    On policy token t with next policy token t' (none after the last one: value 0, advantage 0):
    `delta_t = r_t + g_t * V_t' - V_t` and `A_t = delta_t + g_t * l_t * A_t'`, with `(g_t, l_t)`
    `(gamma, lam)` on every token (`discount="token"`) or only on a turn's last token and (1, 1)
    inside a turn (`"turn"`). Environment tokens are skipped, so the last token of turn k
    bootstraps from the first token of turn k+1; per-turn rewards sit on their turn's last token.
    Returns `(A, A + V)` on policy tokens; `whiten=True` (verl's default) whitens A over the batch
    after the returns are formed.
    """
    check_same_shape(token_rewards=token_rewards, values=values, loss_mask=loss_mask)
    check_hparams(lambda v: 0 <= v <= 1, "in [0, 1]", gamma=gamma, lam=lam)
    check_hparams(lambda v: v > 0, "> 0", epsilon=epsilon)
    gammas, lams = _discount_factors(loss_mask, discount, gamma=gamma, lam=lam)

    def step(carry, inputs):  # carry: value and advantage of the next policy token, [batch] each
        next_value, next_advantage = carry
        reward, value, mask, g, l = inputs
        advantage = reward + g * next_value - value + g * l * next_advantage
        carry = (jnp.where(mask, value, next_value), jnp.where(mask, advantage, next_advantage))
        return carry, jnp.where(mask, advantage, 0.0)

    zeros = jnp.zeros(token_rewards.shape[:1], _float_dtype(token_rewards))
    advantages = _reverse_scan_over_seq(step, (zeros, zeros), token_rewards, values, loss_mask, gammas, lams)
    returns = jnp.where(loss_mask, advantages + values, 0.0)
    if whiten:
        advantages = masked_whiten(advantages, loss_mask, epsilon)
    return advantages, returns


def gigpo(
    token_rewards: jax.Array,  # [batch, seq]
    loss_mask: jax.Array,  # [batch, seq]
    group_ids: jax.Array,  # [batch] int
    scores: jax.Array,  # [batch]
    step_groups: jax.Array,  # [batch, seq] int: each policy token's anchor state, -1 elsewhere
    *,
    gamma: float = 0.95,
    step_weight: float = 1.0,
    epsilon: float = 1e-6,
) -> tuple[jax.Array, jax.Array]:
    """GiGPO (Feng et al. 2025): GRPO's episode advantage plus `step_weight` times a step advantage.

    The step advantage compares the turns a group's episodes took from the same state (an *anchor
    state*: `step_groups`, the same id on every policy token of those turns, from identical
    observations): `(R_t - mean_s) / (std_s + epsilon)` over the turns of anchor state s, where
    `R_t = r_t + gamma * R_{t+1}` is the turn's discounted return; a state visited once gets 0.
    A move into a wall that leaves the observation unchanged is compared with what the episodes
    did next from that very state, so a wasted turn costs even in a successful episode, which
    GRPO alone reinforces with it. No critic, no extra rollouts.
    """
    check_same_shape(token_rewards=token_rewards, loss_mask=loss_mask, step_groups=step_groups)
    check_hparams(lambda v: 0 <= v <= 1, "in [0, 1]", gamma=gamma)
    check_hparams(lambda v: v >= 0, ">= 0", step_weight=step_weight)
    episode, _ = grpo(scores, loss_mask, group_ids, epsilon=epsilon)
    _, returns = reinforce_plus_plus(token_rewards, loss_mask, gamma=gamma, discount="turn")  # R_t on turn t's tokens
    segments = step_groups.size  # ids are < the batch's token count: a static bound
    ids = jnp.where(loss_mask > 0, step_groups, -1).reshape(-1)
    index = jnp.where(ids >= 0, ids, 0)
    once = (turn_ends(loss_mask) & (step_groups >= 0)).reshape(-1)  # each turn counted at its last token
    returns = returns.reshape(-1)

    def state_sum(x):  # [tokens] -> per token the sum over its anchor state's turns
        return jax.ops.segment_sum(jnp.where(once, x, 0.0), index, segments)[index]

    count = state_sum(jnp.ones_like(returns))
    top = jax.ops.segment_max(jnp.where(once, returns, -jnp.inf), index, segments)[index]
    shifted = returns - top  # an anchor state whose turns all returned the same centres to exactly 0
    centered = shifted - state_sum(shifted) / jnp.maximum(count, 1.0)
    std = jnp.sqrt(state_sum(centered**2) / jnp.maximum(count - 1.0, 1.0))
    step = jnp.where((ids >= 0) & (count > 1), centered / (std + epsilon), 0.0).reshape(loss_mask.shape)
    advantages = jnp.where(loss_mask > 0, episode + step_weight * step, 0.0)
    return advantages, advantages


@dataclasses.dataclass(frozen=True)
class Estimator:
    """An advantage estimator and what the trainer must know of it.

    `fn` takes its array inputs by name (any of `token_rewards`, `loss_mask`, `values`,
    `group_ids`, `scores`, `step_groups`, positional) and then its keyword hyper-parameters, and returns
    `(advantages, returns)`, both `[batch, seq]`.
    """

    fn: Callable[..., tuple[jax.Array, jax.Array]]
    hparams: tuple[str, ...] = ()  # keyword hyper-parameters a config may set (`config.algo.<name>`)
    needs_critic: bool = False  # reads `values`: a value model (a head or a separate critic) trains beside the policy
    needs_groups: bool = False  # its baseline is the task's group: a group needs >= 2 trained members

    @property
    def inputs(self) -> tuple[str, ...]:
        """The batch fields `fn` reads, in its order."""
        params = inspect.signature(self.fn).parameters.values()
        return tuple(p.name for p in params if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD)


# The estimators a config names (`algo.advantage`). A new one is a function (in its own file) and
# one entry here; its hyper-parameters are config keys `algo.<name>` (docs/algorithms.md).
ADVANTAGE_ESTIMATORS: dict[str, Estimator] = {
    "grpo": Estimator(grpo, hparams=("epsilon",), needs_groups=True),
    "dr_grpo": Estimator(functools.partial(grpo, scale_by_std=False), hparams=("epsilon",), needs_groups=True),
    "rloo": Estimator(rloo, needs_groups=True),
    "reinforce_plus_plus": Estimator(reinforce_plus_plus, hparams=("gamma", "discount", "epsilon")),
    "gae": Estimator(gae, hparams=("gamma", "lam", "discount", "whiten", "epsilon"), needs_critic=True),
    "gigpo": Estimator(gigpo, hparams=("gamma", "step_weight", "epsilon"), needs_groups=True),
}


def get_estimator(name: str) -> Estimator:
    """`ADVANTAGE_ESTIMATORS[name]`, or a `ValueError` naming the valid ones."""
    if name not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"unknown estimator {name!r}; valid: {', '.join(ADVANTAGE_ESTIMATORS)}")
    return ADVANTAGE_ESTIMATORS[name]


def compute_advantages(
    estimator: str,
    *,
    token_rewards: jax.Array,  # [batch, seq]
    loss_mask: jax.Array,  # [batch, seq]
    values: jax.Array | None = None,  # [batch, seq]
    group_ids: jax.Array | None = None,  # [batch]
    scores: jax.Array | None = None,  # [batch]; default: sequence_scores(token_rewards, loss_mask)
    step_groups: jax.Array | None = None,  # [batch, seq]: anchor states (`gigpo`)
    **hparams,
) -> tuple[jax.Array, jax.Array]:
    """Runs the estimator named `estimator` on the batch fields it needs, with its `hparams`.

    Raises `ValueError` for an unknown estimator, a missing input (GAE without values, GRPO without
    group ids) or a hyper-parameter the estimator does not declare.
    """
    spec = get_estimator(estimator)
    if scores is None:
        scores = sequence_scores(token_rewards, loss_mask)
    available = dict(token_rewards=token_rewards, loss_mask=loss_mask, values=values, group_ids=group_ids, scores=scores,
                     step_groups=step_groups)
    if unknown := sorted(set(hparams) - set(spec.hparams)):
        raise ValueError(f"{estimator} takes no {unknown}; valid: {sorted(spec.hparams)}")
    if missing := [field for field in spec.inputs if available[field] is None]:
        raise ValueError(f"{estimator} needs {', '.join(missing)}")
    return spec.fn(*(available[field] for field in spec.inputs), **hparams)


def _group_centered(
    scores: jax.Array, loss_mask: jax.Array, group_ids: jax.Array, num_groups: int | None
) -> tuple[jax.Array, jax.Array, jax.Array, int]:
    """Per trajectory: score minus its group mean, group size, dense group index; and num_groups.

    Rows without a policy token are left out of the statistics (centred value 0, not counted in
    the size): an episode the policy never acted in says nothing about the others' baseline.
    Arbitrary integer ids are mapped to 0..num_groups-1 with a static-size `jnp.unique`. The mean is
    taken of scores shifted by the group maximum, so an all-equal group centres to exactly 0.
    """
    scores, group_ids = jnp.asarray(scores), jnp.asarray(group_ids)
    batch = loss_mask.shape[0]
    if loss_mask.ndim != 2 or scores.shape != (batch,) or group_ids.shape != (batch,):
        raise ValueError(
            f"scores {scores.shape} and group_ids {group_ids.shape} must be [batch] and match "
            f"loss_mask {loss_mask.shape} [batch, seq]"
        )
    num_groups = batch if num_groups is None else num_groups
    if not isinstance(group_ids, jax.core.Tracer) and len(jnp.unique(group_ids)) > num_groups:
        distinct = len(jnp.unique(group_ids))
        raise ValueError(f"{distinct} distinct group ids > num_groups={num_groups}")
    _, index = jnp.unique(group_ids, return_inverse=True, size=num_groups)
    index = index.reshape(batch)
    scores = scores.astype(_float_dtype(scores))
    valid = jnp.any(loss_mask, axis=-1)  # [batch]

    def group_sum(x):  # [batch] -> the sum over each row's group of its valid rows, [batch]
        return jax.ops.segment_sum(jnp.where(valid, x, 0.0), index, num_groups)[index]

    group_size = group_sum(jnp.ones_like(scores))
    group_max = jax.ops.segment_max(jnp.where(valid, scores, -jnp.inf), index, num_groups)[index]
    shifted = jnp.where(valid, scores - group_max, 0.0)
    centered = shifted - group_sum(shifted) / jnp.maximum(group_size, 1.0)
    return jnp.where(valid, centered, 0.0), group_size, index, num_groups


def _reverse_scan_over_seq(step: Callable, init, *arrays: jax.Array) -> jax.Array:
    """Scans `step` over `[batch, seq]` arrays from the last position to the first."""
    _, outputs = jax.lax.scan(step, init, tuple(a.T for a in arrays), reverse=True)
    return outputs.T


def _float_dtype(x: jax.Array) -> jnp.dtype:
    return jnp.promote_types(x.dtype, jnp.float32)
