"""Advantage estimators vs float64 references written here as plain loops over rows and tokens."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from rl_batches import random_loss_mask, random_token_rewards, with_garbage

from agentgym_jax.rl import advantages as adv

BATCH, SEQ = 8, 20
SEEDS = range(4)
TOL = dict(rtol=1e-5, atol=1e-5)

# Hyper-parameters that are plain numbers stay traced, so each function compiles once per shape.
GRPO = jax.jit(adv.grpo, static_argnames=("num_groups", "scale_by_std"))
RLOO = jax.jit(adv.rloo, static_argnames=("num_groups",))
REINFORCE = jax.jit(adv.reinforce_plus_plus)
GAE = jax.jit(adv.gae, static_argnames=("whiten",))
COMPUTE = jax.jit(adv.compute_advantages, static_argnames=("estimator", "whiten"))


# ---- references (float64, loops) --------------------------------------------------------------


def ref_scores(rewards, mask):
    batch, seq = rewards.shape
    return [sum(rewards[i, t] for t in range(seq) if mask[i, t]) for i in range(batch)]


def ref_group_outcome(scores, group_ids, mask, rule):
    """Broadcasts `rule(own score, scores of the other members)` onto each row's policy tokens.
    Members are the rows of the same group that hold at least one policy token."""
    out = np.zeros(mask.shape)
    for i in range(len(scores)):
        others = [
            scores[j]
            for j in range(len(scores))
            if j != i and group_ids[j] == group_ids[i] and mask[j].any()
        ]
        value = rule(scores[i], others) if others else 0.0
        for t in range(mask.shape[1]):
            if mask[i, t]:
                out[i, t] = value
    return out


def grpo_rule(eps, scale_by_std):
    def rule(r, others):
        group = [r] + others
        mean = sum(group) / len(group)
        std = math.sqrt(sum((x - mean) ** 2 for x in group) / (len(group) - 1))
        return (r - mean) / (std + eps) if scale_by_std else r - mean

    return rule


def rloo_rule(r, others):
    return r - sum(others) / len(others)


def ref_whiten(x, mask, eps):
    vals = [x[i, t] for i in range(x.shape[0]) for t in range(x.shape[1]) if mask[i, t]]
    mean = sum(vals) / len(vals)
    var = sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)
    return np.where(mask, (x - mean) / math.sqrt(var + eps), 0.0)


def ref_reinforce_returns(rewards, mask, gamma):
    returns = np.zeros(mask.shape)
    for i in range(mask.shape[0]):
        g = 0.0
        for t in reversed(range(mask.shape[1])):
            if mask[i, t]:
                g = rewards[i, t] + gamma * g
                returns[i, t] = g
    return returns


def ref_gae(rewards, values, mask, gamma, lam):
    """Walks each row's list of policy-token positions: the next policy token is the next entry."""
    advantages = np.zeros(mask.shape)
    for i in range(mask.shape[0]):
        positions = [t for t in range(mask.shape[1]) if mask[i, t]]
        next_value, next_adv = 0.0, 0.0
        for t in reversed(positions):
            delta = rewards[i, t] + gamma * next_value - values[i, t]
            advantages[i, t] = delta + gamma * lam * next_adv
            next_value, next_adv = values[i, t], advantages[i, t]
    returns = np.where(mask, advantages + values, 0.0)
    return advantages, returns


# ---- helpers ------------------------------------------------------------------------------------


def batch(seed):
    rng = np.random.default_rng(seed)
    mask = random_loss_mask(rng, BATCH, SEQ)
    rewards = random_token_rewards(rng, mask)
    # Non-contiguous ids in random order; with 8 rows over 4 ids, groups of one occur.
    group_ids = rng.choice([1000, 3, 42, 17], size=BATCH)
    group_ids[0] = 99  # always one singleton group
    values = with_garbage(rng, rng.normal(size=mask.shape), mask)
    return rng, mask, rewards, group_ids, values


def f32(*xs):
    return [jnp.asarray(x, jnp.float32) for x in xs]


# ---- GRPO / Dr. GRPO / RLOO ---------------------------------------------------------------------


