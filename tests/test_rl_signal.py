"""The pass-rate controls (`rl/pass_rate.py`, `train/rl_signal.py`): a group's success steering
the replayed turns k as specified, pass-rate-targeted task draws, dynamic sampling's extra groups
(cap and counts), and the state restored exactly through a real orbax checkpoint; against real
room servers with a scripted policy, and float64 references."""

from __future__ import annotations

import dataclasses
import json
import math

import ml_collections
import numpy as np
import pytest

from agentgym_jax.config import ConfigError
from agentgym_jax.envs.pool import EnvPool
from agentgym_jax.job.checkpoint import Checkpointer
from agentgym_jax.job.play import task_batch
from agentgym_jax.rl.curriculum import Curriculum
from agentgym_jax.rl.horizon import fixed
from agentgym_jax.rl.pass_rate import PassRate, ReplayControl, draw_tasks, sampling_weights
from agentgym_jax.rollout.engine import RolloutConfig, RolloutEngine
from agentgym_jax.rollout.rl_batch import BatchFilter
from agentgym_jax.train import rl_episodes, settings
from agentgym_jax.train.rl_signal import SignalSettings, Standing, Steered
from configs import quickstart
from environments.room.env import RoomEnv
from environments.textcraft.env import TextCraftEnv
from tests.rl_runs import TINY_RL_JOB, launch, run_rl_job
from tests.servers import start_server
from tests.test_replay import framing  # noqa: F401 (fixture)
from tests.test_rollout import ScriptedSampler, oracle_moves

CONTROL = ReplayControl(target=0.5, band=0.25, start=1.0)


def test_a_group_pass_rate_moves_k_as_specified():
    # Beyond target + band: one turn less (toward training from the start); below target - band: one more
    # (at most the demonstration's turns before the last); within the band, where it is.
    for k, rate, most, want in [(3, 1.0, 5, 2), (3, 0.875, 5, 2), (3, 0.75, 5, 3), (3, 0.5, 5, 3), (3, 0.25, 5, 3),
                                (3, 0.125, 5, 4), (3, 0.0, 5, 4), (5, 0.0, 5, 5), (0, 1.0, 5, 0), (4, 0.0, 2, 2)]:
        assert CONTROL.next(k, rate, most) == want, (k, rate, most)
    assert [ReplayControl(start=s).first(6) for s in (0.0, 0.5, 0.99, 1.0)] == [0, 3, 5, 6]


def standing(**kw) -> Standing:
    signal = SignalSettings(replay=CONTROL, **kw)
    return Standing(signal, TextCraftEnv.task_info().metadata, {})


def test_each_task_s_groups_steer_its_k_and_its_pass_rate():
    s = standing(pass_rate=PassRate(memory=0.5))
    s.oracle_turns.update({7: 5, 8: 3})  # demonstrations: 4 and 2 turns replayable
    assert (s.turns(7), s.turns(8)) == (4, 2)  # start=1: one turn before the goal
    s.observe([[7, 4, 6, 6, 5], [8, 2, 0, 6, 3]])  # all succeed / all fail
    assert (s.replay_turns[7], s.replay_turns[8]) == (3, 2)  # 8 is at its most already
    s.observe([[7, 3, 3, 6, 5]])  # half: stays
    s.observe([[7, 3, 5, 6, 5], [7, 3, 1, 2, 5]])  # a unit's groups of one step are averaged: (5/6 + 1/2) / 2 = 0.67
    assert s.replay_turns[7] == 3 and s.turns(7) == 3
    for _ in range(3):
        s.observe([[7, s.turns(7), 4, 4, 5]])
    assert s.turns(7) == 0  # success moved it to the start
    s.observe([[7, 0, 0, 0, 5]])  # nothing scored (infrastructure errors): says nothing
    rate = None
    for group in (1.0, 0.5, 5 / 6, 0.5, 1.0, 1.0, 1.0):
        rate = group if rate is None else 0.5 * rate + 0.5 * group  # float64 reference of the moving average
    assert s.pass_rates[7] == pytest.approx(rate, abs=1e-15)


def test_a_grade_s_groups_steer_one_k_for_its_tasks():
    depth = TextCraftEnv.task_info().metadata["depth"]
    a, b = [t for t in TextCraftEnv.task_info().splits["train"] if depth[t] == 2][:2]
    s = standing(replay_by="depth")
    s.oracle_turns.update({a: 5, b: 3})
    assert (s.turns(a), s.turns(b)) == (4, 2)
    s.observe([[a, 4, 0, 4, 5], [b, 2, 1, 4, 3]])  # the grade's mean 1/8: one turn more, from the most it replayed
    assert s.replay_turns[2] == 4 and (s.turns(a), s.turns(b)) == (4, 2)  # capped at the grade's longest, then each task's
    s.observe([[a, 4, 4, 4, 5]])
    s.observe([[b, 2, 4, 4, 3]])
    assert s.replay_turns[2] == 2 and (s.turns(a), s.turns(b)) == (2, 2)


