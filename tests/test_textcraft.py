"""TextCraft rules on hand-worked recipes, the oracle on every task, and task-id determinism.

Hand-worked facts from the recipe files of the `textcraft` package: `oak_planks.json` makes 4
oak planks from 1 `oak_logs`; `crafting_table.json` is a 2x2 of the `planks` tag;
`golden_carrot.json` is 8 gold nuggets around a carrot.
"""

import json
import os
import subprocess
import sys

import pytest

from environments.textcraft.env import MAX_DISTRACTORS, TextCraftEnv
from environments.textcraft.recipes import cookbook

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _task(goal: str) -> int:
    return cookbook().goals.index("minecraft:" + goal)


@pytest.fixture
def table_env() -> TextCraftEnv:
    env = TextCraftEnv()
    env.reset(_task("crafting_table"))
    return env


def test_recipes_read_from_the_package():
    book = cookbook()
    assert [r.command for r in book.recipes["minecraft:golden_carrot"]] == [
        "craft 1 golden carrot using 8 gold nugget, 1 carrot"
    ]
    assert [r.command for r in book.recipes["minecraft:crafting_table"]] == [
        "craft 1 crafting table using 4 planks"
    ]
    assert "minecraft:planks" in book.tags and "minecraft:oak_planks" in book.members("minecraft:planks")
    # logs -> planks -> table; planks from logs; gold nuggets and carrots are fetched.
    assert book.depth["minecraft:crafting_table"] == 2
    assert book.depth["minecraft:oak_planks"] == 1
    assert book.depth["minecraft:golden_carrot"] == 1


def test_get_craft_and_tag_ingredients(table_env):
    env = table_env
    assert env.observation().startswith("Crafting commands:\n")
    assert env.observation().endswith("\n\nGoal: craft crafting table.")
    assert "craft 1 crafting table using 4 planks" in env.available_actions()

    r = env.step("get 1 oak logs")
    assert (r.observation, r.reward, r.done, r.info["invalid_action"]) == ("Got 1 oak logs", 0.0, False, False)
    assert env.inventory == {"minecraft:oak_logs": 1}

    r = env.step("craft 4 oak planks using 1 oak logs")
    assert r.observation == "Crafted 4 oak planks" and not r.info["invalid_action"]
    assert env.inventory == {"minecraft:oak_planks": 4}

    # Wrong ingredient count: refused, nothing consumed.
    r = env.step("craft 1 crafting table using 3 oak planks")
    assert r.info["invalid_action"] and r.reward == 0.0 and not r.done
    assert r.observation == "Could not find a valid recipe for crafting table"
    assert env.inventory == {"minecraft:oak_planks": 4}
    # The tag's own name is not an item one can hold.
    r = env.step("craft 1 crafting table using 4 planks")
    assert r.info["invalid_action"] and r.observation == "Could not find enough items to craft crafting table"
    assert env.step("inventory").observation == "Inventory: [oak planks] (4)"
    assert not env.verify()

    # A concrete item of the tag: success, reward 1, done.
    r = env.step("craft 1 crafting table using 4 oak planks")
    assert (r.observation, r.reward, r.done, r.info["invalid_action"]) == ("Crafted 1 crafting table", 1.0, True, False)
    assert r.info["success"] and env.verify() and env.score() == 1.0
    assert env.inventory == {"minecraft:crafting_table": 1}


@pytest.mark.parametrize(
    "action, observation",
    [
        ("get 1 oak planks", "Could not find oak planks"),  # craftable items are not fetched
        ("get 1 planks", "Could not find planks"),  # nor tags
        ("get 2 unobtainium", "Could not find unobtainium"),
        ("get 0 oak logs", "Could not get 0 oak logs: the quantity must be at least 1"),
        ("craft 4 oak planks using oak logs", "Wrong item format: oak logs"),
        ("craft 4 oak planks using 1 oak logs", "Could not find enough items to craft oak planks"),
        ("dance", "Could not execute dance"),
    ],
)
def test_invalid_actions(table_env, action, observation):
    r = table_env.step(action)
    assert (r.observation, r.reward, r.done, r.info["invalid_action"]) == (observation, 0.0, False, True)
    assert table_env.inventory == {} and table_env.observation() == observation


def test_parse_action_normalizes_model_text():
    text = "Thought:\nI need logs first.\n\nAction:\nGet 1 Oak Logs.\n"
    assert TextCraftEnv.parse_action(text) == "get 1 oak logs"
    assert TextCraftEnv.parse_action("Thought: hmm\nAction:  \n") is None