@pytest.mark.parametrize("scale_by_std", [True, False])
def test_grpo_matches_reference(scale_by_std):
    for seed in SEEDS:
        _, mask, rewards, group_ids, _ = batch(seed)
        scores = ref_scores(rewards, mask)
        got, returns = GRPO(
            jnp.asarray(scores, jnp.float32),
            jnp.asarray(mask),
            jnp.asarray(group_ids),
            scale_by_std=scale_by_std,
            num_groups=6,
        )
        want = ref_group_outcome(scores, group_ids, mask, grpo_rule(1e-6, scale_by_std))
        np.testing.assert_allclose(got, want, **TOL)
        np.testing.assert_array_equal(got, returns)
        assert np.all(np.asarray(got)[0] == 0.0)  # the singleton group


def test_grpo_all_equal_group_is_exactly_zero():
    mask = np.ones((5, 3), bool)
    scores = jnp.asarray([0.3, 0.3, 0.3, 0.7, 0.1], jnp.float32)  # 0.3 is not exact in binary
    got, _ = GRPO(scores, jnp.asarray(mask), jnp.asarray([4, 4, 4, 9, 9]))
    assert np.all(np.isfinite(got))
    np.testing.assert_array_equal(np.asarray(got)[:3], 0.0)
    rule = grpo_rule(1e-6, scale_by_std=True)
    want = ref_group_outcome([0.3, 0.3, 0.3, 0.7, 0.1], [4, 4, 4, 9, 9], mask, rule)
    np.testing.assert_allclose(got, want, **TOL)


@pytest.mark.parametrize("epsilon", [1e-6, 0.5])
def test_grpo_epsilon_on_a_tiny_std(epsilon):
    """Rewards 1e-6 apart: the std (7.07e-7) is of the order of the default epsilon."""
    scores = [0.0, 1e-6]
    mask = np.ones((2, 1), bool)
    got, _ = GRPO(
        jnp.asarray(scores, jnp.float32), jnp.asarray(mask), jnp.asarray([0, 0]), epsilon=epsilon
    )
    want = ref_group_outcome(scores, [0, 0], mask, grpo_rule(epsilon, True))
    np.testing.assert_allclose(got, want, **TOL)
    assert abs(float(got[1, 0]) - 5e-7 / (math.sqrt(2) * 5e-7 + epsilon)) < 1e-5


def test_rloo_matches_reference():
    for seed in SEEDS:
        _, mask, rewards, group_ids, _ = batch(seed)
        scores = ref_scores(rewards, mask)
        got, _ = RLOO(jnp.asarray(scores, jnp.float32), jnp.asarray(mask), jnp.asarray(group_ids))
        want = ref_group_outcome(scores, group_ids, mask, rloo_rule)
        np.testing.assert_allclose(got, want, **TOL)
    equal, _ = RLOO(jnp.asarray([0.3, 0.3, 0.3]), jnp.ones((3, 2), bool), jnp.asarray([5, 5, 5]))
    np.testing.assert_array_equal(equal, 0.0)


def test_rows_without_policy_tokens_are_not_group_members():
    """An episode the policy never acted in (row 2), whatever its score, leaves the others alone."""
    mask = np.array([[1, 1], [1, 0], [0, 0], [0, 1]], bool)
    group_ids = jnp.asarray([7, 7, 7, 3])
    for garbage_score in (0.0, 1e30, np.nan):
        scores = jnp.asarray([1.0, 0.0, garbage_score, 5.0], jnp.float32)
        got, _ = GRPO(scores, jnp.asarray(mask), group_ids)
        want = ref_group_outcome([1.0, 0.0, 0.0, 5.0], [7, 7, 7, 3], mask, grpo_rule(1e-6, True))
        np.testing.assert_allclose(got, want, **TOL)
        assert abs(float(got[0, 0]) - 1 / (math.sqrt(0.5) + 1e-6) / 2) < 1e-5  # a group of two
        got, _ = RLOO(scores, jnp.asarray(mask), group_ids)
        np.testing.assert_allclose(got, [[1, 1], [-1, 0], [0, 0], [0, 0]], **TOL)