def test_pass_rate_weights_and_draws_follow_the_target():
    w = sampling_weights([None, 0.5, 0.0, 1.0, 0.25, 0.875], target=0.5, floor=0.1)
    np.testing.assert_allclose(w, [1.0, 1.0, 0.1, 0.1, 0.55, 0.325], rtol=1e-12)
    w = sampling_weights([0.2, 0.0, 1.0], target=0.2, floor=0.0 + 1e-9)  # the farther end is 1: 0.8 away
    np.testing.assert_allclose(w, [1.0, 0.75 + 0.25e-9, 1e-9], rtol=1e-9)
    weights = np.array([1.0, 0.55, 0.1, 0.325])
    counts = np.zeros(4)
    for step in range(4000):  # one task a draw: frequencies in proportion to the weights
        counts[[10, 11, 12, 13].index(draw_tasks([10, 11, 12, 13], weights, 1, np.random.default_rng([0, step]))[0])] += 1
    expected = 4000 * weights / weights.sum()
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 16.3  # chi-square with 3 degrees of freedom, p = 0.001
    drawn = draw_tasks(list(range(8)), np.ones(8), 8, np.random.default_rng(1))
    assert sorted(drawn) == list(range(8))  # no repeats while the pool allows
    assert draw_tasks(list(range(8)), np.ones(8), 8, np.random.default_rng(1)) == drawn


class CountingPool(EnvPool):
    """A real pool that records every task it resets (the episodes an RL step played)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.reset_tasks: list[int] = []

    async def reset(self, slot, data_idx, **kwargs):
        self.reset_tasks.append(data_idx)
        return await super().reset(slot, data_idx, **kwargs)


def source(url, framing, scripts, signal, rules, position=None, batch_tasks=4, horizon=1, seed=0, pool=0):  # noqa: F811
    """A `Steered` source over a real room server, 2 samples a task played by `scripts` (per row);
    `pool` > 0: the first that many training tasks only."""
    info = RoomEnv.task_info()
    if pool:
        info = dataclasses.replace(info, splits={**info.splits, "train": info.splits["train"][:pool]})
    plan = rl_episodes.StepPlan(fixed(horizon), Curriculum(), info, batch_tasks, seed, steps=10)
    engine = RolloutEngine(ScriptedSampler(framing, scripts, action_format="{}"), framing, CountingPool(url), info,
                           RolloutConfig(group_size=2, max_tokens_per_turn=16, straggler_wait_s=None))
    return Steered(plan, engine, signal, rules, position or {})


def played_groups(pool: CountingPool) -> list[int]:
    return pool.reset_tasks[::2]  # the two samples of a task are reset one after the other


@pytest.fixture(scope="module")
def room_url():
    with start_server("room") as url:
        yield url


def moves_somewhere(task: int, action: str) -> bool:
    """Whether `action` changes a room task's reward at its first step (played in-process)."""
    game = RoomEnv()
    game.reset(task)
    return game.step(action).reward != 0


def test_dynamic_sampling_draws_extra_groups_until_the_batch_is_mixed_within_the_cap(room_url, framing):  # noqa: F811
    rules = BatchFilter(dynamic_sampling=True, max_extra_groups=6)
    # "move up" against an invalid action: a group is mixed where moving up changes the reward; seed 2's
    # first 4 tasks hold 2 such groups, so the step draws more.
    steered = source(room_url, framing, [["Action: move up"], ["Action: jump"]] * 8, SignalSettings(), rules, seed=2)
    with steered.engine:
        trajectories, metrics = steered.take(0, lambda: None)
    played = played_groups(steered.engine.pool)
    mixed = [t for t in played if moves_somewhere(t, "move up")]
    kept_tasks = [t.task_id for t in trajectories[::2]]
    assert len(played) == 4 + metrics["dynamic_sampling/extra_groups"] and len(set(played)) == len(played)
    assert played[:4] == task_batch(RoomEnv.task_info().splits["train"], 0, 4, seed=2)  # the step's own draw first
    assert sum(t in mixed for t in played[:4]) == 2
    assert len(kept_tasks) == 4 and metrics["dynamic_sampling/mixed_groups"] == min(4, len(mixed))
    assert all(t in kept_tasks for t in mixed[:4])  # mixed groups first
    assert len(mixed) >= 4 or metrics["dynamic_sampling/extra_groups"] == 6  # stopped when full, or at the cap
    assert 0 < metrics["dynamic_sampling/draws"] and len({t.group_id for t in trajectories}) == 4

    # Groups that never differ: one extra draw of the whole cap, nothing to keep but the step's own groups.
    steered = source(room_url, framing, [["Action: jump"]] * 16, SignalSettings(), BatchFilter(dynamic_sampling=True,
                                                                                                max_extra_groups=3))
    with steered.engine:
        trajectories, metrics = steered.take(0, lambda: None)
    assert (metrics["dynamic_sampling/extra_groups"], metrics["dynamic_sampling/draws"], metrics["dynamic_sampling/mixed_groups"]) == (3, 1, 0)
    assert [t.task_id for t in trajectories[::2]] == played_groups(steered.engine.pool)[:4]


