"""ScienceWorld: the task table against the live simulator, reward = score delta, failures,
valid actions only on request, the gold-path oracle (on every task name), the warm pool, and
bad input through a real server.

In-process checks share one engine (a JVM); server checks share one server per module.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import re

import aiohttp
import psutil
import pytest
from scienceworld.constants import ID2TASK

from agentgym_jax.envs.client import EnvClient
from agentgym_jax.envs.protocol import ProtocolError
from environments.sciworld import tasks as task_list
from environments.sciworld.env import STEP_LIMIT, SciWorldEnv
from environments.sciworld.pool import SimulatorPool
from environments.sciworld.simulator import JavaMissing, Simulator
from tests.servers import request_json, server_pid, start_server
from tests.test_environments import _run_oracle


def task_id(name: str, variation: int) -> int:
    return next(i for i, t in enumerate(task_list.tasks()) if t.name == name and t.variation == variation)


def first_test_id_per_task() -> dict[str, int]:
    out: dict[str, int] = {}
    for i in task_list.splits()["test"]:
        out.setdefault(task_list.tasks()[i].name, i)
    return out


@pytest.fixture(scope="module")
def simulator():
    sim = Simulator()
    yield sim
    sim.close()


@pytest.fixture(scope="module")
def url():
    with start_server("sciworld", env_vars={"SCIWORLD_POOL_SIZE": "3"}, timeout_s=120) as base:
        yield base


# --- the task list ---------------------------------------------------------------------------


def test_task_table_matches_the_simulator(simulator):
    """AgentGym's flattening and the simulator's own split, recomputed from the live engine."""
    excluded = {"5-1", "5-2", "9-1", "9-2", "9-3", "10-1", "10-2"}
    expected = []
    for catalogue_id, name in ID2TASK.items():  # the simulator's catalogue order
        if catalogue_id in excluded:
            continue
        simulator.load(name, 0)
        split_of = {v: s for s, vs in [("train", simulator._engine.getVariationsTrain()),
                                       ("dev", simulator._engine.getVariationsDev()),
                                       ("test", simulator._engine.getVariationsTest())] for v in vs}
        count = simulator._engine.getTaskMaxVariations(name)
        assert sorted(split_of) == list(range(count)), name
        expected += [(catalogue_id, name, v, split_of[v]) for v in range(count)]
    got = [(t.task_id, t.name, t.variation, t.split) for t in task_list.tasks()]
    assert got == expected and len(got) == 4639


def test_splits_partition_the_ids_and_test_has_every_task_name():
    splits = task_list.splits()
    ids = sorted(i for s in splits.values() for i in s)
    assert ids == list(range(len(task_list.tasks())))
    names = {t.name for t in task_list.tasks()}
    assert len(names) == 23
    for split in ("train", "dev", "test"):
        assert {task_list.tasks()[i].name for i in splits[split]} == names, split


def test_a_missing_java_runtime_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no `java` here
    monkeypatch.delenv("JAVA_HOME", raising=False)
    with pytest.raises(JavaMissing, match="Java runtime"):
        Simulator()


# --- the environment in-process ----------------------------------------------------------------


class CountingSimulator:
    """The real engine, counting the calls that list valid actions."""

    def __init__(self, simulator: Simulator):
        self._simulator = simulator
        self.valid_action_calls = 0

    def valid_actions(self) -> list[str]:
        self.valid_action_calls += 1
        return self._simulator.valid_actions()

    def __getattr__(self, name):
        return getattr(self._simulator, name)


def play_oracle(env: SciWorldEnv, max_steps: int = 150) -> list:
    results = []
    while len(results) < max_steps:
        results.append(env.step(env.oracle_action()))
        if results[-1].done:
            break
    return results


def test_reward_is_the_score_delta_and_valid_actions_only_on_request(simulator):
    counting = CountingSimulator(simulator)
    env = SciWorldEnv(counting)
    first = env.reset(task_id("use-thermometer", 405))
    assert first.startswith("This room is called")  # the description is a field of its own, as in AgentGym
    assert env.reset_fields() == {"task_description": simulator.task_description()}
    results = play_oracle(env)
    assert counting.valid_action_calls == 0  # steps, reset and oracle never list valid actions
    scores = [0.0] + [r.info["score"] for r in results]
    assert [r.reward for r in results] == [b - a for a, b in zip(scores, scores[1:])]
    assert len({r.reward for r in results if r.reward > 0}) >= 2  # partial credit along the way
    assert results[-1].done and results[-1].info["success"] and scores[-1] == 100.0
    assert sum(r.reward for r in results) == 100.0 and env.verify()
    assert all(not r.done for r in results[:-1]) and all(0 <= s <= 100 for s in scores)
    actions = env.available_actions()
    assert counting.valid_action_calls == 1 and "look around" in actions and actions == sorted(set(actions))


def test_a_failed_task_ends_with_score_zero(simulator):
    env = SciWorldEnv(simulator)
    env.reset(task_id("find-plant", 225))
    opened = env.step("open door to hallway")
    assert opened.reward > 0 and not opened.done  # moving towards the goal earns partial credit
    failed = env.step("focus on table")  # the task is about a plant
    assert failed.done and failed.info["task_failed"] and not failed.info["success"]
    assert failed.info["score"] == 0.0 and failed.reward == -opened.reward


def test_a_task_id_gives_the_same_text_although_the_engine_reorders_ties(simulator):
    raw = set()
    for _ in range(6):
        simulator.load("boil", 1)  # three wood cups of paint, listed in a random order
        raw.add(simulator.step("look around"))
    env = SciWorldEnv(simulator)
    firsts = {env.reset(task_id("boil", 1)) for _ in range(6)}
    assert len(raw) > 1 and len(firsts) == 1
    (first,) = firsts
    cups = [line for line in first.splitlines() if "wood cup" in line]
    assert cups == sorted(cups) and len(cups) == 3


@pytest.mark.slow  # a hundred `wait`s: ~1000 simulated time steps
def test_the_episode_ends_after_the_step_limit_in_time_steps(simulator):
    env = SciWorldEnv(simulator)
    env.reset(task_id("find-animal", 226))
    moves = [0]
    while len(moves) <= STEP_LIMIT // 10 + 2:
        result = env.step("wait")  # ten time steps each
        moves.append(result.info["moves"])
        if result.done:
            break
    assert result.done and not result.info["success"]
    assert moves[-2] <= STEP_LIMIT < moves[-1] and all(b - a >= 10 for a, b in zip(moves, moves[1:]))


def test_refused_actions_are_invalid_and_take_no_time(simulator):
    env = SciWorldEnv(simulator)
    env.reset(task_id("find-animal", 225))
    for action in ("xyzzy plugh", "open the moon", "é 🙂 " * 50):
        result = env.step(action)
        assert result.info["invalid_action"] and result.reward == 0 and not result.done
        assert result.info["moves"] == 0


def test_oracle_skips_refused_and_free_actions_and_plans_late(simulator):
    env = SciWorldEnv(simulator)
    env.reset(task_id("test-conductivity", 700))
    for action in ("xyzzy", "look around", "inventory", "task"):
        env.step(action)
    gold_start = env.oracle_action()  # planned now, after replaying those four
    env.step(gold_start)
    env.step("look around")
    results = play_oracle(env)
    assert results[-1].info["success"] and env.score() == 100.0


def test_oracle_refuses_once_the_episode_left_the_gold_path(simulator):
    env = SciWorldEnv(simulator)
    env.reset(task_id("find-non-living-thing", 239))
    gold = env.oracle_action()
    env.step("wait1")  # takes time and is not the gold action
    with pytest.raises(ProtocolError, match="left the gold path") as refused:
        env.oracle_action()
    assert refused.value.status == 409 and gold != "wait1"
    env.reset(task_id("find-non-living-thing", 239))
    assert env.oracle_action() == gold  # a reset puts the oracle back


def test_pool_reuses_released_engines_and_closes_on_shutdown():
    pool = SimulatorPool(size=1)
    first = pool.acquire()
    pool.release(first)
    again = pool.acquire()
    assert again is first  # the used (hot) engine is handed out before a fresh spare
    pool.close()
    pool.release(again)  # after close, released engines are shut down
    assert not again.alive() and pool.idle() == 0


# --- through the server ----------------------------------------------------------------------


def new_session(url: str, data_idx: int | None = None) -> int:
    status, created = request_json(url, "POST", "/create", {})
    assert status == 200, created
    if data_idx is not None:
        status, reset = request_json(url, "POST", "/reset", {"id": created["id"], "data_idx": data_idx}, timeout_s=120)
        assert status == 200, reset
    return created["id"]


def test_agentgym_queries_and_reset_fields(url):
    data_idx = task_id("find-living-thing", 240)
    session = new_session(url)
    status, early = request_json(url, "GET", f"/goals?id={session}")
    assert status == 409 and "reset" in early["error"]
    status, reset = request_json(url, "POST", "/reset", {"id": session, "idx": data_idx})  # an alias
    assert status == 200 and reset["score"] == 0 and reset["reward"] == 0
    description = request_json(url, "GET", f"/task_description?id={session}")[1]["task_description"]
    # AgentGym's server: `task_description` beside the "look around" observation; its client joins them
    assert reset["task_description"] == description and "living thing" in description
    assert reset["observation"].startswith("This room is called")
    assert request_json(url, "GET", f"/observation?id={session}")[1]["observation"] == reset["observation"]

    async def client_reset() -> str:
        async with aiohttp.ClientSession() as http:
            return await EnvClient(url, http).reset(session, data_idx)

    assert asyncio.run(client_reset()) == f"{description}\n{reset['observation']}"  # ours joins them the same way
    assert "focus on" in request_json(url, "GET", f"/goals?id={session}")[1]["goals"]
    hint = request_json(url, "GET", f"/action_hint?id={session}")[1]
    assert "look around" in hint["possible_actions"] and "agent" in hint["possible_objects"]
    status, tasks = request_json(url, "GET", "/tasks")
    assert tasks["success_threshold"] == 100 and tasks["metadata"]["task_names"][data_idx] == "find-living-thing"
    assert tasks["splits"] == task_list.splits()
    request_json(url, "POST", "/close", {"id": session})


def test_bad_input_gets_clear_errors_and_the_session_survives(url):
    session = new_session(url)
    status, body = request_json(url, "POST", "/step", {"id": session, "action": "look around"})
    assert status == 409 and "reset" in body["error"]
    for bad in (4639, -1, "three", 1.5, None):
        status, body = request_json(url, "POST", "/reset", {"id": session, "data_idx": bad})
        assert status == 400 and "data_idx" in body["error"], (bad, body)
    data_idx = task_id("find-plant", 225)
    request_json(url, "POST", "/reset", {"id": session, "data_idx": data_idx}, timeout_s=120)
    status, body = request_json(url, "POST", "/step", {"id": session, "action": "x" * 10_000})
    assert status == 200 and body["info"]["invalid_action"] and body["reward"] == 0
    request_json(url, "POST", "/step", {"id": session, "action": "Thought: wait.\nAction: wait1"})
    status, body = request_json(url, "GET", f"/oracle_action?id={session}", timeout_s=120)
    assert status == 409 and "gold path" in body["error"]
    status, body = request_json(url, "POST", "/step", {"id": session, "action": "focus on table"})
    assert status == 200 and body["done"] and body["info"]["task_failed"]  # not broken by the 409
    status, body = request_json(url, "POST", "/step", {"id": session, "action": "look around"})
    assert status == 409 and "done" in body["error"]
    request_json(url, "POST", "/close", {"id": session})


def test_creates_hold_no_engine_and_the_default_cap_follows_from_memory():
    """A session takes its JVM (~400 MB) at its first reset: eight creates at once (clients that
    may time out and never use them) start none. Without --max_sessions the cap is what half the
    machine's memory holds of engines, less the warm ones, named in /health (not 1024: 340 GB)."""
    with start_server("sciworld", env_vars={"SCIWORLD_POOL_SIZE": "0"}, timeout_s=120) as url:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            created = list(pool.map(lambda _: request_json(url, "POST", "/create", {}, timeout_s=5), range(8)))
        assert all(status == 200 for status, _ in created)
        assert not [p for p in psutil.Process(server_pid(url)).children(recursive=True) if p.name() == "java"]
        for _, answer in created:
            assert request_json(url, "POST", "/close", {"id": answer["id"]})[0] == 200
        health = request_json(url, "GET", "/health")[1]
        engines = int(re.fullmatch(rf"memory: 50% of [\d.]+ GiB holds (\d+) engines of "
                                   rf"{SciWorldEnv.session_memory_mb:g} MiB, less 0 kept idle", health["max_sessions_from"])[1])
        assert health["max_sessions"] == max(1, engines)
        assert engines * SciWorldEnv.session_memory_mb <= 0.5 * psutil.virtual_memory().total / 2**20


def test_oracle_solves_every_task_name(url):
    task_ids = sorted(first_test_id_per_task().values())
    assert len(task_ids) == 23
    solved = asyncio.run(_run_oracle(url, task_ids, concurrency=2))
    assert all(solved.values()), [task_list.tasks()[i] for i, ok in solved.items() if not ok]


@pytest.mark.slow
def test_oracle_solves_three_test_variations_of_every_task(url):
    by_name: dict[str, list[int]] = {}
    for i in task_list.splits()["test"]:
        by_name.setdefault(task_list.tasks()[i].name, []).append(i)
    task_ids = sorted({ids[k] for ids in by_name.values() for k in (0, len(ids) // 2, -1)})
    assert len(task_ids) >= 50
    solved = asyncio.run(_run_oracle(url, task_ids, concurrency=2))
    assert all(solved.values()), [task_list.tasks()[i] for i, ok in solved.items() if not ok]