def test_group_ids_beyond_num_groups_are_refused():
    with pytest.raises(ValueError, match="3 distinct group ids > num_groups=2"):
        adv.grpo(jnp.zeros(3), jnp.ones((3, 2)), jnp.asarray([1, 2, 3]), num_groups=2)
    with pytest.raises(ValueError, match="must be \\[batch\\]"):
        adv.rloo(jnp.zeros(4), jnp.ones((3, 2)), jnp.asarray([1, 2, 3]))


# ---- REINFORCE++ / GAE --------------------------------------------------------------------------


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_plus_plus_matches_reference(gamma):
    for seed in SEEDS:
        _, mask, rewards, _, _ = batch(seed)
        got_adv, got_returns = REINFORCE(*f32(rewards), jnp.asarray(mask), gamma=gamma)
        want_returns = ref_reinforce_returns(rewards, mask, gamma)
        np.testing.assert_allclose(got_returns, want_returns, **TOL)
        np.testing.assert_allclose(got_adv, ref_whiten(want_returns, mask, 1e-8), **TOL)


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.9, 0.8), (0.99, 0.0)])
def test_gae_matches_reference(gamma, lam):
    for seed in SEEDS:
        _, mask, rewards, _, values = batch(seed)
        inputs = (*f32(rewards, values), jnp.asarray(mask))
        want_adv, want_returns = ref_gae(rewards, values, mask, gamma, lam)
        got_adv, got_returns = GAE(*inputs, gamma=gamma, lam=lam, whiten=False)
        np.testing.assert_allclose(got_adv, want_adv, **TOL)
        np.testing.assert_allclose(got_returns, want_returns, **TOL)
        whitened, returns = GAE(*inputs, gamma=gamma, lam=lam, whiten=True)
        np.testing.assert_allclose(whitened, ref_whiten(want_adv, mask, 1e-8), **TOL)
        np.testing.assert_allclose(returns, want_returns, **TOL)  # formed before whitening


def test_outcome_reward_reaches_every_policy_token():
    """AgentGym-RL's fault: a reward on a masked token is lost. Ours sits on the last policy token
    and the recursions carry it across environment tokens to every earlier turn."""
    mask = np.array(
        [[0, 1, 1, 0, 0, 1, 1, 1, 0, 1, 0, 0], [0, 1, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0]], bool
    )
    rewards = np.zeros(mask.shape)
    rewards[0, 9], rewards[1, 4] = 1.0, 0.0  # outcome rewards on each row's last policy token
    gamma = 0.9
    zeros = np.zeros(mask.shape)
    got, _ = GAE(*f32(rewards, zeros), jnp.asarray(mask), gamma=gamma, lam=1.0, whiten=False)
    # With zero values and lam=1, A_t = gamma^(number of later policy tokens) * reward.
    later = np.cumsum(mask[0][::-1])[::-1] - 1
    np.testing.assert_allclose(np.asarray(got)[0], np.where(mask[0], gamma**later, 0.0), **TOL)
    assert np.all(np.asarray(got)[0][mask[0]] > 0)
    _, returns = REINFORCE(*f32(rewards), jnp.asarray(mask), gamma=gamma)
    np.testing.assert_allclose(np.asarray(returns)[0], np.where(mask[0], gamma**later, 0.0), **TOL)
    # The contract: a reward on an environment token does not count (the rollout puts none there).
    misplaced = np.zeros(mask.shape)
    misplaced[0, 10] = 1.0
    got, _ = GAE(*f32(misplaced, zeros), jnp.asarray(mask), gamma=gamma, lam=1.0, whiten=False)
    np.testing.assert_array_equal(got, 0.0)


@jax.jit
def all_estimators(token_rewards, loss_mask, values, group_ids, step_groups):
    return {
        name: adv.compute_advantages(
            name,
            token_rewards=token_rewards,
            loss_mask=loss_mask,
            values=values,
            group_ids=group_ids,
            step_groups=step_groups,
        )
        for name in adv.ADVANTAGE_ESTIMATORS
    }


