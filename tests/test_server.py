"""The server framework through real `python -m environments.serve` processes (Maze inside).

Bad input of every kind gets its documented status and a JSON error, and the server keeps
serving other sessions; plus the session cap, idle reaping, step-after-done, environment
exceptions, the thread pool for blocking environments, bearer tokens and AgentGym's aliases;
random session ids, the action-length cap, and creates whose client went away.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.parse

import aiohttp
import pytest

from agentgym_jax.envs.client import EnvClient, EnvServerError
from agentgym_jax.envs.dialects import DialectClient
from environments.registry import ENVIRONMENTS
from tests.servers import REPO, request_json, start_server


@pytest.fixture(scope="module")
def url():
    with start_server("maze") as url:
        yield url


def new_episode(url: str, data_idx: int = 0, prefix: str = "") -> int:
    status, created = request_json(url, "POST", f"{prefix}/create", {})
    assert status == 200, created
    status, reset = request_json(url, "POST", f"{prefix}/reset", {"id": created["id"], "data_idx": data_idx})
    assert status == 200, reset
    return created["id"]


def assert_steps_correctly(url: str, session_id: int) -> None:
    """A following oracle move is accepted and answered with the step fields."""
    status, oracle = request_json(url, "GET", f"/oracle_action?id={session_id}")
    assert status == 200, oracle
    status, result = request_json(url, "POST", "/step", {"id": session_id, "action": oracle["action"]})
    assert status == 200, result
    assert result["info"]["invalid_action"] is False and isinstance(result["observation"], str)


BIG = 1_000_000
BAD_INPUTS = {
    # name: (method, path, raw body, status)
    "malformed_json": ("POST", "/step", b'{"id": 0, "action": ', 400),
    "json_list": ("POST", "/step", b"[0, 1]", 400),
    "json_string": ("POST", "/reset", b'"hello"', 400),
    "json_null": ("POST", "/close", b"null", 400),
    "deep_nesting": ("POST", "/step", b"[" * 100_000, 400),
    "non_utf8": ("POST", "/step", b'{"id": 0, "action": "\xff\xfe move"}', 400),
    "missing_id": ("POST", "/step", b'{"action": "move up"}', 400),
    "missing_action": ("POST", "/step", b'{"id": 0}', 400),
    "id_float": ("POST", "/step", b'{"id": 0.5, "action": "move up"}', 400),
    "id_bool": ("POST", "/step", b'{"id": true, "action": "move up"}', 400),
    "id_text": ("POST", "/step", b'{"id": "zero", "action": "move up"}', 400),
    "id_list": ("POST", "/reset", b'{"id": [0], "data_idx": 0}', 400),
    "action_number": ("POST", "/step", b'{"id": 0, "action": 3}', 400),
    "action_null": ("POST", "/step", b'{"id": 0, "action": null}', 400),
    "data_idx_text": ("POST", "/reset", b'{"id": 0, "data_idx": "first"}', 400),
    "unknown_session": ("POST", "/step", b'{"id": 123456, "action": "move up"}', 404),
    "huge_session_id": ("POST", "/step", b'{"id": 1' + b"0" * 400 + b', "action": "move up"}', 404),
    "unknown_session_get": ("GET", "/observation?id=98765", None, 404),
    "query_id_missing": ("GET", "/available_actions", None, 400),
    "query_id_text": ("GET", "/oracle_action?id=abc", None, 400),
    "query_id_5000_digits": ("GET", "/observation?id=" + "9" * 5000, None, 400),
    "one_megabyte_action": ("POST", "/step", json.dumps({"id": 0, "action": "a" * BIG}).encode(), 413),
    "unknown_path": ("POST", "/teleport", b"{}", 404),
    "wrong_method": ("GET", "/step", None, 405),
}


@pytest.mark.parametrize("name", sorted(BAD_INPUTS))
def test_bad_input_gets_json_error_and_server_keeps_serving(url, name):
    control = new_episode(url)
    method, path, data, expected = BAD_INPUTS[name]
    status, body = request_json(url, method, path, data=data)
    assert status == expected, body
    assert isinstance(body, dict) and isinstance(body["error"], str) and body["error"]
    assert request_json(url, "GET", "/health")[0] == 200
    assert_steps_correctly(url, control)


def test_error_messages_name_the_problem(url):
    num_tasks = request_json(url, "GET", "/tasks")[1]["num_tasks"]
    session = new_episode(url)
    for data_idx in (-1, num_tasks):
        status, body = request_json(url, "POST", "/reset", {"id": session, "data_idx": data_idx})
        assert status == 400 and f"0..{num_tasks - 1}" in body["error"], body
    status, body = request_json(url, "POST", "/step", {"id": session})
    assert status == 400 and "action" in body["error"]
    status, body = request_json(url, "POST", "/step", {"id": 0.5, "action": "move up"})
    assert status == 400 and "int" in body["error"]


def test_calls_before_reset_are_refused(url):
    _, created = request_json(url, "POST", "/create", {})
    session = created["id"]
    for method, path, body in [("POST", "/step", {"id": session, "action": "move up"}),
                               ("GET", f"/observation?id={session}", None),
                               ("GET", f"/oracle_action?id={session}", None)]:
        status, answer = request_json(url, method, path, body)
        assert status == 409 and "reset" in answer["error"], (path, answer)


def test_step_after_done_is_refused_until_reset(url):
    session = new_episode(url, data_idx=5)
    for _ in range(100):
        action = request_json(url, "GET", f"/oracle_action?id={session}")[1]["action"]
        status, result = request_json(url, "POST", "/step", {"id": session, "action": action})
        assert status == 200
        if result["done"]:
            break
    assert result["done"] and result["info"]["success"] and result["reward"] == 1.0
    status, answer = request_json(url, "POST", "/step", {"id": session, "action": "move up"})
    assert status == 409 and "done" in answer["error"]
    assert request_json(url, "GET", f"/oracle_action?id={session}")[0] == 409
    assert request_json(url, "POST", "/reset", {"id": session, "data_idx": 5})[0] == 200
    assert_steps_correctly(url, session)


def test_unparseable_reply_is_an_invalid_turn_counted_in_info(url):
    session = new_episode(url)
    for expected_count, text in enumerate(["", "Thought: I am lost.\nAction:\n   ", "move up"], start=1):
        status, result = request_json(url, "POST", "/step", {"id": session, "action": text})
        assert status == 200, result
        if expected_count < 3:
            assert result["reward"] == 0.0 and result["done"] is False
            assert result["info"]["invalid_action"] is True
            assert result["info"]["invalid_actions"] == expected_count
    assert result["info"]["invalid_action"] is False and result["info"]["invalid_actions"] == 2


def test_the_action_is_the_first_line_after_the_last_action_marker(url):
    """A thought that mentions `Action:` does not hide the action after it."""
    plain, thought = new_episode(url, data_idx=4), new_episode(url, data_idx=4)
    move = request_json(url, "GET", f"/oracle_action?id={plain}")[1]["action"]
    expected = request_json(url, "POST", "/step", {"id": plain, "action": move})[1]
    reply = f"Thought: an `Action: jump` would be invalid.\naction:\n\n  {move}  \nthen the next one."
    result = request_json(url, "POST", "/step", {"id": thought, "action": reply})[1]
    assert result["info"]["invalid_action"] is False and result["observation"] == expected["observation"]


def test_close_frees_the_session(url):
    session = new_episode(url)
    sessions_before = request_json(url, "GET", "/health")[1]["sessions"]
    assert request_json(url, "POST", "/close", {"id": session}) == (200, {"id": session, "closed": True})
    assert request_json(url, "GET", "/health")[1]["sessions"] == sessions_before - 1
    assert request_json(url, "POST", "/step", {"id": session, "action": "move up"})[0] == 404
    assert request_json(url, "POST", "/close", {"id": session})[0] == 404


def test_agentgym_field_aliases_and_prefixed_paths(url):
    """What AgentGym's clients send (`env_idx`, `game`, `seed`, `/maze/...`) and read back;
    SearchQA's `{"env_idx": session, "id": task}` names the session by `env_idx`."""
    for prefix, id_key, task_key in [("", "env_idx", "idx"), ("/maze", "id", "game"), ("", "id", "seed"),
                                     ("/maze", "env_idx", "task_idx"), ("", "env_idx", "id")]:
        status, created = request_json(url, "POST", f"{prefix}/create")
        assert status == 200 and created["observation"] == ""  # TextCraft's client reads it
        session = created["id"]
        status, reset = request_json(url, "POST", f"{prefix}/reset", {id_key: session, task_key: 7})
        assert status == 200 and reset["data_idx"] == 7
        assert {"observation", "reward", "score", "done"} <= set(reset)  # BabyAI's client reads these
        _, plain = request_json(url, "POST", "/reset", {"id": session, "data_idx": 7})
        assert plain["observation"] == reset["observation"]
        _, actions = request_json(url, "GET", f"{prefix}/available_actions?id={session}")
        assert actions["available_actions"] == ["move up", "move down", "move left", "move right"]
        status, result = request_json(url, "POST", f"{prefix}/step", {id_key: session, "action": "Action: move up"})
        assert status == 200 and {"observation", "reward", "done", "score", "info"} <= set(result)
        _, observed = request_json(url, "GET", f"{prefix}/observation?id={session}")
        assert observed["observation"] == result["observation"]
        assert request_json(url, "POST", f"{prefix}/close", {id_key: session})[0] == 200
    assert request_json(url, "GET", "/maze/health")[1]["env"] == "maze"


