"""The difficulty curriculum on TextCraft's own grading (crafting depth): which training tasks each
stage draws, resume-safety, and the configs it refuses."""

import collections

import ml_collections
import pytest

from agentgym_jax.config import ConfigError
from agentgym_jax.rl import curriculum
from agentgym_jax.train import settings
from agentgym_jax.job.play import task_batch
from environments.textcraft.env import TextCraftEnv


@pytest.fixture(scope="module")
def info():
    return TextCraftEnv.task_info()


def test_each_stage_draws_only_training_tasks_up_to_its_depth(info):
    depth, train = info.metadata["depth"], info.splits["train"]
    plan = settings.curriculum(ml_collections.ConfigDict({"key": "depth", "max_grades": (1, 2, 4), "steps_per_stage": 3}))
    by_depth = collections.Counter(depth[i] for i in train)
    assert {1, 2, 3} <= set(by_depth)  # the split grades its tasks 1..4
    for step, bound in [(0, 1), (2, 1), (3, 2), (5, 2), (6, 4), (40, 4)]:
        pool = plan.pool(train, info.metadata, step)
        assert len(pool) == sum(n for d, n in by_depth.items() if d <= bound), step
        assert set(pool) <= set(train) and all(depth[i] <= bound for i in pool)
    # A step's batch comes from its stage's pool: 8 tasks a step over the first stage are all depth 1.
    drawn = [t for step in range(3) for t in task_batch(plan.pool(train, info.metadata, step), step, 8, seed=0)]
    assert {depth[t] for t in drawn} == {1}
    assert len(set(drawn)) == len(drawn)  # consecutive slices of one permutation: no repeats within an epoch


def test_off_draws_every_training_task_and_a_resumed_step_draws_the_same(info):
    train = info.splits["train"]
    assert curriculum.Curriculum().pool(train, info.metadata, 7) == list(train)
    plan = curriculum.Curriculum(key="depth", max_grades=(1, 3), steps_per_stage=4)
    resumed = curriculum.Curriculum(**vars(plan))  # a fresh object: a run restarted from its config
    assert [resumed.pool(train, info.metadata, s) for s in range(10)] == [plan.pool(train, info.metadata, s) for s in range(10)]


@pytest.mark.parametrize("config,message", [
    ({"key": "depth"}, "key and curriculum.max_grades go together"),
    ({"max_grades": (1,)}, "key and curriculum.max_grades go together"),
    ({"key": "depth", "max_grades": (2, 1)}, "max_grades must not decrease"),
    ({"key": "depth", "max_grades": (1,), "steps_per_stage": 0}, "steps_per_stage must be a positive integer"),
])
def test_bad_configs_are_refused(config, message):
    with pytest.raises(ConfigError, match=message):
        settings.curriculum(ml_collections.ConfigDict(config))


def test_a_key_the_environment_lacks_or_an_empty_stage_is_refused_before_any_work(info):
    with pytest.raises(ValueError, match=r"curriculum.key='depht'.*it has: depth"):
        curriculum.Curriculum(key="depht", max_grades=(1,)).check(info.splits["train"], info.metadata)
    with pytest.raises(ValueError, match=r"stage 0 \(grade <= 0\) admits no training task"):
        curriculum.Curriculum(key="depth", max_grades=(0, 1)).check(info.splits["train"], info.metadata)
    with pytest.raises(ValueError, match="step must be >= 0"):
        curriculum.Curriculum(key="depth", max_grades=(1,)).pool(info.splits["train"], info.metadata, -1)