def test_all_masked_batch_gives_zeros_not_nan():
    ones = jnp.ones((3, 5))
    results = all_estimators(ones, jnp.zeros((3, 5), bool), ones, jnp.asarray([0, 0, 1]), jnp.zeros((3, 5), jnp.int32))
    assert set(results) == set(adv.ADVANTAGE_ESTIMATORS)
    for advantages, returns in results.values():
        np.testing.assert_array_equal(advantages, 0.0)
        np.testing.assert_array_equal(returns, 0.0)


# ---- registry -----------------------------------------------------------------------------------


def test_compute_advantages_dispatches_with_default_scores():
    _, mask, rewards, group_ids, values = batch(0)
    inputs = dict(token_rewards=jnp.asarray(rewards, jnp.float32), loss_mask=jnp.asarray(mask))
    got, _ = COMPUTE("dr_grpo", group_ids=jnp.asarray(group_ids), **inputs)
    want = ref_group_outcome(ref_scores(rewards, mask), group_ids, mask, grpo_rule(0.0, False))
    np.testing.assert_allclose(got, want, **TOL)
    values32 = jnp.asarray(values, jnp.float32)
    got, _ = COMPUTE("gae", values=values32, gamma=0.9, lam=0.5, whiten=False, **inputs)
    np.testing.assert_allclose(got, ref_gae(rewards, values, mask, 0.9, 0.5)[0], **TOL)


def test_compute_advantages_rejects_bad_requests():
    inputs = dict(token_rewards=jnp.zeros((2, 3)), loss_mask=jnp.ones((2, 3)))
    with pytest.raises(ValueError, match="unknown estimator 'ppo'; valid: grpo, dr_grpo"):
        adv.compute_advantages("ppo", **inputs)
    with pytest.raises(ValueError, match="gae needs values"):
        adv.compute_advantages("gae", **inputs)
    with pytest.raises(ValueError, match="grpo needs group_ids"):
        adv.compute_advantages("grpo", **inputs)
    with pytest.raises(ValueError, match=r"takes no \['lambda_'\]"):
        adv.compute_advantages("gae", values=jnp.zeros((2, 3)), lambda_=0.9, **inputs)
    with pytest.raises(ValueError, match=r"takes no \['scale_by_std'\]"):
        adv.compute_advantages("dr_grpo", group_ids=jnp.zeros(2, int), scale_by_std=True, **inputs)
    with pytest.raises(ValueError, match="gamma must be in"):
        adv.reinforce_plus_plus(inputs["token_rewards"], inputs["loss_mask"], gamma=1.5)
    with pytest.raises(ValueError, match="shape mismatch"):
        adv.gae(jnp.zeros((2, 3)), jnp.zeros((2, 4)), jnp.ones((2, 3)))


# ---- dense (per-turn) rewards: a real batch of multi-turn trajectories ------------------------


def dense_trajectory(group_id, turn_lengths, rewards, seed):
    """prompt(3) then per turn its policy ids and 2 environment ids; reward after every turn."""
    from agentgym_jax.rollout.trajectory import Trajectory

    rng = np.random.default_rng(seed)
    ids, mask, spans = [1, 2, 3], [0, 0, 0], []
    for k, n in enumerate(turn_lengths):
        spans.append((len(ids), len(ids) + n))
        ids += [int(x) for x in rng.integers(10, 60, n)]
        mask += [1] * n
        if k < len(turn_lengths) - 1:
            ids += [4, 5]
            mask += [0, 0]
    return Trajectory(task_id=group_id, env="room", group_id=group_id, token_ids=ids, loss_mask=mask,
                      logprobs=[0.0] * len(ids), turn_spans=spans, turn_rewards=list(rewards),
                      reward=float(sum(rewards)), status="success")


def dense_batch():
    from agentgym_jax.rollout.batch import make_token_batch

    trajectories = [
        dense_trajectory(0, [3, 2, 4], [0.25, 0.0, 0.5], 0),
        dense_trajectory(0, [2, 2], [0.125, -0.25], 1),
        dense_trajectory(1, [1, 3, 2, 2], [0.5, 0.25, 0.0, 1.0], 2),
        dense_trajectory(1, [4], [0.75], 3),
    ]
    return trajectories, make_token_batch(trajectories)


