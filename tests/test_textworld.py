"""TextWorld household games: the seeded game set, play through TextWorld's state tracking,
invalid commands, the walkthrough, the re-planning oracle, and the oracle over a real server.

The game set is made once per machine into the default cache (`python -m
environments.textworld.make_games`; about 2.5 CPU-minutes) and reused by every later run.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from environments.textworld import games
from environments.textworld.env import TextWorldEnv
from tests.servers import request_json, start_server
from tests.test_environments import _run_oracle


@pytest.fixture(scope="module")
def game_dir():
    return games.ensure_games()


@pytest.fixture(scope="module")
def url(game_dir):
    with start_server("textworld") as served:
        yield served


def _id(name: str) -> int:
    return [s.name for s in games.specs()].index(name)


def _play(env: TextWorldEnv, commands) -> list:
    results = []
    for command in commands:
        results.append(env.step(command))
        if results[-1].done:
            break
    return results


@pytest.mark.parametrize("text, command", [
    ("Thought: I need the recipe.\nAction: Examine the Cookbook.", "examine the cookbook"),
    ("Action:   take  red apple from counter ", "take red apple from counter"),
    ("go north", "go north"),
    ("Thought: hmm\nAction:", None),
])
def test_parser_normalizes_commands(text, command):
    assert TextWorldEnv.parse_action(text) == command


def test_game_set_is_sorted_unique_and_covers_both_themes(game_dir):
    names = [s.name for s in games.specs()]
    assert names == sorted(names) and len(set(names)) == len(names) >= 50
    info = TextWorldEnv.task_info()
    assert info.metadata["game"] == names and set(info.metadata["theme"]) == {"cooking", "treasure_hunter"}
    assert {info.metadata["theme"][i] for i in info.splits["test"]} == {"cooking", "treasure_hunter"}
    assert all(games.is_made(s) for s in games.specs())


def test_generation_is_deterministic_given_the_seed(game_dir, tmp_path):
    spec = games.specs()[_id("treasure_hunter-03-s002")]
    seed = games.make_game(spec, tmp_path)
    fresh = json.loads((tmp_path / f"{spec.name}.json").read_text())
    cached = json.loads(games.game_file(spec).with_suffix(".json").read_text())
    assert seed == spec.seed and fresh == cached
    assert fresh["metadata"]["walkthrough"] and (tmp_path / f"{spec.name}.z8").stat().st_size > 0


def test_first_observation_states_the_goal_and_lists_admissible_commands(game_dir):
    env = TextWorldEnv()
    cooking = env.reset(_id("cooking-medium-s001"))
    assert cooking.startswith("You are hungry!") and "-= " in cooking  # no title art, a room header
    assert "cookbook" in cooking and "look" in env.available_actions()
    assert env.available_actions() == sorted(env._state["admissible_commands"])
    hunt = env.reset(_id("treasure_hunter-12-s001"))
    assert "$$" not in hunt and env.score() == 0.0 and not env.verify()
    env.close()


def test_inadmissible_command_is_invalid_and_not_played(game_dir):
    env = TextWorldEnv()
    env.reset(_id("cooking-easy-s002"))
    state = env._state
    result = env.step("eat the fridge")
    assert result.info["invalid_action"] is True and result.reward == 0 and result.done is False
    assert "Valid commands:" in result.observation and "look" in result.observation
    assert env._state is state  # the game never saw it
    env.close()


@pytest.mark.parametrize("name", ["cooking-hard-s003", "treasure_hunter-15-s002"])
def test_walkthrough_wins_and_rewards_sum_to_one(game_dir, name):
    env = TextWorldEnv()
    env.reset(_id(name))
    walkthrough = env.walkthrough()
    results = _play(env, walkthrough)
    assert results[-1].done and results[-1].info["success"] is True and env.verify()
    assert not any(r.info["invalid_action"] for r in results)
    assert sum(r.reward for r in results) == pytest.approx(1.0) and env.score() == 1.0
    env.close()


def test_oracle_replans_after_a_detour(game_dir):
    env = TextWorldEnv()
    env.reset(_id("cooking-medium-s004"))
    planned = env.oracle_action()
    detour = next(a for a in env.available_actions() if a.startswith("go ") and a != planned)
    assert env.step(detour).info["invalid_action"] is False
    assert env.oracle_action() != planned or not planned.startswith("go ")  # planned from the new room
    results = _play(env, iter(env.oracle_action, None))
    assert results[-1].info["success"] is True
    env.close()


def test_server_bad_input_and_walkthrough_query(url):
    _, created = request_json(url, "POST", "/create", {})
    session = created["id"]
    assert request_json(url, "GET", f"/walkthrough?id={session}") == (200, [])
    assert request_json(url, "POST", "/reset", {"id": session, "data_idx": len(games.specs())})[0] == 400
    assert request_json(url, "POST", "/step", {"id": session, "action": "look"})[0] == 409  # no episode yet
    status, reset = request_json(url, "POST", "/reset", {"id": session, "data_idx": _id("treasure_hunter-05-s001")})
    assert status == 200 and reset["observation"]
    status, walkthrough = request_json(url, "GET", f"/walkthrough?id={session}")
    assert status == 200 and len(walkthrough) == 3  # level 5: a quest of length 3
    assert request_json(url, "POST", "/step", {"id": session, "action": ["look"]})[0] == 400
    request_json(url, "POST", "/close", {"id": session})


def test_oracle_wins_every_game_over_http(url):
    ids = list(range(len(games.specs())))
    solved = asyncio.run(_run_oracle(url, ids, concurrency=4))
    failed = [games.specs()[i].name for i, ok in solved.items() if not ok]
    assert len(ids) >= 50 and not failed, f"oracle failed on {failed}"