def test_session_cap_refuses_then_frees_a_slot():
    with start_server("maze", max_sessions=2) as url:
        first, second = (request_json(url, "POST", "/create", {})[1]["id"] for _ in range(2))
        status, body = request_json(url, "POST", "/create", {})
        assert status == 503 and "session cap 2" in body["error"]
        health = request_json(url, "GET", "/health")[1]
        assert health["max_sessions"] == 2 and health["max_sessions_from"] == "--max_sessions"
        assert request_json(url, "POST", "/close", {"id": first})[0] == 200
        status, body = request_json(url, "POST", "/create", {})
        assert status == 200 and body["id"] not in (first, second)  # ids are never reused


def test_session_ids_are_random_63_bit_integers_another_client_cannot_guess(url):
    """Ids are not 0, 1, 2, ...: a client that tries small ids (or its own id +-1) reaches no
    session, and ids round-trip as JSON integers, in bodies and in query strings."""
    ids = [new_episode(url) for _ in range(16)]
    assert len(set(ids)) == 16 and all(isinstance(i, int) and 0 <= i < 2**63 for i in ids)
    assert max(ids) > 2**53  # past a double's exact integers, so JSON readers must keep ints (all 16 below: p = 2**-160)
    for guess in [*range(64), *(i + d for i in ids for d in (-1, 1))]:
        if guess in ids:
            continue
        assert request_json(url, "POST", "/step", {"id": guess, "action": "move up"})[0] == 404
        assert request_json(url, "POST", "/close", {"id": guess})[0] == 404
    for session in ids:
        assert_steps_correctly(url, session)
        assert request_json(url, "GET", f"/observation?id={session}")[0] == 200
        assert request_json(url, "POST", "/close", {"id": session}) == (200, {"id": session, "closed": True})