def turns_of(t):
    return [list(range(s, e)) for s, e in t.turn_spans]


def ref_turn_returns(t, gamma):
    """Return of each turn, `sum_{j >= k} gamma^(j-k) r_j`, on each of its tokens."""
    out = {}
    for k, positions in enumerate(turns_of(t)):
        g = sum(gamma ** (j - k) * r for j, r in enumerate(t.turn_rewards) if j >= k)
        out.update(dict.fromkeys(positions, g))
    return out


def ref_turn_gae(t, values, gamma, lam):
    """Turn-level GAE in closed form: inside turn k every token gets
    `r_k + gamma V(first token of turn k+1) - V(token) + gamma lam A(first token of turn k+1)`."""
    out, next_first_value, next_first_adv = {}, 0.0, 0.0
    for k, positions in reversed(list(enumerate(turns_of(t)))):
        r = t.turn_rewards[k]
        for p in positions:
            out[p] = r + gamma * next_first_value - values[p] + gamma * lam * next_first_adv
        next_first_value, next_first_adv = values[positions[0]], out[positions[0]]
    return out


def as_array(per_row, shape):
    out = np.zeros(shape)
    for i, entries in enumerate(per_row):
        for p, v in entries.items():
            out[i, p] = v
    return out


@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (0.9, 0.8)])
def test_dense_rewards_per_turn_match_references(gamma, lam):
    trajectories, b = dense_batch()
    mask = np.asarray(b.loss_mask) > 0
    rewards = np.asarray(b.token_rewards, np.float64)
    for i, t in enumerate(trajectories):  # each turn's reward on its last policy token, nothing else
        want = np.zeros(mask.shape[1])
        for (_, end), r in zip(t.turn_spans, t.turn_rewards):
            want[end - 1] = r
        np.testing.assert_array_equal(rewards[i], want)
    values = np.random.default_rng(7).normal(size=mask.shape).astype(np.float32).astype(np.float64)
    r32, m, v32 = f32(rewards, mask, values)

    # token discounting: the token-level references
    _, returns = REINFORCE(r32, m, gamma=gamma)
    np.testing.assert_allclose(returns, ref_reinforce_returns(rewards, mask, gamma), **TOL)
    advantages, _ = GAE(r32, v32, m, gamma=gamma, lam=lam, whiten=False)
    np.testing.assert_allclose(advantages, ref_gae(rewards, values, mask, gamma, lam)[0], **TOL)

    # turn discounting: the per-turn references
    _, returns = adv.reinforce_plus_plus(r32, m, gamma=gamma, discount="turn")
    want = as_array([ref_turn_returns(t, gamma) for t in trajectories], mask.shape)
    np.testing.assert_allclose(returns, want, **TOL)
    advantages, _ = adv.gae(r32, v32, m, gamma=gamma, lam=lam, discount="turn", whiten=False)
    want = as_array([ref_turn_gae(t, values[i], gamma, lam) for i, t in enumerate(trajectories)], mask.shape)
    np.testing.assert_allclose(advantages, want, **TOL)

    # GRPO and RLOO: the episode return, whatever the turn it was earned in
    episode_returns = [t.reward for t in trajectories]
    np.testing.assert_allclose(b.scores, episode_returns)
    advantages, _ = GRPO(*f32(b.scores, mask), b.group_ids)
    want = ref_group_outcome(episode_returns, np.asarray(b.group_ids), mask, grpo_rule(1e-6, True))
    np.testing.assert_allclose(advantages, want, **TOL)
    advantages, _ = COMPUTE("rloo", token_rewards=r32, loss_mask=m, group_ids=b.group_ids)
    np.testing.assert_allclose(advantages, ref_group_outcome(episode_returns, np.asarray(b.group_ids), mask, rloo_rule), **TOL)