def test_a_restored_position_plays_the_steps_the_uninterrupted_run_plays(room_url, framing, tmp_path):  # noqa: F811
    """Replayed prefixes and pass-rate draws from 6 tasks over 4 steps, a checkpoint after step 2
    (real orbax meta): a source restored from it plays step 3 exactly as the uninterrupted one
    (tasks, k, tokens, metrics), and ends in the same state."""
    signal = SignalSettings(replay=CONTROL, sampling="pass_rate", sampling_floor=0.05)
    rules = BatchFilter(dynamic_sampling=True, max_extra_groups=2)
    scripts = [["Action: move up"], ["Action: move left"]] * 8
    checkpoints = Checkpointer(str(tmp_path / "ckpt"), every=1)
    straight = source(room_url, framing, scripts, signal, rules, horizon=2, pool=6)
    with straight.engine:
        for step in range(3):
            straight.take(step, lambda: None)
        checkpoints.save(3, {"x": np.zeros(1)}, {"episodes": [straight.position()]}, force=True)
        trajectories, metrics = straight.take(3, lambda: None)
    _, meta = checkpoints.restore({"x": np.zeros(1)})
    checkpoints.close()
    resumed = source(room_url, framing, scripts, signal, rules, position=meta["episodes"][0], horizon=2, pool=6)
    with resumed.engine:
        again, again_metrics = resumed.take(3, lambda: None)
    untimed = lambda t: {k: v for k, v in t.to_json().items() if k != "timings"}  # noqa: E731
    assert [untimed(t) for t in again] == [untimed(t) for t in trajectories]
    timing = {"rollout_s", "sampler_busy_s", "sampler_wait_s"}
    assert {k: v for k, v in again_metrics.items() if k not in timing} == {k: v for k, v in metrics.items() if k not in timing}
    assert resumed.position() == straight.position()
    assert json.loads(json.dumps(straight.position())) == straight.position()  # what meta holds, exactly
    # The controls moved: tasks known with their pass rates, replayed turns in the episodes and in the record.
    assert metrics["pass_rate/known_tasks"] == 6 and any(t.replay_turns for t in trajectories)
    assert all(t.curriculum["stage"] == 0 for t in trajectories) and any("pass_rate" in t.curriculum for t in trajectories)
    assert metrics["replay/turns_max"] >= 1 and 0 <= metrics["replay/from_start"] <= 1


@pytest.mark.parametrize("keys,message", [
    ({"target_pass_rate": 1.0}, "target_pass_rate must lie in (0, 1), got 1.0"),
    ({"replay_band": 0.6}, "replay_band must lie in [0, min(target, 1 - target)] = [0, 0.5], got 0.6"),
    ({"replay_start": 1.5}, "replay_start must lie in [0, 1]"),
    ({"sampling": "hard"}, "sampling='hard' is not one of uniform, pass_rate"),
    ({"sampling_floor": 0.0, "sampling": "pass_rate"}, "sampling_floor must lie in (0, 1], got 0.0"),
    ({"pass_rate_memory": 1.0}, "pass_rate_memory must lie in [0, 1), got 1.0"),
    ({"replay": False, "replay_by": "depth"}, "replay_by='depth' grades the replay, which is off"),
])
def test_bad_pass_rate_settings_are_refused_in_one_line(keys, message):
    config = quickstart.get_config()
    config.curriculum.replay = True
    config.curriculum.update(keys)
    with pytest.raises(ConfigError) as e:
        settings.signal(config)
    assert str(e.value).startswith("config.curriculum: ") and message in str(e.value) and "\n" not in str(e.value)