def test_large_ids_round_trip_through_our_client_and_an_agentgym_format_one(url):
    """Ids past 2**53 (where a double loses integers) through `EnvClient`, and through the AgentGym
    `maze` dialect's client on a server answering errors AgentGym's way (`--agentgym_errors`)."""

    async def play(url: str, client_of) -> None:
        async with aiohttp.ClientSession() as http:
            client = client_of(url, http)
            for _ in range(20):
                if (session := await client.create()) > 2**53:
                    break
                await client.close(session)  # p = 2**-10 each
            assert session > 2**53, "ids stay small"
            await client.reset(session, 3)
            result = await client.step(session, await client.oracle_action(session))
            assert result.info["invalid_action"] is False and await client.observation(session) == result.observation
            await client.close(session)
            with pytest.raises(EnvServerError) as closed:
                await client.step(session, "move up")
            assert closed.value.status == 404 and str(session) in closed.value.message

    asyncio.run(play(url, EnvClient))
    with start_server("maze", agentgym_errors=True) as agentgym_url:
        asyncio.run(play(agentgym_url, lambda u, http: DialectClient(u, http, dialect="maze")))


def test_an_over_long_reply_is_an_invalid_turn_the_environment_never_sees(url):
    """A reply past `max_action_chars` (8192 by default, named in /health) is an ordinary invalid
    turn, even when it ends in a valid action; one at the cap is read as usual."""
    assert request_json(url, "GET", "/health")[1]["max_action_chars"] == 8192
    session = new_episode(url)
    _, before = request_json(url, "GET", f"/observation?id={session}")
    move = request_json(url, "GET", f"/oracle_action?id={session}")[1]["action"]
    tail = f"\nAction: {move}"
    status, result = request_json(url, "POST", "/step", {"id": session, "action": "x" * (8193 - len(tail)) + tail})
    assert status == 200 and result["reward"] == 0 and result["done"] is False
    assert result["info"]["invalid_action"] is True and result["info"]["invalid_actions"] == 1
    assert "8193 characters" in result["observation"] and "at most 8192" in result["observation"]
    assert request_json(url, "GET", f"/observation?id={session}")[1] == before  # the maze did not move
    status, result = request_json(url, "POST", "/step", {"id": session, "action": "x" * (8192 - len(tail)) + tail})
    assert status == 200 and result["info"]["invalid_action"] is False