def test_turn_discounting_differs_from_token_discounting_and_bad_names_are_refused():
    _, b = dense_batch()
    r32, m = f32(b.token_rewards, b.loss_mask)
    _, by_token = adv.reinforce_plus_plus(r32, m, gamma=0.9)
    _, by_turn = adv.reinforce_plus_plus(r32, m, gamma=0.9, discount="turn")
    assert np.abs(np.asarray(by_token) - np.asarray(by_turn)).max() > 0.05
    with pytest.raises(ValueError, match="unknown discount 'step'; valid: token, turn"):
        adv.reinforce_plus_plus(r32, m, discount="step")


# ---- GiGPO: step-level groups of anchor states ---------------------------------------------------


def episode(group_id, turns, seed):
    """A prompt (ids 1, 2, 3), then per turn `(observation ids, action length, reward)`: the
    observation (none before the first turn: the prompt is its state) and the policy's action."""
    from agentgym_jax.rollout.trajectory import Trajectory

    rng = np.random.default_rng(seed)
    ids, mask, spans, rewards = [1, 2, 3], [0, 0, 0], [], []
    for observation, length, reward in turns:
        ids += list(observation)
        mask += [0] * len(observation)
        spans.append((len(ids), len(ids) + length))
        ids += [int(x) for x in rng.integers(10, 60, length)]
        mask += [1] * length
        rewards.append(reward)
    return Trajectory(task_id=group_id, env="room", group_id=group_id, token_ids=ids, loss_mask=mask,
                      logprobs=[0.0] * len(ids), turn_spans=spans, turn_rewards=rewards,
                      reward=float(sum(rewards)), status="success" if sum(rewards) > 0 else "failure")


# Group 0: a task from the prompt's state; observation (7,) is a cell next to a wall, (8,) the goal's
# neighbour. Episode a bumps the wall once ((7,) again), b walks straight, c fails. Group 1 sees the
# same observation ids (a different task: never the same anchor state as group 0's).
GIGPO_EPISODES = [
    episode(0, [((), 2, 0.0), ((4, 7), 3, 0.0), ((4, 7), 2, 0.0), ((4, 8), 1, 1.0)], 0),  # a: a no-op at (7,)
    episode(0, [((), 3, 0.0), ((4, 7), 2, 0.0), ((4, 8), 2, 1.0)], 1),  # b
    episode(0, [((), 1, 0.0), ((4, 9), 2, 0.0), ((4, 9), 2, 0.0)], 2),  # c: elsewhere, fails
    episode(1, [((), 2, 0.0), ((4, 7), 1, 0.5)], 3),
    episode(1, [((), 2, 0.0), ((4, 7), 3, 0.0)], 4),
]


def ref_gigpo(trajectories, gamma, step_weight, eps):
    """GiGPO in float64 from the trajectories themselves: GRPO's episode advantage, plus per turn
    the standardised discounted return among the turns of its group taken from the same
    observation ids (since the previous turn), a state seen once adding 0."""
    episode_returns = np.array([t.reward for t in trajectories])
    groups = np.array([t.group_id for t in trajectories])
    turns = []  # (row, span, anchor, return)
    for row, t in enumerate(trajectories):
        previous = 0
        for k, (start, end) in enumerate(t.turn_spans):
            anchor = (t.group_id, tuple(t.token_ids[previous:start]))
            ret = sum(gamma ** (j - k) * r for j, r in enumerate(t.turn_rewards) if j >= k)
            turns.append((row, (start, end), anchor, ret))
            previous = end
    seq = max(len(t.token_ids) for t in trajectories)
    out = np.zeros((len(trajectories), seq))
    for row, (start, end), anchor, ret in turns:
        same = np.array([r for _, _, a, r in turns if a == anchor])
        members = episode_returns[groups == groups[row]]
        episode_adv = (episode_returns[row] - members.mean()) / (members.std(ddof=1) + eps)
        step_adv = (ret - same.mean()) / (same.std(ddof=1) + eps) if len(same) > 1 else 0.0
        out[row, start:end] = episode_adv + step_weight * step_adv
    return out