def test_the_job_refuses_what_the_controls_cannot_do():
    config = quickstart.get_config()
    config.algo.max_extra_groups = 4
    with pytest.raises(ConfigError, match="max_extra_groups replaces the groups dynamic sampling leaves out"):
        settings.batch_filter(config)
    config.algo.dynamic_sampling = True
    config.curriculum.replay, config.curriculum.replay_by = True, "depht"
    rules, signal = settings.batch_filter(config), settings.signal(config)
    metadata = TextCraftEnv.task_info().metadata
    with pytest.raises(ConfigError, match=r"curriculum.replay_by='depht'.*it has: depth"):
        settings.check_signal(config, signal, rules, metadata)
    config.curriculum.replay_by = "depth"
    config.rollout.max_staleness = 1
    with pytest.raises(ConfigError, match="need synchronous rollout: set rollout.max_staleness=0"):
        settings.check_signal(config, settings.signal(config), rules, metadata)
    config.rollout.max_staleness, config.env.agent = 0, "agents.openai_tools:play"
    with pytest.raises(ConfigError, match="play through the rollout engine, not env.agent='agents.openai_tools:play'"):
        settings.check_signal(config, settings.signal(config), rules, metadata)
    config.env.agent = ""
    settings.check_signal(config, settings.signal(config), rules, metadata)
    assert not SignalSettings().steers(BatchFilter()) and SignalSettings().steers(rules)
    assert settings.curriculum(ml_collections.ConfigDict(config.curriculum.to_dict())) == Curriculum()
    assert math.isclose(settings.signal(config).replay.band, 0.25)


# The quickstart shortened to its smallest path with every control on: a k per room layout, pass-rate
# draws, up to 2 extra groups a step. 2 steps, then the same command with 3: the run resumes at step 2.
CURRICULUM_JOB = {
    **TINY_RL_JOB, "train.checkpoint_every": 1, "horizon_schedule.steps_per_stage": 2,
    "curriculum.replay": True, "curriculum.replay_by": "layout", "curriculum.sampling": "pass_rate",
    "algo.dynamic_sampling": True, "algo.max_extra_groups": 2,
    "algo.shared_prefix": True,  # each group one prefix tree, its replayed turns shared: packing through a whole job
}


@pytest.mark.slow
def test_a_curriculum_job_replays_prefixes_masked_evaluates_from_the_start_and_resumes_its_k(tmp_path):
    overrides = {**CURRICULUM_JOB, "workdir": tmp_path}
    first = launch("configs/quickstart.py", {**overrides, "train.steps": 2}, timeout=900)
    assert first.returncode == 0, first.stderr[-3000:]
    meta = json.loads(next((tmp_path / "checkpoints" / "2" / "meta").glob("*")).read_text())
    summary = run_rl_job("configs/quickstart.py", {**overrides, "train.steps": 3}, timeout=900)
    assert summary.env == "room"
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["resumed_from_step"] == 2 and report["curriculum"]["replay_by"] == "layout"
    assert set(report["success_by_grade"]["after"]) == {"0"}  # the 2 held-out tasks lie in layout 0

    trajectories = [json.loads(line) for line in (tmp_path / "trajectories.jsonl").read_text().splitlines()]
    assert sorted({t["train_step"] for t in trajectories}) == [0, 1, 2]
    assert any(t["replay_turns"] for t in trajectories)
    for t in trajectories:  # replayed turns in the prompt, no loss or log-prob on them; the step's record
        first_turn = t["turn_spans"][0][0] if t["turn_spans"] else len(t["token_ids"])
        assert not any(t["loss_mask"][:first_turn]) and not any(t["logprobs"][:first_turn])
        assert t["curriculum"]["stage"] == (0 if t["train_step"] < 2 else 1)
    # Step 2 ran in the resumed process: each layout's k is the one the checkpoint of step 2 kept (a
    # task's demonstration, where the checkpoint has none yet, counted by the oracle played in-process).
    standing = Standing(settings.signal(quickstart_with(CURRICULUM_JOB)), RoomEnv.task_info().metadata, meta["episodes"][0])
    resumed = [t for t in trajectories if t["train_step"] == 2]
    assert any(standing.unit(t["task_id"]) in standing.replay_turns for t in resumed)  # a layout played before the kill
    for t in resumed:
        standing.oracle_turns.setdefault(t["task_id"], len(oracle_moves(t["task_id"], RoomEnv)))
        assert t["replay_turns"] == standing.turns(t["task_id"])
    # Held-out evaluation starts every episode at the task's start.
    for name in ("eval_before.jsonl", "eval_after.jsonl"):
        assert all(json.loads(line)["replay_turns"] == 0 for line in (tmp_path / name).read_text().splitlines())
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3]
    for m in metrics:
        assert m["dynamic_sampling/extra_groups"] <= 2 and "replay/turns_mean" in m and m["pass_rate/known_tasks"] >= 2


def quickstart_with(overrides: dict) -> ml_collections.ConfigDict:
    """The quickstart's config with the curriculum keys of `overrides` (what `settings.signal` reads)."""
    config = quickstart.get_config()
    for key, value in overrides.items():
        if key.startswith("curriculum."):
            config.curriculum[key.split(".", 1)[1]] = value
    return config
