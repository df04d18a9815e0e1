"""`env.tasks`: a job on part of an environment (one TextArena game) sees only those tasks."""

import pytest

from agentgym_jax.config import ConfigError
from agentgym_jax.job.setup import select_tasks
from environments.textarena import games
from environments.textarena.env import TEST_EVERY, TextArenaEnv


@pytest.fixture(scope="module")
def info():
    return TextArenaEnv.task_info()


def test_one_game_keeps_its_own_train_and_test_ids(info):
    picked = select_tasks(info, "game=GuessTheNumber")
    per_game = games.TASKS_PER_GAME
    assert picked.splits["test"] == list(range(0, per_game, TEST_EVERY))
    assert picked.splits["train"] == [i for i in range(per_game) if i % TEST_EVERY]
    assert picked.num_tasks == info.num_tasks and picked.metadata == info.metadata  # ids keep their meaning
    assert info.splits["test"][len(picked.splits["test"])] == per_game  # the full info is untouched


def test_several_values_keep_the_union(info):
    picked = select_tasks(info, "game=FrozenLake, TowerOfHanoi")
    assert {info.metadata["game"][i] for i in picked.splits["train"] + picked.splits["test"]} == {"FrozenLake", "TowerOfHanoi"}
    assert len(picked.splits["train"]) + len(picked.splits["test"]) == 2 * games.TASKS_PER_GAME


def test_empty_spec_keeps_everything(info):
    assert select_tasks(info, "") is info


@pytest.mark.parametrize("spec, words", [
    ("GuessTheNumber", "expected <metadata key>=<value>"),
    ("level=3", "has no per-task metadata 'level'"),
    ("game=Chess", "game=Chess; its values: 2048, FrozenLake"),
    ("game=", "(nothing)"),
])
def test_bad_selection_is_a_config_error_naming_what_exists(info, spec, words):
    with pytest.raises(ConfigError) as e:
        select_tasks(info, spec)
    assert words in str(e.value) and spec in str(e.value)


def test_a_list_of_the_wrong_length_is_not_a_per_task_list(info):
    with pytest.raises(ConfigError, match="it has: game, oracle_task_ids|it has: game$"):
        select_tasks(info, "games=GuessTheNumber")  # `games` lists the 8 game names, not one per task