def test_anchor_states_are_shared_by_turns_from_the_same_observation_within_a_group():
    from agentgym_jax.rollout.batch import make_token_batch

    b = make_token_batch(GIGPO_EPISODES, anchor_states=True)
    ids = np.asarray(b.step_groups)
    first = lambda row, k: ids[row, GIGPO_EPISODES[row].turn_spans[k][0]]  # noqa: E731
    assert first(0, 0) == first(1, 0) == first(2, 0) != first(3, 0) == first(4, 0)  # the prompt: one state a group
    assert first(0, 1) == first(0, 2) == first(1, 1) != first(3, 1)  # (7,): a's bump, a again, b; group 1's is its own
    assert first(0, 3) == first(1, 2) and first(2, 1) == first(2, 2)  # (8,) in a and b; c's (9,) twice
    assert len({first(r, k) for r, t in enumerate(GIGPO_EPISODES) for k in range(len(t.turn_spans))}) == 6
    mask = np.asarray(b.loss_mask) > 0
    assert np.all(ids[~mask] == -1) and np.all(ids[mask] >= 0)  # every policy token and only they
    assert make_token_batch(GIGPO_EPISODES).step_groups is None  # built only when asked for


@pytest.mark.parametrize("gamma, step_weight", [(0.95, 1.0), (1.0, 0.5)])
def test_gigpo_matches_a_float64_reference(gamma, step_weight):
    from agentgym_jax.rollout.batch import make_token_batch

    b = make_token_batch(GIGPO_EPISODES, anchor_states=True)
    got, returns = COMPUTE("gigpo", token_rewards=b.token_rewards, loss_mask=b.loss_mask, group_ids=b.group_ids,
                           step_groups=b.step_groups, gamma=gamma, step_weight=step_weight)
    want = ref_gigpo(GIGPO_EPISODES, gamma, step_weight, 1e-6)  # [rows, longest]; the batch pads to its bucket
    np.testing.assert_allclose(got, np.pad(want, ((0, 0), (0, got.shape[1] - want.shape[1]))), **TOL)
    np.testing.assert_array_equal(got, returns)


def test_gigpo_makes_a_no_op_cost_where_grpo_rewards_it():
    """Episode a succeeds after bumping a wall: GRPO gives the bump the advantage of the success;
    GiGPO compares it with the moves taken from the same state and gives it less than the move
    that left the state, and less than GRPO did."""
    from agentgym_jax.rollout.batch import make_token_batch

    b = make_token_batch(GIGPO_EPISODES, anchor_states=True)
    inputs = dict(token_rewards=b.token_rewards, loss_mask=b.loss_mask, group_ids=b.group_ids)
    gigpo, _ = COMPUTE("gigpo", step_groups=b.step_groups, gamma=0.95, **inputs)
    grpo, _ = COMPUTE("grpo", **inputs)
    bump, leave = GIGPO_EPISODES[0].turn_spans[1][0], GIGPO_EPISODES[0].turn_spans[2][0]
    assert grpo[0, bump] == grpo[0, leave] > 0
    assert gigpo[0, bump] < gigpo[0, leave] and gigpo[0, bump] < grpo[0, bump]


def test_gigpo_turns_that_all_return_the_same_add_exactly_nothing():
    from agentgym_jax.rollout.batch import make_token_batch

    same = [episode(0, [((), 2, 0.0), ((4, 7), 2, 0.3)], s) for s in range(3)]
    b = make_token_batch(same + [episode(0, [((), 2, 0.0), ((4, 9), 2, 0.7)], 3)], anchor_states=True)
    inputs = dict(token_rewards=b.token_rewards, loss_mask=b.loss_mask, group_ids=b.group_ids)
    gigpo, _ = COMPUTE("gigpo", step_groups=b.step_groups, gamma=0.95, **inputs)
    grpo, _ = COMPUTE("grpo", **inputs)
    turn = same[0].turn_spans[1][0]  # (7,) from three episodes, each returning 0.3: no step signal
    np.testing.assert_array_equal(np.asarray(gigpo)[:3, turn], np.asarray(grpo)[:3, turn])
    with pytest.raises(ValueError, match="gigpo needs step_groups"):
        adv.compute_advantages("gigpo", **inputs)
    with pytest.raises(ValueError, match="step_weight must be >= 0"):
        adv.compute_advantages("gigpo", step_groups=b.step_groups, step_weight=-1.0, **inputs)
