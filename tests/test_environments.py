"""Every registered environment through a real server: endpoints, oracle, determinism, invalid
actions, hostile replies.

One server per environment per module, registered environments all (a new one joins by its line
in `environments/registry.py`). An environment whose own module does not exist yet is skipped
(it is being written); any other import error fails.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import time

import aiohttp
import pytest

from environments.registry import ENVIRONMENTS, get_environment
from tests.servers import health_latencies, request_json, start_server

MAX_ORACLE_STEPS = 300  # far above any environment's own episode limit
NONSENSE = "Thought: I will do something odd.\nAction: xyzzy plugh 42 ???"
SERVER_START_TIMEOUT_S = 600  # a first start may build an environment's data (TextWorld's games: once per machine)

# Replies built to make a parser or an engine slow or crash: quadratic regexes (a lazy group
# after a repeated tag, whitespace before a fence), numbers too long for int(), text too long to
# type. Every environment gets every one, 1 MB each (the servers here lift the action cap to let
# them through): each must be an ordinary turn answered within a second, /health staying fast.
HOSTILE_CHARS = 1_000_000
HOSTILE_REPLIES = {
    "one_long_line": "Action: " + "x" * HOSTILE_CHARS,
    "action_markers": "Action:" * (HOSTILE_CHARS // 7),
    "newlines": "Action:" + "\n" * HOSTILE_CHARS + "x",
    "search_tags": "<search>" * (HOSTILE_CHARS // 8),
    "answer_tags": "<answer>x</answer>" + "<answer>" * (HOSTILE_CHARS // 8),
    "brackets": "Action: " + "[" * HOSTILE_CHARS,
    "spaces_before_a_fence": "Action: execute SELECT 1" + " " * HOSTILE_CHARS + "x",
    "fenced_spaces": "Action: answer ```sql\n" + " " * HOSTILE_CHARS + "x",
    "nested_sql": "Action: execute SELECT " + "(" * HOSTILE_CHARS,
    "a_long_number": "Action: " + "9" * HOSTILE_CHARS,
    "a_long_bracketed_number": "Action: [" + "9" * HOSTILE_CHARS + "]",
    "a_long_count": "Action: get " + "9" * HOSTILE_CHARS + " oak log",
    "a_long_ingredient_count": "Action: craft 1 stick using " + "9" * HOSTILE_CHARS + " oak planks",
    "a_long_object_number": "Action: go to the red ball " + "9" * HOSTILE_CHARS,
    "a_long_element_ref": "Action: click [" + "9" * HOSTILE_CHARS + "]",
    "long_text_to_type": 'Action: type [1] "' + "a" * HOSTILE_CHARS + '"',
    "two_byte_characters": "Action: " + "\u00e9" * (HOSTILE_CHARS // 2),
}


def _require_module(name: str) -> None:
    module = ENVIRONMENTS[name].split(":")[0]
    try:
        get_environment(name)
    except ModuleNotFoundError as e:
        if e.name and (module == e.name or module.startswith(e.name + ".")):
            pytest.skip(f"{module} does not exist yet")
        raise
    importlib.import_module(module)


@pytest.fixture(scope="module", params=sorted(ENVIRONMENTS))
def served(request):
    """(name, url, /tasks body) of a server started with PYTHONHASHSEED=1, its action cap lifted
    past `HOSTILE_CHARS` (so parsers and engines face the hostile replies themselves)."""
    _require_module(request.param)
    with start_server(request.param, env_vars={"PYTHONHASHSEED": "1"}, timeout_s=SERVER_START_TIMEOUT_S,
                      max_action_chars=2 * HOSTILE_CHARS, max_body_bytes=16 * HOSTILE_CHARS) as url:
        status, tasks = request_json(url, "GET", "/tasks")
        assert status == 200, tasks
        yield request.param, url, tasks


def oracle_ids(name: str, tasks: dict) -> list[int]:
    """Every task id for Maze; otherwise the env class's `oracle_sweep_episodes` (100 unless
    lowered) test ids spread evenly over the test split."""
    if name == "maze":
        return list(range(tasks["num_tasks"]))
    test = tasks["splits"]["test"]
    if "oracle_task_ids" in tasks["metadata"]:  # only some of its tasks have an oracle (TextArena)
        with_oracle = set(tasks["metadata"]["oracle_task_ids"])
        test = [i for i in test if i in with_oracle]
    count = get_environment(name).oracle_sweep_episodes
    if len(test) <= count:
        return list(test)
    stride = len(test) / count
    return sorted({test[int(i * stride)] for i in range(count)})


def test_tasks_describe_fixed_splits(served):
    name, url, tasks = served
    assert tasks["env"] == name and tasks["instruction"].strip()
    assert tasks["num_tasks"] > 0
    seen: set[int] = set()
    for split, ids in tasks["splits"].items():
        assert ids == sorted(ids) and ids, split
        assert all(0 <= i < tasks["num_tasks"] for i in ids), split
        assert not seen & set(ids), f"split {split} overlaps another"
        seen |= set(ids)
    assert "test" in tasks["splits"] and "train" in tasks["splits"]


def test_every_endpoint(served):
    name, url, tasks = served
    task_id = tasks["splits"]["test"][0]
    status, created = request_json(url, "POST", "/create", {})
    assert status == 200 and isinstance(created["id"], int)
    session = created["id"]
    status, health = request_json(url, "GET", "/health")
    assert status == 200 and health["env"] == name and health["sessions"] >= 1
    status, reset = request_json(url, "POST", "/reset", {"id": session, "data_idx": task_id})
    assert status == 200 and reset["observation"].strip() and reset["done"] is False
    assert request_json(url, "GET", f"/observation?id={session}")[1]["observation"] == reset["observation"]
    status, actions = request_json(url, "GET", f"/available_actions?id={session}")
    assert status == 200 and actions["available_actions"]
    assert all(isinstance(a, str) and a for a in actions["available_actions"])
    status, oracle = request_json(url, "GET", f"/oracle_action?id={session}")
    assert status == 200 and isinstance(oracle["action"], str) and oracle["action"]
    status, result = request_json(url, "POST", "/step", {"id": session, "action": f"Thought: follow.\nAction: {oracle['action']}"})
    assert status == 200, result
    assert isinstance(result["observation"], str) and isinstance(result["reward"], (int, float))
    assert isinstance(result["done"], bool)
    assert result["info"]["invalid_action"] is False
    assert {"success", "score"} <= set(result["info"])
    if not result["done"]:
        assert request_json(url, "GET", f"/observation?id={session}")[1]["observation"] == result["observation"]
    assert request_json(url, "POST", "/close", {"id": session}) == (200, {"id": session, "closed": True})
    assert request_json(url, "GET", f"/observation?id={session}")[0] == 404


def test_invalid_action_is_an_observation_with_zero_reward(served):
    name, url, tasks = served
    _, created = request_json(url, "POST", "/create", {})
    session = created["id"]
    request_json(url, "POST", "/reset", {"id": session, "data_idx": tasks["splits"]["test"][0]})
    for text in (NONSENSE, ""):
        status, result = request_json(url, "POST", "/step", {"id": session, "action": text})
        assert status == 200, result
        assert result["reward"] == 0 and result["done"] is False and result["observation"].strip()
        assert result["info"]["invalid_action"] is True and result["info"]["success"] is False
    assert result["info"]["invalid_actions"] == 2
    request_json(url, "POST", "/close", {"id": session})


def test_hostile_replies_are_quick_ordinary_turns_and_health_stays_fast(served):
    name, url, tasks = served
    task = tasks["splits"]["test"][0]
    session = request_json(url, "POST", "/create", {})[1]["id"]
    assert request_json(url, "POST", "/reset", {"id": session, "data_idx": task})[0] == 200
    bodies = {key: json.dumps({"id": session, "action": text}).encode() for key, text in HOSTILE_REPLIES.items()}
    answered_s = {}
    with health_latencies(url) as health_s:
        for key, body in bodies.items():
            start = time.monotonic()
            status, result = request_json(url, "POST", "/step", data=body)
            answered_s[key] = time.monotonic() - start
            assert status == 200, (key, result)
            assert result["reward"] == 0 and result["info"]["success"] is False, (key, result["observation"][:200])
            if result["done"]:
                assert request_json(url, "POST", "/reset", {"id": session, "data_idx": task})[0] == 200
    slow = {key: round(s, 2) for key, s in answered_s.items() if s >= 1.0}
    assert not slow, f"{name}: replies answered in 1 s or more: {slow}"
    # /health within 100 ms; on a loaded machine scheduling alone can delay one answer, so the
    # 90th percentile is held to that, and every answer to a second (a blocked server: minutes).
    assert len(health_s) >= 10 and sorted(health_s)[int(0.9 * len(health_s))] < 0.1 and max(health_s) < 1.0, \
        f"{name}: /health answers took {sorted(round(s, 3) for s in health_s)[-5:]} s at the slowest"
    request_json(url, "POST", "/close", {"id": session})


async def _oracle_episode(http: aiohttp.ClientSession, url: str, task_id: int) -> bool:
    """Follows `/oracle_action` until done; True when the environment reports success."""
    async with http.post(f"{url}/create", json={}) as answer:
        session = (await answer.json())["id"]
    try:
        async with http.post(f"{url}/reset", json={"id": session, "data_idx": task_id}) as answer:
            assert answer.status == 200, await answer.text()
        for _ in range(MAX_ORACLE_STEPS):
            async with http.get(f"{url}/oracle_action", params={"id": session}) as answer:
                assert answer.status == 200, await answer.text()
                action = (await answer.json())["action"]
            async with http.post(f"{url}/step", json={"id": session, "action": action}) as answer:
                assert answer.status == 200, await answer.text()
                result = await answer.json()
            if result["done"]:
                return bool(result["info"]["success"])
        return False
    finally:
        async with http.post(f"{url}/close", json={"id": session}):
            pass


async def _run_oracle(url: str, task_ids: list[int], concurrency: int = 32) -> dict[int, bool]:
    limit = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
        async def one(task_id: int) -> bool:
            async with limit:
                return await _oracle_episode(http, url, task_id)

        results = await asyncio.gather(*(one(t) for t in task_ids))
    return dict(zip(task_ids, results))


def test_oracle_solves_the_tasks(served):
    name, url, tasks = served
    task_ids = oracle_ids(name, tasks)
    env_cls = get_environment(name)
    assert len(task_ids) >= min(env_cls.oracle_sweep_episodes, len(tasks["splits"]["test"]))
    solved = asyncio.run(_run_oracle(url, task_ids, env_cls.oracle_sweep_concurrency))
    rate = sum(solved.values()) / len(solved)
    failed = [t for t, ok in solved.items() if not ok]
    assert rate >= 0.99, f"{name}: oracle solved {rate:.1%} of {len(solved)} tasks; failed ids {failed[:20]}"


def test_same_task_same_first_observation_across_hash_seeds(served):
    name, url, tasks = served
    ids = sorted(set(tasks["splits"]["test"][:5] + tasks["splits"]["train"][:5] + [tasks["num_tasks"] - 1]))

    def first_observations(server_url: str) -> dict[int, str]:
        _, created = request_json(server_url, "POST", "/create", {})
        out = {}
        for task_id in ids:
            status, reset = request_json(server_url, "POST", "/reset", {"id": created["id"], "data_idx": task_id})
            assert status == 200, reset
            out[task_id] = reset["observation"]
        request_json(server_url, "POST", "/close", {"id": created["id"]})
        return out

    with start_server(name, env_vars={"PYTHONHASHSEED": "2"}) as other_url:
        assert request_json(other_url, "GET", "/tasks")[1] == tasks
        assert first_observations(other_url) == first_observations(url)
