"""The RL step's training batch (`train/rl_batch.py`): unscored episodes out of the loss and of
the group statistics (with real servers that time out or die mid-step), dynamic sampling and
overlong handling against float64 references."""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest
from test_rollout import ScriptedSampler, framing, oracle_moves, task_info  # noqa: F401 (fixtures)

from agentgym_jax.envs.launcher import LocalServers
from agentgym_jax.envs.pool import EnvPool
from agentgym_jax.envs.protocol import EpisodeStatus
from agentgym_jax.rl.advantages import compute_advantages
from agentgym_jax.rollout.batch import bucket
from agentgym_jax.rollout.engine import RolloutConfig, RolloutEngine
from agentgym_jax.rollout.trajectory import Trajectory
from agentgym_jax.rollout.rl_batch import BatchFilter, overlong_penalty, training_batch
from tests.servers import start_server

S = EpisodeStatus
SHUFFLE = ["move left", "move right"]  # never reaches a goal: a failure after maze.MAX_STEPS turns


def ref_grpo(scores, scored, group_ids, eps=1e-6):
    """float64 GRPO over the scored members of each group; 0 for the others and for groups of one."""
    out = []
    for i, score in enumerate(scores):
        group = [scores[j] for j in range(len(scores)) if scored[j] and group_ids[j] == group_ids[i]]
        if not scored[i] or len(group) < 2:
            out.append(0.0)
            continue
        mean = sum(group) / len(group)
        std = math.sqrt(sum((x - mean) ** 2 for x in group) / (len(group) - 1))
        out.append((score - mean) / (std + eps))
    return out


class KillOneServerPool(EnvPool):
    """Two real servers (slot s on urls[s % 2]); the second is killed once every slot's first step
    has been answered, so its episodes die mid-episode with `infra_error`."""

    def __init__(self, a: LocalServers, b: LocalServers, num_slots: int):
        super().__init__([a.urls["maze"], b.urls["maze"]], max_retries=1, backoff_s=0.01)
        self.doomed, self.num_slots, self.answered = b.servers[0].process, num_slots, 0

    async def step(self, slot, action):
        result = await super().step(slot, action)
        self.answered += 1
        if self.answered == self.num_slots:
            self.doomed.kill()
            self.doomed.wait()
        return result


def play(framing, task_info, scripts, pool):
    config = RolloutConfig(group_size=len(scripts), max_tokens_per_turn=16, max_response_length=100_000,
                           straggler_wait_s=None)
    scripted = ScriptedSampler(framing, scripts, action_format="{}")
    with RolloutEngine(scripted, framing, pool, task_info, config) as engine:
        return engine.run(None, [12], 100, jax.random.key(0), policy_version=0)


@pytest.mark.parametrize("fault", ["env_timeout", "server_killed"])
def test_unscored_episodes_leave_the_loss_and_the_group_baseline(framing, task_info, fault):  # noqa: F811
    solve = oracle_moves(12)
    if fault == "env_timeout":  # "sleep" takes the server 1 s; the pool waits 0.3 s per request
        scripts = [solve, SHUFFLE, ["move left", "sleep"]]
        with start_server("tests.server_test_envs:BlockingFaultyMazeEnv") as url:
            trajectories = play(framing, task_info, scripts, EnvPool(url, request_timeout_s=0.3))
        unscored = [S.ENV_TIMEOUT]
    else:  # slots 1 and 3 live on the server that dies after the first step
        with LocalServers(["maze"]) as a, LocalServers(["maze"]) as b:
            trajectories = play(framing, task_info, [solve, SHUFFLE, SHUFFLE, SHUFFLE], KillOneServerPool(a, b, 4))
        trajectories = [trajectories[i] for i in (0, 2, 1, 3)]  # scored first
        unscored = [S.INFRA_ERROR, S.INFRA_ERROR]
    assert [t.status for t in trajectories] == [S.SUCCESS, S.FAILURE, *unscored]
    assert all(sum(t.loss_mask) > 0 for t in trajectories)  # the dead episodes did sample tokens

    seq_len = bucket(max(len(t.token_ids) for t in trajectories), 64)
    batch, metrics = training_batch(trajectories, BatchFilter(), seq_len=seq_len, batch_size=len(trajectories) + 1)
    mask = np.asarray(batch.loss_mask)
    assert mask[:2].sum(axis=1).min() > 0 and mask[2:].sum() == 0  # unscored rows and padding: no loss
    assert metrics["unscored_episodes"] == len(unscored) and metrics["trained_episodes"] == 2
    advantages, _ = compute_advantages("grpo", token_rewards=batch.token_rewards, loss_mask=batch.loss_mask,
                                       group_ids=batch.group_ids)
    scored = [t.status.is_scored for t in trajectories]
    want = ref_grpo([t.reward for t in trajectories], scored, [t.group_id for t in trajectories])
    np.testing.assert_allclose(want[:3], [1 / math.sqrt(2), -1 / math.sqrt(2), 0.0], atol=1e-6)  # the numbers
    for row, (t, value) in enumerate(zip(trajectories, want)):  # on every token the policy sampled
        sampled = np.asarray(t.loss_mask) > 0
        np.testing.assert_allclose(np.asarray(advantages[row, : len(sampled)])[sampled], value, rtol=1e-5, atol=1e-6)


def synthetic(group_id, reward, status="success", response=10):
    """prompt(4), one policy turn of `response` ids."""
    ids = list(range(1, 5 + response))
    mask = [0] * 4 + [1] * response
    return Trajectory(task_id=group_id, env="room", group_id=group_id, token_ids=ids, loss_mask=mask,
                      logprobs=[0.0] * len(ids), turn_spans=[(4, 4 + response)], turn_rewards=[reward],
                      reward=reward, status=status)


