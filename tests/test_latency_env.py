"""The async RL bench's environment (`bench/latency_env.py`) on a real server on 127.0.0.1: steps
take their drawn latency, the same per task and turn in every process, episodes are ragged, and
concurrent sessions wait side by side on the server's threads."""

import concurrent.futures
import time

import numpy as np
import pytest

from bench import latency_env
from bench.latency_env import GOAL, MAX_TURNS, PROFILES, episode_turns, step_latency
from tests.servers import request_json, start_server

PROFILE = "miniwob_8"  # ~0.5 s a step: far above an HTTP round trip on a loaded machine
SLACK_S = 0.5  # what a loaded 2-core machine may add to a step's sleep (HTTP, thread hand-off)


@pytest.fixture(scope="module")
def url():
    with start_server(f"bench.latency_env:{latency_env.MiniWoB8LatencyEnv.__name__}") as url:
        yield url


def new_episode(url: str, task: int) -> int:
    status, created = request_json(url, "POST", "/create", {})
    assert status == 200, created
    status, answer = request_json(url, "POST", "/reset", {"id": created["id"], "data_idx": task})
    assert status == 200, answer
    return created["id"]


def timed_step(url: str, session: int, action: str) -> tuple[float, dict]:
    start = time.perf_counter()
    status, answer = request_json(url, "POST", "/step", {"id": session, "action": action})
    assert status == 200, answer
    return time.perf_counter() - start, answer


def test_latencies_are_fixed_per_task_and_turn_and_follow_the_profile():
    draws = {(task, turn): step_latency(PROFILE, task, turn) for task in range(40) for turn in range(1, 6)}
    assert draws == {(task, turn): step_latency(PROFILE, task, turn) for task, turn in draws}
    p = PROFILES[PROFILE]
    unclipped = [s for s in draws.values() if s < p.max_s]
    assert len(set(unclipped)) == len(unclipped) > 0.9 * len(draws)  # every (task, turn) its own draw
    many = np.array([step_latency(PROFILE, task, turn) for task in range(2000) for turn in range(1, 6)])
    assert many.max() <= p.max_s
    # The lognormal's median and sigma (the clip at max_s, ~3% of draws here, narrows sigma a little).
    assert np.median(many) == pytest.approx(p.median_s, rel=0.05)
    assert np.log(many).std() == pytest.approx(p.sigma, rel=0.1)


def test_fit_recovers_a_lognormal():
    sample = np.random.default_rng(0).lognormal(np.log(0.2), 0.6, size=20000)
    p = latency_env.fit(list(sample), sessions=1)
    assert p.median_s == pytest.approx(0.2, rel=0.02)
    assert p.sigma == pytest.approx(0.6, rel=0.02)
    assert p.p90_s == pytest.approx(0.2 * np.exp(0.6 * 1.2816), rel=0.05)
    assert p.max_s == sample.max()


def test_a_step_takes_its_drawn_latency(url):
    session = new_episode(url, task=5)
    for turn in range(1, min(episode_turns(5), 3) + 1):
        seconds, answer = timed_step(url, session, "hello")
        drawn = step_latency(PROFILE, 5, turn)
        assert answer["info"]["turn_latency_s"] == drawn  # the server process draws the same
        assert drawn <= seconds <= drawn + SLACK_S


def test_episodes_are_ragged_and_the_goal_word_ends_one(url):
    def play(task: int) -> tuple[int, float, bool]:
        session = new_episode(url, task)
        turns, answer = 0, {"done": False}
        while not answer["done"]:
            _, answer = timed_step(url, session, "Thought: no idea.\nAction: hello")
            turns += 1
        return turns, answer["reward"], answer["info"]["success"]

    tasks = list(range(12))
    with concurrent.futures.ThreadPoolExecutor(len(tasks)) as threads:
        played = list(threads.map(play, tasks))
    assert [turns for turns, _, _ in played] == [episode_turns(t) for t in tasks]
    assert len({turns for turns, _, _ in played}) >= 4  # ragged: 1..MAX_TURNS
    assert all(1 <= turns <= MAX_TURNS for turns, _, _ in played)
    assert all(reward == 0.0 and not success for _, reward, success in played)

    long_task = next(t for t in range(100) if episode_turns(t) >= 3)
    session = new_episode(url, long_task)
    _, answer = timed_step(url, session, f"Thought: say it.\nAction: {GOAL.upper()}")
    assert answer["done"] and answer["reward"] == 1.0 and answer["info"]["success"]


def test_concurrent_sessions_wait_side_by_side(url):
    tasks = list(range(100, 116))
    sessions = [new_episode(url, t) for t in tasks]
    drawn = [step_latency(PROFILE, t, 1) for t in tasks]
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(tasks)) as threads:
        list(threads.map(lambda s: timed_step(url, s, "hello"), sessions))
    wall = time.perf_counter() - start
    # One at a time they would take the sum (~9 s); on the server's threads, about the longest.
    assert max(drawn) <= wall <= max(drawn) + 2 * SLACK_S < sum(drawn) / 3