def test_max_action_chars_is_a_flag():
    with start_server("maze", max_action_chars=20) as url:
        assert request_json(url, "GET", "/health")[1]["max_action_chars"] == 20
        session = new_episode(url)
        result = request_json(url, "POST", "/step", {"id": session, "action": "Thought: up.\nAction: move up"})[1]
        assert result["info"]["invalid_action"] is True and "at most 20" in result["observation"]
        assert request_json(url, "POST", "/step", {"id": session, "action": "Action: move up"})[1]["info"]["invalid_action"] is False


def test_a_create_whose_client_went_away_closes_its_environment(tmp_path):
    """The client of a /create that takes a second (an engine starting) hangs up after 0.2 s:
    the server closes the environment it built instead of keeping a session nobody knows."""
    close_log = tmp_path / "closed.txt"
    with start_server("tests.server_test_envs:SlowStartMazeEnv", env_vars={"CLOSE_LOG": str(close_log)}) as url:
        address = urllib.parse.urlsplit(url)
        with socket.create_connection((address.hostname, address.port)) as client:
            client.sendall(b"POST /create HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                           b"Content-Length: 2\r\n\r\n{}")
            time.sleep(0.2)
        deadline = time.monotonic() + 10
        while not close_log.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert close_log.read_text().count("closed") == 1
        assert request_json(url, "GET", "/health")[1]["sessions"] == 0
        assert_steps_correctly(url, new_episode(url))  # a client that waits gets its session


def test_idle_sessions_are_reaped_busy_ones_kept(tmp_path):
    close_log = tmp_path / "closed.txt"
    with start_server("tests.server_test_envs:FaultyMazeEnv", idle_timeout_s=0.6,
                      env_vars={"CLOSE_LOG": str(close_log)}) as url:
        idle, busy = new_episode(url), new_episode(url)
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:  # `busy` is used every 0.1 s, `idle` never
            assert request_json(url, "GET", f"/observation?id={busy}")[0] == 200
            time.sleep(0.1)
        status, body = request_json(url, "POST", "/step", {"id": idle, "action": "move up"})
        assert status == 404 and "unknown session" in body["error"]
        assert request_json(url, "GET", "/health")[1]["sessions"] == 1
        assert close_log.read_text().count("closed") == 1  # the reaper called Environment.close()
        assert_steps_correctly(url, busy)
        request_json(url, "POST", "/close", {"id": busy})
        assert close_log.read_text().count("closed") == 2


def test_serve_names_the_valid_environments_for_an_unknown_one():
    done = subprocess.run([sys.executable, "-m", "environments.serve", "--env=mazee", "--port=0"],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "unknown environment 'mazee'" in done.stderr
    assert all(name in done.stderr for name in ENVIRONMENTS), done.stderr


def test_bearer_token():
    with start_server("maze", auth_token="s3cret") as url:
        good = {"Authorization": "Bearer s3cret"}
        assert request_json(url, "GET", "/health")[0] == 200  # open, so launchers can wait on it
        for headers in [None, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}]:
            status, body = request_json(url, "POST", "/create", {}, headers=headers)
            assert status == 401 and "token" in body["error"]
        assert request_json(url, "GET", "/tasks")[0] == 401
        assert request_json(url, "POST", "/maze/create", {})[0] == 401
        status, created = request_json(url, "POST", "/create", {}, headers=good)
        assert status == 200
        status, _ = request_json(url, "POST", "/reset", {"id": created["id"], "data_idx": 0}, headers=good)
        assert status == 200


@pytest.mark.parametrize("env_cls", ["FaultyMazeEnv", "BlockingFaultyMazeEnv"])
def test_environment_exception_breaks_only_its_session(env_cls):
    with start_server(f"tests.server_test_envs:{env_cls}") as url:
        broken, healthy = new_episode(url), new_episode(url)
        status, body = request_json(url, "POST", "/step", {"id": broken, "action": "explode"})
        assert status == 500 and "engine exploded" in body["error"]
        status, body = request_json(url, "POST", "/step", {"id": broken, "action": "move up"})
        assert status == 409 and "broken" in body["error"]
        assert request_json(url, "GET", "/health")[0] == 200
        assert_steps_correctly(url, healthy)
        assert request_json(url, "POST", "/reset", {"id": broken, "data_idx": 1})[0] == 200
        assert_steps_correctly(url, broken)


def test_extra_queries_are_served_on_every_prefix():
    with start_server("tests.server_test_envs:FaultyMazeEnv") as url:
        _, created = request_json(url, "POST", "/create", {})
        session = created["id"]
        assert request_json(url, "GET", f"/maze_rows?id={session}") == (200, [])  # allowed before reset
        request_json(url, "POST", "/reset", {"id": session, "data_idx": 0})
        status, rows = request_json(url, "GET", f"/maze/maze_rows?id={session}")
        assert status == 200 and rows[0] == "#" * len(rows[0]) and len(rows) > 2
        assert request_json(url, "GET", "/maze_rows?id=999")[0] == 404


def test_blocking_environment_runs_in_threads_and_keeps_the_loop_free():
    """Four one-second steps overlap in the pool; /health answers while they run."""
    with start_server("tests.server_test_envs:BlockingFaultyMazeEnv") as url:
        sessions = [new_episode(url) for _ in range(4)]
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            start = time.monotonic()
            steps = [pool.submit(request_json, url, "POST", "/step", {"id": s, "action": "sleep"}) for s in sessions]
            time.sleep(0.1)
            health_start = time.monotonic()
            assert request_json(url, "GET", "/health")[0] == 200
            health_s = time.monotonic() - health_start
            assert all(f.result()[0] == 200 for f in steps)
            elapsed = time.monotonic() - start
        assert elapsed < 2.5, f"4 x 1 s steps took {elapsed:.2f} s: not run concurrently"
        assert health_s < 0.6, f"/health took {health_s:.2f} s while environments were busy"


def test_sigterm_closes_open_sessions(tmp_path):
    close_log = tmp_path / "closed.txt"
    proc = subprocess.Popen([sys.executable, "-m", "environments.serve", "--env=tests.server_test_envs:FaultyMazeEnv",
                             "--port=0"], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO), "CLOSE_LOG": str(close_log)},
                            stdout=subprocess.PIPE, text=True)
    try:
        url = proc.stdout.readline().split(" on ", 1)[1].strip()
        new_episode(url)
        new_episode(url)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
    assert close_log.read_text().count("closed") == 2
