"""Evaluation accounting: denominators, retries, pass@k, Wilson intervals (independent references)."""

import itertools
import math

import pytest

from agentgym_jax.envs.protocol import EpisodeStatus as S
from agentgym_jax.eval import accounting as acc
from agentgym_jax.rollout.trajectory import Trajectory
from agentgym_jax.stats import wilson_interval


def rec(task, status, reward=None, sample=0, attempt=0, env="textcraft", turns=3, invalid=0):
    if reward is None:
        reward = 1.0 if status == S.SUCCESS else 0.0
    return acc.EpisodeRecord(env, task, sample, attempt, reward, S(status), turns, invalid)


def wilson_by_quadratic(k, n, z=1.959964):
    """The interval's ends are the p with (k/n - p)^2 = z^2 p (1 - p) / n: roots of a quadratic."""
    phat = k / n
    a, b, c = 1 + z * z / n, -(2 * phat + z * z / n), phat * phat
    disc = math.sqrt(b * b - 4 * a * c)
    return (-b - disc) / (2 * a), (-b + disc) / (2 * a)


def test_worked_example_60_success_30_failure_10_infra():
    records = [rec(i, S.SUCCESS) for i in range(60)]
    records += [rec(i, S.FAILURE) for i in range(60, 90)]
    records += [rec(i, S.INFRA_ERROR) for i in range(90, 100)]
    summary = acc.summarize(records, {"textcraft": 1.0}, group_size=1)
    m = summary.per_env["textcraft"]
    assert m.scheduled == 100
    assert (m.success.numerator, m.success.denominator) == (60, 100)
    assert round(100 * m.success.value, 1) == 60.0
    assert (m.conditional_success.numerator, m.conditional_success.denominator) == (60, 90)
    assert round(100 * m.conditional_success.value, 1) == 66.7
    assert round(100 * m.infra_rate.value, 1) == 10.0
    assert m.status_counts["success"] == 60 and m.status_counts["failure"] == 30
    assert m.status_counts["infra_error"] == 10 and m.status_counts["missing"] == 0
    assert summary.overall.success == m.success
    # Wilson 95% for 60/100 and 60/90, from the quadratic the interval solves.
    for rate, (k, n) in ((m.success, (60, 100)), (m.conditional_success, (60, 90))):
        low, high = wilson_by_quadratic(k, n)
        assert rate.low == pytest.approx(low, abs=1e-9) and rate.high == pytest.approx(high, abs=1e-9)
    assert (round(m.success.low, 3), round(m.success.high, 3)) == (0.502, 0.691)  # textbook value


def test_wilson_interval_solves_its_quadratic_and_edges():
    for k, n in ((0, 10), (3, 10), (10, 10), (1, 1), (47, 80), (999, 1000)):
        low, high = wilson_interval(k, n)
        ref_low, ref_high = wilson_by_quadratic(k, n)
        assert low == pytest.approx(max(ref_low, 0.0), abs=1e-12)
        assert high == pytest.approx(min(ref_high, 1.0), abs=1e-12)
        assert low <= k / n <= high
    assert wilson_interval(0, 5)[0] == 0.0 and wilson_interval(5, 5)[1] == 1.0
    with pytest.raises(ValueError, match="successes <= n"):
        wilson_interval(3, 2)
    assert acc.Rate.of(0, 0).value is None


def test_pass_at_k_equals_enumeration_over_subsets():
    for n, c in itertools.product(range(1, 7), range(7)):
        if c > n:
            continue
        outcomes = [1] * c + [0] * (n - c)
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(outcomes, k))
            expected = sum(any(s) for s in subsets) / len(subsets)
            assert acc.pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)
    with pytest.raises(ValueError, match="k <= n"):
        acc.pass_at_k(4, 1, 5)


