"""Asynchronous RL (`rollout.max_staleness`): the stream of groups, the staleness bound, resume.

Against real Maze servers on 127.0.0.1 with the tiny random decoder and sampler of
tests/test_rollout.py. The exact test is the lock-step one: one-step-off sampling equals a
synchronous run staged by hand (batch b played by `RolloutEngine.run` with the weights of update
b - 1), token for token; the job tests run the launcher, overlapped, and kill and resume it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import time

import jax
import numpy as np
import pytest

from agentgym_jax.config import ConfigError
from agentgym_jax.envs.pool import EnvPool
from agentgym_jax.envs.protocol import EpisodeStatus
from agentgym_jax.rl.curriculum import Curriculum
from agentgym_jax.rl.horizon import stepwise
from agentgym_jax.rollout.engine import RolloutConfig, RolloutEngine
from agentgym_jax.rollout.stream import GroupSpec, GroupStream, PlayedGroup, PolicyWeights
from agentgym_jax.rollout.trajectory import Trajectory, read_jsonl
from agentgym_jax.train import rl_episodes
from agentgym_jax.train import settings as train_settings
from agentgym_jax.train.metrics import read_metrics
from configs import quickstart
from tests.rl_runs import REPO, TINY_RL_JOB, launch_command
from tests.test_rollout import MAX_NEW, framing, maze_url, model, random_params, sampler, task_info  # noqa: F401

ROLLOUT = RolloutConfig(group_size=2, max_tokens_per_turn=MAX_NEW, num_slots=4, decode_chunk=3)


def _plan(info, steps: int) -> rl_episodes.StepPlan:
    return rl_episodes.StepPlan(stepwise((2, 3), 2), Curriculum(), info, batch_tasks=2, seed=5, steps=steps)


def _same_episodes(got: list[Trajectory], want: list[Trajectory]) -> None:
    assert [(t.group_id, t.sample_idx, t.task_id) for t in got] == [(t.group_id, t.sample_idx, t.task_id) for t in want]
    for a, b in zip(got, want):
        assert a.token_ids == b.token_ids and a.loss_mask == b.loss_mask and a.status == b.status
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


def test_lock_step_one_step_off_samples_what_a_hand_staged_synchronous_run_samples(framing, model, sampler, maze_url, task_info):
    """k = 1, lock-step: step s trains on batch s, which was played with the weights of update s - 1
    (batch 0 with the first); a run resumed from step 2's position plays the batch it had in flight
    again, with the restored weights, and trains on nothing twice."""
    config, _ = model
    weights = [random_params(config, 0.02 * (1 + v)) for v in range(4)]  # the policy after v updates
    plan = _plan(task_info, steps=3)
    settings = rl_episodes.AsyncSettings(max_staleness=1, lock_step=True)
    taken, positions = [], []
    with RolloutEngine(sampler, framing, EnvPool(maze_url), task_info, ROLLOUT) as engine:
        source = rl_episodes.Asynchronous(plan, rl_episodes.EngineStreams(engine), settings, {})
        for step in range(3):
            trajectories, metrics = source.take(step, lambda: weights[step])
            assert metrics["staleness_max"] == metrics["staleness_mean"] == min(step, 1)
            assert metrics["staleness_1"] == min(step, 1) and metrics["stale_dropped"] == 0
            taken.append(trajectories)
            source.updated(step + 1, lambda: weights[step + 1])
            positions.append(source.position())
        source.close()
        resumed = rl_episodes.Asynchronous(plan, rl_episodes.EngineStreams(engine), settings, positions[1])  # killed after step 1's checkpoint
        replayed, _ = resumed.take(2, lambda: weights[2])

        for batch in range(3):  # the synchronous run staged by hand
            version = max(batch - 1, 0)
            tasks, first, _ = plan.tasks(batch)
            want = engine.run(weights[version], tasks, plan.schedule.horizon(batch), source.rng,
                              policy_version=version, group_offset=batch * plan.batch_tasks + first)
            _same_episodes(taken[batch], want)
            assert {t.policy_version for t in taken[batch]} == {version}
            assert all(set(t.token_versions) <= {-1, version} for t in taken[batch])
        want = engine.run(weights[2], plan.tasks(2)[0], plan.schedule.horizon(2), source.rng, policy_version=2, group_offset=4)
        _same_episodes(replayed, want)
    assert positions[0] == {"next_batch": 2, "pending": [dataclasses.asdict(GroupSpec(2 + i, t, 2)) for i, t in
                                                          enumerate(plan.tasks(1)[0])]}
    assert positions[1]["next_batch"] == 3 and [g["index"] for g in positions[1]["pending"]] == [4, 5]
    assert positions[2] == {"next_batch": 3, "pending": []}  # no batch past the last step is played


def test_episodes_in_flight_take_new_weights_and_record_each_tokens_version(framing, model, sampler, maze_url, task_info):
    """Partial rollouts: weights published while episodes are in flight are used from the stream's
    next sampler call on; every sampled token records the version that drew it (never decreasing
    along an episode), off-policy tokens -1, and `policy_version` is the oldest."""
    config, _ = model
    weights = PolicyWeights(random_params(config, 0.02), version=0)
    new = random_params(config, 0.05)
    fed, played = [[GroupSpec(i, task, horizon=4) for i, task in enumerate([0, 3, 6])]], []

    def emit(group: PlayedGroup) -> None:
        played.append(group)
        if len(played) == 1:  # the first group ended: an update lands while the others play
            weights.publish(new, version=1)

    with RolloutEngine(sampler, framing, EnvPool(maze_url), task_info, ROLLOUT) as engine:
        stream = GroupStream(engine, weights, jax.random.key(0))
        engine.submit(stream.play(lambda: fed.pop() if fed else None, emit)).result(timeout=600)
    assert sorted(g.spec.index for g in played) == [0, 1, 2]
    episodes = [t for g in played for t in g.trajectories]
    assert {t.policy_version for t in played[0].trajectories} == {0}
    mixed = 0
    for t in episodes:
        sampled = [v for v, m in zip(t.token_versions, t.loss_mask) if m]
        assert [v for v, m in zip(t.token_versions, t.loss_mask) if not m] == [-1] * (len(t.loss_mask) - len(sampled))
        assert sampled == sorted(sampled) and t.policy_version == sampled[0]
        mixed += set(sampled) == {0, 1}
    assert mixed >= 1, "no episode was in flight when the weights changed"
    assert stream.times.busy_s > 0


def _group(index: int, oldest: int) -> PlayedGroup:
    t = Trajectory(task_id=index, env="maze", group_id=index, token_ids=[1, 2], loss_mask=[0, 1], logprobs=[0.0, -1.0],
                   turn_spans=[(1, 2)], turn_rewards=[0.0], reward=0.0, status=EpisodeStatus.FAILURE, policy_version=oldest)
    return PlayedGroup(GroupSpec(index, index, 2), [t])


@pytest.mark.parametrize("stale_groups", ["drop", "resample"])
def test_groups_staler_than_the_bound_are_dropped_or_played_again_and_counted(task_info, stale_groups):
    """With k = 1 at version 3, a finished group whose oldest token is from version 1 is not trained
    on: dropped (counted; a batch past the last step stands in for it) or fed again as its next
    attempt (counted, and kept in the position a checkpoint saves)."""
    source = rl_episodes.Asynchronous(_plan(task_info, steps=4), None, rl_episodes.AsyncSettings(1, stale_groups), {})
    source._version = 3
    assert [g.index for g in source._feed()] == [0, 1, 2, 3, 4, 5, 6, 7]  # batches 0-3: the last step's is 3
    for index, oldest in [(0, 1), (1, 2), (2, 3), (3, 3)]:
        source._finished.put(_group(index, oldest))
    taken = source._take_groups(2)
    assert [g.spec.index for g in taken] == [1, 2]
    assert (source.dropped, source.resampled) == ((1, 0) if stale_groups == "drop" else (0, 1))
    pending = [(g["index"], g["attempt"]) for g in source.position()["pending"]]
    if stale_groups == "drop":
        assert (0, 0) not in pending and [g.index for g in source._feed()] == [8, 9]  # batch 4 stands in
    else:
        assert (0, 1) in pending and [(g.index, g.attempt) for g in source._feed()] == [(0, 1)]
    source._finished.put(_group(4, 3))
    assert [g.spec.index for g in source._take_groups(2)] == [3, 4]  # group 3 waited a step: still within k


def test_bad_async_settings_are_one_line_config_errors():
    def settings(**rollout):
        config = quickstart.get_config()
        config.rollout.update(rollout)
        return train_settings.async_rollout(config, corrects_off_policy=True)

    assert settings() == rl_episodes.AsyncSettings(0, "drop", True)
    assert settings(max_staleness=2, num_slots=8, lock_step=False) == rl_episodes.AsyncSettings(2, "drop", False)
    with pytest.raises(ConfigError, match="max_staleness must be an integer >= 0"):
        settings(max_staleness=-1)
    with pytest.raises(ConfigError, match="stale_groups must be one of drop, resample, got 'keep'"):
        settings(stale_groups="keep")
    with pytest.raises(ConfigError, match="set rollout.num_slots > 0"):
        settings(max_staleness=1)
    config = quickstart.get_config()
    config.rollout.update(max_staleness=1, num_slots=8)
    with pytest.raises(ConfigError, match="set algo.decoupled_ppo=True"):
        train_settings.async_rollout(config, corrects_off_policy=False)


# Overlapped, one update behind at most, the sampler on 4 of the 8 simulated devices and the trainer on the others.
ASYNC = {"rollout.max_staleness": 1, "rollout.num_slots": 4, "rollout.lock_step": False, "algo.decoupled_ppo": True,
         "rollout.sampler_devices": 4}


@pytest.mark.slow
def test_an_overlapped_job_killed_mid_run_resumes_and_trains_on_no_episode_twice(tmp_path):
    """The launcher's RL job, sampler and trainer overlapped (k = 1) on devices of their own, on real servers: killed after
    step 3 (checkpoint at 2), restarted: every step logged once, every episode recorded once with
    its step, each token at most k versions older than the update that trained on it."""
    workdir = tmp_path / "run"
    command = launch_command("configs/quickstart.py", {
        **TINY_RL_JOB, **ASYNC, "workdir": workdir, "train.steps": 4, "train.checkpoint_every": 2,
        "horizon_schedule.steps_per_stage": 2,
    })
    with open(tmp_path / "killed.log", "w") as out:
        proc = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=out, start_new_session=True)
    try:
        deadline = time.time() + 600
        while not ((workdir / "metrics.jsonl").exists() and any(r["step"] == 3 for r in read_metrics(str(workdir / "metrics.jsonl")))):
            assert proc.poll() is None and time.time() < deadline, (tmp_path / "killed.log").read_text()[-3000:]
            time.sleep(0.2)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    resumed = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert json.loads((workdir / "report.json").read_text())["resumed_from_step"] == 2

    metrics = read_metrics(str(workdir / "metrics.jsonl"))
    assert [r["step"] for r in metrics] == [1, 2, 3, 4]
    assert all(0 <= r["staleness_max"] <= 1 and r["stale_dropped"] == 0 for r in metrics)
    assert all(0 <= r[k] <= 1 for r in metrics for k in ("sampler_idle_fraction", "trainer_idle_fraction"))
    assert "is_ess_fraction" in metrics[-1]
    episodes = list(read_jsonl(str(workdir / "trajectories.jsonl")))
    keys = [(t.group_id, t.attempt, t.sample_idx) for t in episodes]
    assert len(keys) == len(set(keys)) == 4 * 2 * 2, "an episode trained on twice, or a step without its episodes"
    assert sorted({t.train_step for t in episodes}) == [0, 1, 2, 3]
    for t in episodes:
        versions = {v for v in t.token_versions if v >= 0} or {t.policy_version}
        assert t.train_step - 1 <= min(versions) == t.policy_version and max(versions) <= t.train_step
