"""Perturbed servers (`--perturbation`, `environments/perturbation.py`) through real processes."""

from __future__ import annotations

import subprocess
import sys

import pytest

from agentgym_jax.envs.protocol.tool_calls import ToolCall, format_agentgym
from environments.perturbation import TRUNCATED, Perturbation, noisy
from tests.servers import REPO, request_json, start_server


def episode(url: str, task_id: int) -> int:
    session = request_json(url, "POST", "/create", {})[1]["id"]
    assert request_json(url, "POST", "/reset", {"id": session, "data_idx": task_id})[0] == 200
    return session


def step(url: str, session: int, action: str) -> dict:
    status, result = request_json(url, "POST", "/step", {"id": session, "action": action})
    assert status == 200, result
    return result


def oracle_episode(url: str, task_id: int, limit: int = 60) -> tuple[dict, list[dict]]:
    session, results = episode(url, task_id), []
    for _ in range(limit):
        action = request_json(url, "GET", f"/oracle_action?id={session}")[1]["action"]
        results.append(step(url, session, action))
        if results[-1]["done"]:
            break
    return results[-1], results


def test_specs_parse_and_bad_ones_name_the_valid_keys():
    assert str(Perturbation.parse("truncate=300, noise=0.05")) == "noise=0.05,truncate=300"
    for spec, message in [("noice=0.1", "valid: noise, truncate"), ("noise=2", "out of range"),
                          ("truncate=many", "needs a int"), ("tool_failure=-0.1", "out of range")]:
        with pytest.raises(ValueError, match=message):
            Perturbation.parse(spec)
    refused = subprocess.run([sys.executable, "-m", "environments.serve", "--env=maze", "--port=0",
                              "--perturbation=hidden_tools=1"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0 and "need a tool environment" in refused.stderr


def test_noise_replaces_the_expected_share_of_characters():
    text = "The goal is at position 5, 8. " * 200
    changed = sum(a != b for a, b in zip(text, noisy(text, 0.1, __import__("random").Random(0))))
    assert 0.06 < changed / sum(not c.isspace() for c in text) < 0.1  # a replacement may draw the same letter


def test_noisy_truncated_observations_are_deterministic_and_the_goal_is_clean():
    with start_server("weather") as clean, start_server("weather", perturbation="noise=0.2,truncate=120") as noisy_url:
        assert request_json(noisy_url, "GET", "/tasks")[1]["metadata"]["perturbation"] == "noise=0.2,truncate=120"
        call = format_agentgym(ToolCall("get_latitude_longitude", {"name": "Seattle"}))
        firsts, seconds = [], []
        for url, out in ((clean, firsts), (noisy_url, seconds), (noisy_url, seconds)):
            session = request_json(url, "POST", "/create", {})[1]["id"]
            reset = request_json(url, "POST", "/reset", {"id": session, "data_idx": 4})[1]
            out.append((reset["observation"], step(url, session, call)["observation"]))
        (clean_goal, clean_obs), (goal_a, obs_a), (goal_b, obs_b) = firsts[0], seconds[0], seconds[1]
        assert clean_goal == goal_a == goal_b  # the goal is never perturbed
        assert obs_a == obs_b != clean_obs[:120] + TRUNCATED  # the same noise on every run of the task
        assert obs_a.endswith(TRUNCATED) and len(obs_a) == 120 + len(TRUNCATED)
        differing = sum(a != b for a, b in zip(obs_a, clean_obs[:120]))
        assert 5 <= differing <= 45


def test_failing_tools_change_nothing_and_the_oracle_retries_through():
    with start_server("todo", perturbation="tool_failure=0.3") as url:
        failures = 0
        for task_id in (1, 2, 3, 5, 8):
            last, results = oracle_episode(url, task_id)
            assert last["info"]["success"], task_id
            failures += sum(r["info"].get("perturbed") == "tool_failure" for r in results)
            assert all(not r["info"]["invalid_action"] for r in results)
        assert failures >= 3


def test_renamed_parameters_are_refused_by_their_old_names_and_shown_by_tools():
    with start_server("weather", perturbation="schema_change=2") as url:
        fresh = request_json(url, "POST", "/create", {})[1]["id"]  # a session's tools before its first reset
        status, listed = request_json(url, "GET", f"/tools?id={fresh}")
        assert status == 200 and {t["function"]["name"] for t in listed["tools"]} >= {"get_latitude_longitude", "finish"}
        session = episode(url, 6)
        before = request_json(url, "GET", f"/tools?id={session}")[1]["tools"]
        call = format_agentgym(ToolCall("get_latitude_longitude", {"name": "Seattle"}))
        assert not step(url, session, call)["info"]["invalid_action"]  # turn 1: the old schema
        after = request_json(url, "GET", f"/tools?id={session}")[1]["tools"]
        names = {t["function"]["name"]: list(t["function"]["parameters"]["properties"]) for t in after}
        assert names["get_latitude_longitude"] == ["name_v2"] and before != after
        refused = step(url, session, call)
        assert refused["info"]["invalid_action"] and "its arguments: name_v2" in refused["observation"]
        renamed = step(url, session, format_agentgym(ToolCall("get_latitude_longitude", {"name_v2": "Seattle"})))
        assert not renamed["info"]["invalid_action"] and "Seattle-Tacoma Intl" in renamed["observation"]
        last, _ = oracle_episode(url, 6)
        assert last["info"]["success"]


def test_hidden_tools_are_found_with_check_valid_actions():
    with start_server("weather", perturbation="hidden_tools=2") as url:
        tasks = request_json(url, "GET", "/tasks")[1]
        hidden = {"get_hourly_weather", "get_distance"}
        assert not hidden & {t["function"]["name"] for t in tasks["metadata"]["tools"]}
        assert "Name: get_distance" not in tasks["instruction"] and "check_valid_actions lists every tool" in tasks["instruction"]
        fresh = request_json(url, "POST", "/create", {})[1]["id"]  # before its first reset: hidden already
        status, listed = request_json(url, "GET", f"/tools?id={fresh}")
        assert status == 200 and not hidden & {t["function"]["name"] for t in listed["tools"]}
        session = episode(url, 0)
        assert not hidden & {t["function"]["name"] for t in request_json(url, "GET", f"/tools?id={session}")[1]["tools"]}
        listed = step(url, session, "Action: check_valid_actions with Action Input: {}")
        assert "get_distance" in listed["observation"] and "latitude1" in listed["observation"]
        assert hidden <= {t["function"]["name"] for t in request_json(url, "GET", f"/tools?id={session}")[1]["tools"]}
        distance = step(url, session, format_agentgym(ToolCall("get_distance", {
            "latitude1": 47.45, "longitude1": -122.31, "latitude2": 40.64, "longitude2": -73.78})))
        assert not distance["info"]["invalid_action"] and float(distance["observation"].split()[1]) > 3800


def test_text_environments_take_noise_and_failures():
    with start_server("maze", perturbation="tool_failure=0.25,noise=0.05") as url:
        assert request_json(url, "GET", "/tasks")[1]["metadata"]["perturbation"] == "noise=0.05,tool_failure=0.25"
        last, results = oracle_episode(url, 3, limit=200)
        assert last["info"]["success"] and any(r["info"].get("perturbed") == "tool_failure" for r in results)