def test_pass_hat_k_equals_enumeration_over_subsets():
    """pass^k: the share of k-subsets of a task's samples in which every sample succeeded."""
    for n, c in itertools.product(range(1, 7), range(7)):
        if c > n:
            continue
        outcomes = [1] * c + [0] * (n - c)
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(outcomes, k))
            expected = sum(all(s) for s in subsets) / len(subsets)
            assert acc.pass_hat_k(n, c, k) == pytest.approx(expected, abs=1e-12)
    with pytest.raises(ValueError, match="c <= n"):
        acc.pass_hat_k(4, 5, 2)


def test_pass_and_avg_at_k_averaged_over_tasks():
    # Task 0: 1 of 4 samples succeed; task 1: 3 of 4; task 2: none.
    wins = {0: 1, 1: 3, 2: 0}
    records = [
        rec(t, S.SUCCESS if s < wins[t] else S.FAILURE, sample=s) for t in wins for s in range(4)
    ]
    m = acc.summarize(records, {"textcraft": 1.0}, group_size=4).per_env["textcraft"]
    assert sorted(m.pass_at_k) == [1, 2, 4]
    assert m.pass_at_k[1] == pytest.approx((1 / 4 + 3 / 4 + 0) / 3)
    # pass@2: 1 - C(n-c, 2)/C(4, 2) = 1 - 3/6, 1 - 0/6, 0.
    assert m.pass_at_k[2] == pytest.approx((0.5 + 1.0 + 0.0) / 3)
    assert m.pass_at_k[4] == pytest.approx(2 / 3)
    # pass^2: C(c, 2)/C(4, 2) = 0, 3/6, 0; pass^4: only a task with 4 of 4 counts (none here).
    assert m.pass_hat_k[1] == pytest.approx(m.pass_at_k[1])
    assert m.pass_hat_k[2] == pytest.approx((0 + 0.5 + 0) / 3)
    assert m.pass_hat_k[4] == 0.0
    assert m.avg_at_k == pytest.approx(4 / 12)
    assert m.num_tasks == 3 and m.scheduled == 12


def test_last_attempt_counts_and_retries_are_reported():
    records = [
        rec(0, S.SUCCESS, attempt=1),  # the retry succeeded (listed first: order must not matter)
        rec(0, S.INFRA_ERROR, attempt=0),
        rec(1, S.SUCCESS, attempt=0),
        rec(1, S.ENV_TIMEOUT, attempt=2),  # the last attempt counts, even if worse
        rec(1, S.INFRA_ERROR, attempt=1),
    ]
    summary = acc.summarize(records, {"textcraft": 1.0}, group_size=1)
    m = summary.per_env["textcraft"]
    assert m.scheduled == 2 and m.retries == 3
    assert [e.status for e in summary.episodes] == ["success", "env_timeout"]
    assert m.success.value == 0.5 and m.infra_rate.value == 0.0
    assert m.conditional_success.denominator == 1


def test_duplicate_terminal_record_is_rejected():
    records = [rec(4, S.SUCCESS, sample=1), rec(4, S.FAILURE, sample=1)]
    with pytest.raises(ValueError, match="two terminal records for env='textcraft' task=4 sample=1 attempt=0"):
        acc.summarize(records, {"textcraft": 1.0}, group_size=2)


def test_missing_episodes_stay_in_the_denominator():
    records = [rec(0, S.SUCCESS, sample=0), rec(0, S.FAILURE, sample=1), rec(2, S.SUCCESS, sample=1)]
    summary = acc.summarize(records, {"textcraft": 1.0}, group_size=2, task_ids={"textcraft": [0, 1, 2]})
    m = summary.per_env["textcraft"]
    assert m.scheduled == 6 and m.status_counts["missing"] == 3
    assert m.success.value == pytest.approx(2 / 6)
    assert m.conditional_success.value == pytest.approx(2 / 3)