def test_task_info_splits_and_depths():
    info = TextCraftEnv.task_info()
    train, test = info.splits["train"], info.splits["test"]
    assert train == sorted(train) and test == sorted(test)
    assert not set(train) & set(test)
    assert sorted(train + test) == list(range(info.num_tasks))
    assert len(test) >= 100
    depth = info.metadata["depth"]
    assert len(depth) == info.num_tasks and depth == sorted(depth) and min(depth) >= 1
    assert depth[_task("crafting_table")] == 2
    assert {depth[i] for i in test} == set(depth)  # the test split covers every depth


def test_commands_are_the_recipe_tree_plus_seeded_distractors():
    env = TextCraftEnv()
    idx = _task("crafting_table")
    first = env.reset(idx)
    tree = {r.command for r in cookbook().recipe_tree("minecraft:crafting_table")}
    lines = env.commands().splitlines()
    assert tree <= set(lines) and len(lines) == len(set(lines))
    assert 0 < len(set(lines) - tree) <= MAX_DISTRACTORS
    assert "craft 4 oak planks using 1 oak logs" in tree
    env.reset(idx + 1)
    assert env.reset(idx) == first and env.goal() == "crafting table"
    with pytest.raises(ValueError, match="out of range"):
        env.reset(TextCraftEnv.task_info().num_tasks)


def _play_oracle(env: TextCraftEnv, max_steps: int = 200) -> bool:
    for _ in range(max_steps):
        r = env.step(env.oracle_action())
        assert not r.info["invalid_action"], r.observation
        if r.done:
            return r.reward == 1.0 and env.verify()
    return False


def test_oracle_solves_every_task():
    info = TextCraftEnv.task_info()
    env = TextCraftEnv()
    solved = {}
    for idx in range(info.num_tasks):
        env.reset(idx)
        solved[idx] = _play_oracle(env)
    rate = sum(solved[i] for i in info.splits["test"]) / len(info.splits["test"])
    print(f"textcraft oracle: test {rate:.3f} of {len(info.splits['test'])}, all {sum(solved.values())}/{len(solved)}")
    assert rate >= 0.99
    assert all(solved.values())


def test_oracle_replans_mid_episode():
    env = TextCraftEnv()
    for goal in ("crafting_table", "purple_banner", "piston"):
        env.reset(_task(goal))
        # Detours: a wrong kind of planks, some spare sticks' worth, an invalid action.
        for action in ("get 2 birch logs", "craft 4 birch planks using 1 birch logs", "get 5 string", "dance"):
            env.step(action)
        assert _play_oracle(env), goal


def test_task_ids_do_not_depend_on_hash_seed():
    ids = [0, 7, _task("crafting_table"), len(cookbook().goals) - 1]
    code = (
        "import json, sys; from environments.textcraft.env import TextCraftEnv; e = TextCraftEnv(); "
        f"print(json.dumps([e.reset(i) for i in {ids}]))"
    )
    outputs = []
    for seed in ("1", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": REPO}
        proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        outputs.append(proc.stdout)
    local = TextCraftEnv()
    assert json.loads(outputs[0]) == json.loads(outputs[1]) == [local.reset(i) for i in ids]


def test_recipe_decides_the_output_count(table_env):
    """The count written before the target is ignored, as in AgentGym: one craft = one recipe."""
    table_env.step("get 1 oak logs")
    r = table_env.step("craft 9 oak planks using 1 oak logs")
    assert r.observation == "Crafted 4 oak planks" and table_env.inventory == {"minecraft:oak_planks": 4}


def test_progress_shaping_pays_each_planned_command_and_exactly_one_on_success():
    plain, shaped = TextCraftEnv(), TextCraftEnv()
    shaped.reward_shaping = "progress"
    for env in (plain, shaped):
        env.reset(300)  # mossy stone bricks: get 4 stone, craft stone bricks, get vine, craft the goal
    detours = ["get 1 oak logs", "inventory", "craft 1 nothing using 1 dirt"]  # unneeded, neutral, invalid
    assert [plain.step(a).reward for a in detours] == [shaped.step(a).reward for a in detours] == [0.0] * 3
    for env in (plain, shaped):
        rewards = []
        while not env.verify():
            rewards.append(env.step(env.oracle_action()).reward)
        assert sum(rewards) == 1.0 and env.verify()
    assert rewards == [1 / 64] * 3 + [1 - 3 / 64]  # the last list is the shaped episode's
    shaped.reset(300)
    assert shaped.step("get 4 stone").reward == 1 / 64
    assert shaped.step("craft 6 stone slab using 3 stone").reward == -1 / 64  # spends stone the plan needed: undone progress
