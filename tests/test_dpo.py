"""DPO: the loss and its gradient vs float64 loop references; pair construction from trajectories."""

import math
import random

import jax
import numpy as np
import pytest
from rl_batches import random_loss_mask, with_garbage

from agentgym_jax.envs.protocol import EpisodeStatus as S
from agentgym_jax.rl import dpo
from agentgym_jax.rollout.trajectory import Trajectory
from agentgym_jax.train import dpo_pairs

PAIRS, SEQ_C, SEQ_R = 6, 24, 17


@jax.jit
def loss_and_grads(pc, rc, mc, pr, rr, mr, beta):
    """Loss, metrics and gradients w.r.t. (chosen, rejected, chosen reference) log-probs; one compile."""

    def loss(c, r, ref_c):
        return dpo.dpo_loss(c, ref_c, mc, r, rr, mr, beta=beta)

    (value, metrics), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(pc, pr, rc)
    return value, metrics, grads


def reference(pc, rc, mc, pr, rr, mr, beta):
    """Loss, per-pair margins and d loss / d policy log-probs, in float64 loops."""
    margins, valid = [], []
    for i in range(len(mc)):
        delta_c = sum(float(pc[i, t]) - float(rc[i, t]) for t in range(mc.shape[1]) if mc[i, t])
        delta_r = sum(float(pr[i, t]) - float(rr[i, t]) for t in range(mr.shape[1]) if mr[i, t])
        margins.append(beta * (delta_c - delta_r))
        valid.append(bool(mc[i].any() and mr[i].any()))
    n = sum(valid)
    loss = sum(math.log1p(math.exp(-m)) for m, v in zip(margins, valid) if v) / max(n, 1)
    grad_c, grad_r = np.zeros(mc.shape), np.zeros(mr.shape)
    for i, (m, v) in enumerate(zip(margins, valid)):
        if v:  # d/dm of log(1 + exp(-m)) = -sigmoid(-m)
            g = -1.0 / (1.0 + math.exp(m)) * beta / n
            grad_c[i] = np.where(mc[i], g, 0.0)
            grad_r[i] = np.where(mr[i], -g, 0.0)
    return loss, margins, valid, grad_c, grad_r


def random_inputs(seed):
    rng = np.random.default_rng(seed)
    mc, mr = random_loss_mask(rng, PAIRS, SEQ_C), random_loss_mask(rng, PAIRS, SEQ_R)  # row 1: no tokens
    mr[3] = False  # a pair whose rejected side is padding
    arrays = [rng.normal(-1.5, 1.0, size=m.shape) for m in (mc, mc, mr, mr)]
    pc, rc, pr, rr = (with_garbage(rng, x, m).astype(np.float32) for x, m in zip(arrays, (mc, mc, mr, mr)))
    return pc, rc, mc, pr, rr, mr