def test_schedule_and_threshold_errors():
    with pytest.raises(ValueError, match="task=9 sample=0 is not scheduled"):
        acc.summarize([rec(9, S.SUCCESS)], {"textcraft": 1.0}, 1, task_ids={"textcraft": [0]})
    with pytest.raises(ValueError, match="sample=3 is not scheduled"):
        acc.summarize([rec(0, S.SUCCESS, sample=3)], {"textcraft": 1.0}, group_size=2)
    with pytest.raises(ValueError, match=r"no success threshold for env\(s\) \['sciworld'\]"):
        acc.summarize([rec(0, S.SUCCESS, env="sciworld")], {"textcraft": 1.0}, 1)
    with pytest.raises(ValueError, match="group_size"):
        acc.summarize([], {}, 0)
    with pytest.raises(ValueError, match="every k"):
        acc.summarize([rec(0, S.SUCCESS)], {"textcraft": 1.0}, 1, ks=[2])


def test_thresholds_scales_and_scored_only_statistics():
    records = [
        rec(0, S.SUCCESS, reward=100.0, env="sciworld", turns=10, invalid=2),
        rec(1, S.MAX_TURNS, reward=99.0, env="sciworld", turns=30, invalid=3),  # below 100: failure
        rec(2, S.INFRA_ERROR, reward=100.0, env="sciworld", turns=1, invalid=1),  # unscored: failure
        rec(0, S.SUCCESS, reward=1.0, turns=4),
        rec(1, S.INVALID_ACTION_LIMIT, reward=0.0, turns=6, invalid=6),
    ]
    summary = acc.summarize(records, {"sciworld": 100.0, "textcraft": 1.0}, group_size=1)
    sw, tc = summary.per_env["sciworld"], summary.per_env["textcraft"]
    assert sw.success.numerator == 1 and sw.conditional_success.denominator == 2
    assert sw.mean_score == pytest.approx(199.0 / 3)  # infra error counts 0, on the 0-100 scale
    assert sw.mean_score_scored == pytest.approx(99.5)
    assert sw.mean_turns == pytest.approx(20.0)  # scored episodes only
    assert sw.invalid_action_rate == pytest.approx(5 / 40)
    assert tc.invalid_action_rate == pytest.approx(6 / 10)
    assert summary.overall.scheduled == 5 and summary.overall.success.numerator == 2
    assert summary.overall.mean_score is None  # 0-100 and 0-1 scores are not averaged
    assert list(summary.per_env) == ["sciworld", "textcraft"]
    assert sw.status_mismatches == 0 and tc.status_mismatches == 0


def test_status_and_reward_disagreements_are_counted():
    records = [rec(0, S.SUCCESS, reward=0.5), rec(1, S.FAILURE, reward=1.0), rec(2, S.INFRA_ERROR, reward=1.0)]
    m = acc.summarize(records, {"textcraft": 1.0}, group_size=1).per_env["textcraft"]
    assert m.success.numerator == 1  # the threshold decides: task 1's reward reached it
    assert m.status_mismatches == 2  # tasks 0 and 1; the unscored infra error is no mismatch


def test_records_from_trajectories():
    def traj(task, status, reward, turns, attempt=0):
        spans = [(2 * i, 2 * i + 1) for i in range(turns)]
        n = 2 * turns
        return Trajectory(task_id=task, env="maze", group_id=task, token_ids=[5] * n, loss_mask=[1, 0] * turns,
                          logprobs=[0.0] * n, turn_spans=spans, turn_rewards=[0.0] * turns, reward=reward,
                          status=status, invalid_actions=1, attempt=attempt)  # fmt: skip

    trajs = [traj(0, S.SUCCESS, 1.0, 3), traj(1, S.INFRA_ERROR, 0.0, 1), traj(1, S.FAILURE, 0.0, 5, attempt=1)]
    m = acc.summarize(trajs, {"maze": 1.0}, group_size=1).per_env["maze"]
    assert m.success.value == 0.5 and m.retries == 1 and m.infra_rate.value == 0.0
    assert m.mean_turns == 4.0 and m.invalid_action_rate == pytest.approx(2 / 8)