def test_dynamic_sampling_drops_uniform_groups_and_reports_the_shortfall():
    trajectories = [
        synthetic(0, 1.0), synthetic(0, 1.0),  # all solved: no signal
        synthetic(1, 1.0), synthetic(1, 0.0),  # kept
        synthetic(2, 0.0), synthetic(2, 0.0), synthetic(2, 1.0, S.INFRA_ERROR),  # uniform among the scored
        synthetic(3, 1.0), synthetic(3, 0.0, S.ENV_TIMEOUT),  # one scored member: no baseline
    ]
    trained = lambda rules: (np.asarray(training_batch(trajectories, rules, seq_len=16, batch_size=10)[0].loss_mask)  # noqa: E731
                             .sum(axis=1) > 0)[:9].tolist()
    on = BatchFilter(dynamic_sampling=True)
    assert trained(on) == [False, False, True, True, False, False, False, False, False]
    _, metrics = training_batch(trajectories, on, seq_len=16, batch_size=10)
    assert metrics["groups_trained"] == 1 and metrics["dynamic_sampling/shortfall"] == 3
    assert metrics["unscored_episodes"] == 2
    assert trained(BatchFilter()) == [True, True, True, True, True, True, False, False, False]
    # Without a group baseline (REINFORCE++, GAE) a lone scored member still trains.
    assert trained(BatchFilter(grouped=False)) == [True, True, True, True, True, True, False, True, False]


def ref_overlong(length, max_length, buffer, penalty):
    """DAPO's soft overlong punishment, as the paper writes it."""
    if length <= max_length - buffer:
        return 0.0
    if length <= max_length:
        return ((max_length - buffer) - length) / buffer * penalty
    return -penalty


def test_overlong_penalty_and_mask_match_references():
    lengths = [10, 40, 47, 48, 55, 64, 70]
    for length in lengths:
        got = overlong_penalty(np.asarray([length]), 64, 16, 0.5)[0]
        assert abs(got - ref_overlong(length, 64, 16, 0.5)) < 1e-12
    trajectories = [synthetic(0, 1.0, response=n) for n in lengths[:-1]]
    trajectories.append(synthetic(0, 0.0, S.TOKEN_BUDGET, response=64))
    rules = BatchFilter(overlong="penalty", max_response_length=64, overlong_buffer=16, overlong_penalty=0.5)
    batch, metrics = training_batch(trajectories, rules, seq_len=96, batch_size=7)
    want = [t.reward + ref_overlong(n, 64, 16, 0.5) for t, n in zip(trajectories, [*lengths[:-1], 64])]
    np.testing.assert_allclose(batch.scores, want, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(batch.token_rewards).sum(axis=1), want, rtol=1e-6)  # on the last policy token
    assert metrics["overlong_episodes"] == 1 and trajectories[1].reward == 1.0  # the records stay untouched
    masked, _ = training_batch(trajectories, BatchFilter(overlong="mask"), seq_len=96, batch_size=7)
    assert (np.asarray(masked.loss_mask).sum(axis=1) > 0).tolist() == [True] * 6 + [False]


def test_bad_filters_are_refused():
    with pytest.raises(ValueError, match="overlong='cut' is not one of off, mask, penalty"):
        BatchFilter(overlong="cut")
    with pytest.raises(ValueError, match="overlong_buffer"):
        BatchFilter(overlong="penalty", overlong_buffer=0)


def test_a_turn_penalty_prices_each_policy_turn_and_leaves_success_alone():
    def episode(group_id, reward, turns, success):
        ids = list(range(1, 5 + 3 * turns))  # prompt(4), then turns of 2 policy ids and 1 observation id
        spans = [(4 + 3 * k, 6 + 3 * k) for k in range(turns)]
        mask = [int(any(a <= i < b for a, b in spans)) for i in range(len(ids))]
        return Trajectory(task_id=group_id, env="room", group_id=group_id, token_ids=ids, loss_mask=mask,
                          logprobs=[0.0] * len(ids), turn_spans=spans, turn_rewards=[0.0] * (turns - 1) + [reward],
                          reward=reward, status="success" if success else "max_turns")

    # One group: solved in 3 turns, solved in 5 (two wasted), failed in 12; a second group solved twice in 4.
    trajectories = [episode(0, 1.0, 3, True), episode(0, 1.0, 5, True), episode(0, 0.25, 12, False),
                    episode(1, 1.0, 4, True), episode(1, 1.0, 4, True)]
    rules = BatchFilter(turn_penalty=0.02, dynamic_sampling=True)
    batch, metrics = training_batch(trajectories, rules, seq_len=48, batch_size=5)
    want = [1.0 - 0.06, 1.0 - 0.10, 0.25 - 0.24, 1.0 - 0.08, 1.0 - 0.08]
    np.testing.assert_allclose(batch.scores, want, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(batch.token_rewards).sum(axis=1), want, rtol=1e-6)
    assert metrics["groups_uniform"] == 1  # equal turns, equal returns: the second group still carries nothing
    advantages = ref_grpo(list(np.asarray(batch.scores[:3], np.float64)), [True] * 3, [0] * 3)
    assert advantages[0] > advantages[1] > 0 > advantages[2]  # the wasted turns rank the longer success lower
    assert [t.reward for t in trajectories] == [1.0, 1.0, 0.25, 1.0, 1.0] and trajectories[1].success  # records untouched
    with pytest.raises(ValueError, match="turn_penalty must be >= 0"):
        BatchFilter(turn_penalty=-0.1)