@pytest.mark.parametrize("seed,beta", [(0, 0.1), (1, 0.5), (2, 2.0)])
def test_loss_metrics_and_gradient_match_float64_reference(seed, beta):
    pc, rc, mc, pr, rr, mr = random_inputs(seed)
    loss, metrics, (grad_c, grad_r, grad_ref) = loss_and_grads(pc, rc, mc, pr, rr, mr, beta)
    ref_loss, margins, valid, ref_grad_c, ref_grad_r = reference(pc, rc, mc, pr, rr, mr, beta)
    assert valid.count(True) == PAIRS - 2
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, atol=1e-6)
    kept = [m for m, v in zip(margins, valid) if v]
    np.testing.assert_allclose(metrics["reward_margin"], np.mean(kept), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(metrics["reward_accuracy"], np.mean([m > 0 for m in kept]), atol=1e-7)
    np.testing.assert_allclose(metrics["chosen_reward"] - metrics["rejected_reward"], np.mean(kept), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(grad_c, ref_grad_c, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(grad_r, ref_grad_r, rtol=1e-5, atol=1e-7)
    assert np.all(np.isfinite(grad_c)) and np.all(np.isfinite(grad_r))  # garbage never leaks
    assert not np.any(grad_ref)  # the reference is frozen


def test_hand_computed_pair_and_edges():
    # delta_chosen = (-1 + 1.5) + (-2 + 2.5) = 1 (the masked 9 vs -9 is ignored); delta_rejected = -1.
    pc, rc = np.array([[-1.0, -2.0, 9.0]]), np.array([[-1.5, -2.5, -9.0]])  # last token masked
    pr, rr = np.array([[-3.0, -1.0]]), np.array([[-2.0, -1.0]])
    mc, mr = np.array([[1, 1, 0]]), np.array([[1, 1]])
    loss, metrics, _ = loss_and_grads(pc, rc, mc, pr, rr, mr, 0.5)
    margin = 0.5 * ((0.5 + 0.5) - (-1.0))  # = 1.0
    assert float(loss) == pytest.approx(math.log1p(math.exp(-margin)), rel=1e-6)
    assert float(metrics["reward_accuracy"]) == 1.0
    none, _, _ = loss_and_grads(pc, rc, mc * 0, pr, rr, mr, 0.5)
    assert float(none) == 0.0  # no valid pair
    with pytest.raises(ValueError, match="beta must be > 0"):
        dpo.dpo_loss(pc, rc, mc, pr, rr, mr, beta=0.0)
    with pytest.raises(ValueError, match="shape mismatch"):
        dpo.dpo_loss(pc, rc[:, :2], mc, pr, rr, mr)
    with pytest.raises(ValueError, match="1 chosen rows but 2 rejected rows"):
        dpo.dpo_loss(pc, rc, mc, np.repeat(pr, 2, 0), np.repeat(rr, 2, 0), np.repeat(mr, 2, 0))


def traj(task, status, sample, env="textcraft", attempt=0, n=5, policy=True):
    mask = [0, 1, 1, 0, 1][:n] if policy else [0] * n
    return Trajectory(task_id=task, env=env, group_id=task, token_ids=list(range(10 * task, 10 * task + n)),
                      loss_mask=mask, logprobs=[0.0] * n, turn_spans=[(1, min(3, n))], turn_rewards=[0.0],
                      reward=1.0 if status == S.SUCCESS else 0.0, status=status, sample_idx=sample,
                      attempt=attempt)  # fmt: skip


def test_pairs_only_from_tasks_with_both_outcomes_deterministically():
    trajectories = [
        traj(0, S.SUCCESS, 0), traj(0, S.SUCCESS, 1),  # only successes: no pair
        traj(1, S.FAILURE, 0), traj(1, S.SUCCESS, 1), traj(1, S.MAX_TURNS, 2), traj(1, S.SUCCESS, 3),
        traj(2, S.SUCCESS, 0), traj(2, S.INFRA_ERROR, 1), traj(2, S.ENV_TIMEOUT, 2),  # unscored: no pair
        traj(3, S.SUCCESS, 2), traj(3, S.FAILURE, 0, policy=False), traj(3, S.INVALID_ACTION_LIMIT, 1),
        traj(1, S.FAILURE, 0, env="maze"), traj(1, S.SUCCESS, 0, env="maze", attempt=1),
    ]  # fmt: skip
    pairs = dpo_pairs.build_pairs(trajectories)
    summary = [(p.chosen.env, p.chosen.task_id, p.chosen.sample_idx, p.rejected.sample_idx) for p in pairs]
    assert summary == [("maze", 1, 0, 0), ("textcraft", 1, 1, 0), ("textcraft", 1, 3, 2), ("textcraft", 3, 2, 1)]
    for pair in pairs:
        assert pair.chosen.status == S.SUCCESS and pair.rejected.status.is_scored
        assert pair.rejected.status != S.SUCCESS and pair.chosen.task_id == pair.rejected.task_id
    for seed in range(5):
        shuffled = trajectories[:]
        random.Random(seed).shuffle(shuffled)
        assert dpo_pairs.build_pairs(shuffled) == pairs


def test_pair_batches_align_rows():
    pairs = dpo_pairs.build_pairs([traj(1, S.SUCCESS, 0, n=5), traj(1, S.FAILURE, 1, n=3), traj(2, S.FAILURE, 0, n=4),
                                   traj(2, S.SUCCESS, 1, n=2)])  # fmt: skip
    chosen, rejected = dpo_pairs.pair_batches(pairs, rows=4)
    assert chosen.shape == rejected.shape == (4, 16)
    np.testing.assert_array_equal(chosen.tokens[0, :5], [10, 11, 12, 13, 14])
    np.testing.assert_array_equal(rejected.tokens[0, :3], [10, 11, 12])
    np.testing.assert_array_equal(rejected.loss_mask[1, :5], [0, 1, 1, 0, 0])
    assert not chosen.loss_mask[2:].any() and not rejected.loss_mask[2:].any()  # padding pairs
    with pytest.raises(ValueError, match="no preference pairs"):
        dpo_pairs.pair_batches([])
