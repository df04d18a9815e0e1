"""The MCP bridge with real processes: environments served as MCP servers (stdio), and an
environment over a real MCP server's tools (`tests/mcp_notes_server.py`) with a user's verifier."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import anyio
import mcp_types
import pytest
from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client

from agentgym_jax.envs.protocol.tool_calls import ToolCall, format_agentgym, format_hermes
from environments.mcp.connection import MCPConnection, result_text
from environments.mcp.env import mcp_environment
from environments.tools.sheet import SheetEnv
from environments.tools.weather import WeatherEnv
from tests.servers import REPO, request_json, start_server


def bridge(*flags: str) -> MCPConnection:
    return MCPConnection([sys.executable, "-m", "environments.mcp.server", *flags], cwd=str(REPO),
                         env={"PYTHONPATH": str(REPO)}, timeout_s=60)


def test_a_tool_environment_served_over_mcp_answers_its_tools_results_as_json():
    """Every call of an oracle episode answers over MCP what the environment's step does, as a
    JSON client reads it: the tool's result as JSON (what the HTTP protocol's `info.tool_result`
    holds), the goal alone at reset, never the text protocol's `Observation: ... Give me one action.`"""
    with bridge("--env=sheet") as server:
        tools = {t.name: t for t in server.list_tools()}
        assert set(tools) == {"reset"} | {s["function"]["name"] for s in SheetEnv.tool_schemas()}
        assert tools["update_cell"].input_schema == next(
            s["function"]["parameters"] for s in SheetEnv.tool_schemas() if s["function"]["name"] == "update_cell")
        before = server.call_tool("get_all_values", {})
        assert before.is_error and "call reset" in result_text(before)
        local = SheetEnv()  # the text protocol's environment
        for task_id in (0, 2):
            answer = server.call_tool("reset", {"task_id": task_id})
            local.reset(task_id)
            assert result_text(answer) == local.task.goal and answer.meta["num_tasks"] == len(SheetEnv.all_tasks())
            while True:
                call = local.next_call()
                expected = local.step(format_agentgym(call))
                answer = server.call_tool(call.name, call.arguments)
                text = result_text(answer)
                assert not answer.is_error and json.loads(text) == expected.info["tool_result"], (call, text)
                assert "Observation:" not in text and "Give me one action" not in text
                assert answer.meta["reward"] == pytest.approx(expected.reward) and answer.meta["done"] == expected.done
                if expected.done:
                    assert answer.meta["success"] is True
                    break
        invalid = server.call_tool("reset", {"task_id": -1})
        assert invalid.is_error and "0..179" in result_text(invalid)
        server.call_tool("reset", {"task_id": 0})
        wrong = server.call_tool("update_cell", {"position": "B2"})
        assert wrong.is_error and "needs the argument 'value'" in result_text(wrong) and wrong.meta["reward"] == 0


def test_a_perturbed_server_over_the_sdk_lists_before_reset_and_says_when_its_tools_change():
    """The official SDK client over stdio, as an MCP client connects: tools listed and called
    before any reset; text results as JSON strings; `listChanged` advertised, and the
    notification sent when `check_valid_actions` shows the hidden tool, when `schema_change`
    renames the parameters, and when a reset undoes both."""
    params = StdioServerParameters(
        command=sys.executable, args=["-m", "environments.mcp.server", "--env=weather",
                                      "--perturbation=schema_change=4,hidden_tools=1"],
        env={"PYTHONPATH": str(REPO)}, cwd=str(REPO))
    changes: list[str] = []

    async def on_message(message) -> None:
        if isinstance(message, mcp_types.ToolListChangedNotification):
            changes.append(message.method)

    async def names(session: ClientSession) -> dict[str, list[str]]:
        return {t.name: list(t.input_schema.get("properties", {})) for t in (await session.list_tools()).tools}

    async def session_run() -> None:
        async with stdio_client(params) as (read, write), ClientSession(read, write, message_handler=on_message) as session:
            start = await session.initialize()
            assert start.capabilities.tools.list_changed is True
            listed = await names(session)  # before any reset
            assert "get_user_current_date" in listed and "get_distance" not in listed and "reset" in listed
            early = await session.call_tool("get_user_current_date", {})
            assert early.is_error and "call reset" in early.content[0].text
            reset = await session.call_tool("reset", {"task_id": 0})
            assert reset.content[0].text == WeatherEnv.all_tasks()[0].goal
            date = await session.call_tool("get_user_current_date", {})  # turn 1
            assert not date.is_error and json.loads(date.content[0].text) == "2010-04-04"
            assert changes == []
            shown = await session.call_tool("check_valid_actions", {})  # turn 2: the hidden tool appears
            assert "get_distance" in {tool["name"] for tool in json.loads(shown.content[0].text)}
            await anyio.sleep(0.2)  # the notification travels beside the result
            assert changes == ["notifications/tools/list_changed"] and "get_distance" in await names(session)
            where = await session.call_tool("get_latitude_longitude", {"name": "Seattle"})  # turn 3: renamed after it
            assert not where.is_error and isinstance(json.loads(where.content[0].text), dict)
            await anyio.sleep(0.2)
            assert len(changes) == 2 and (await names(session))["get_latitude_longitude"] == ["name_v2"]
            refused = await session.call_tool("get_latitude_longitude", {"name": "Seattle"})
            assert refused.is_error and "name_v2" in refused.content[0].text
            renamed = await session.call_tool("get_latitude_longitude", {"name_v2": "Seattle"})
            assert not renamed.is_error and isinstance(json.loads(renamed.content[0].text), dict)
            await session.call_tool("reset", {"task_id": 1})
            await anyio.sleep(0.2)
            assert len(changes) == 3 and (await names(session)) == listed

    anyio.run(session_run)


def test_a_text_environment_is_served_as_act():
    with bridge("--env=maze") as server:
        assert [t.name for t in server.list_tools()] == ["reset", "act"]
        first = result_text(server.call_tool("reset", {"task_id": 1}))
        assert "goal" in first.lower()
        moved = server.call_tool("act", {"action": "Thought: go.\nAction: move up"})
        assert moved.meta is not None and "reward" in moved.meta and isinstance(result_text(moved), str)


@pytest.fixture(scope="module")
def notes_url():
    with start_server("tests.mcp_envs:NotesEnv", timeout_s=120) as url:
        yield url


def run(url: str, task_id: int, actions: list[str]) -> dict:
    session = request_json(url, "POST", "/create", {})[1]["id"]
    assert request_json(url, "POST", "/reset", {"id": session, "data_idx": task_id})[0] == 200
    for action in actions:
        status, result = request_json(url, "POST", "/step", {"id": session, "action": action})
        assert status == 200, result
    request_json(url, "POST", "/close", {"id": session})
    return result


def test_mcp_environment_serves_the_servers_tools_and_its_oracle_solves(notes_url):
    tools = [t["function"]["name"] for t in request_json(notes_url, "GET", "/tools")[1]["tools"]]
    assert tools == ["add_note", "list_notes", "delete_note", "check_valid_actions", "finish"]
    tasks = request_json(notes_url, "GET", "/tasks")[1]
    assert tasks["num_tasks"] == 3 and "Name: add_note(title, text)" in tasks["instruction"]
    for task_id in range(3):
        session = request_json(notes_url, "POST", "/create", {})[1]["id"]
        request_json(notes_url, "POST", "/reset", {"id": session, "data_idx": task_id})
        for _ in range(6):
            action = request_json(notes_url, "GET", f"/oracle_action?id={session}&oracle=tool_call")[1]["action"]
            status, result = request_json(notes_url, "POST", "/step", {"id": session, "action": action})
            if result["done"]:
                break
        assert result["info"]["success"] and result["info"]["score"] == 1.0, (task_id, result)
        request_json(notes_url, "POST", "/close", {"id": session})


def test_the_users_verifier_reads_the_servers_state(notes_url):
    wrong_text = run(notes_url, 0, [format_hermes(ToolCall("add_note", {"title": "milk", "text": "buy 3 litres"})),
                                    format_agentgym(ToolCall("finish", {"answer": "done"}))])
    assert wrong_text["done"] and not wrong_text["info"]["success"]
    # a fresh server process per episode: the note of the previous episode is gone
    listing = run(notes_url, 0, [format_agentgym(ToolCall("list_notes", {}))])
    assert listing["observation"].startswith("Observation: {}")
    tool_error = run(notes_url, 1, [format_agentgym(ToolCall("delete_note", {"title": "nothing"}))])
    assert tool_error["info"]["tool_failed"] and not tool_error["info"]["invalid_action"]
    bad_arguments = run(notes_url, 1, [format_agentgym(ToolCall("add_note", {"title": "a"}))])
    assert bad_arguments["info"]["invalid_action"] and "needs the argument 'text'" in bad_arguments["observation"]
    wrong_answer = run(notes_url, 2, ['add_note(title="x", text="draft")', 'delete_note(title="x")', "finish(answer=1)"])
    assert wrong_answer["done"] and not wrong_answer["info"]["success"]


def test_tool_names_that_clash_with_the_environments_own_are_refused():
    with pytest.raises(ValueError, match="clash"):  # the bridge of a tool environment lists `finish` itself
        mcp_environment("again", [sys.executable, "-m", "environments.mcp.server", "--env=todo"],
                        [{"goal": "anything"}], lambda episode: True, cwd=str(REPO), env={"PYTHONPATH": str(REPO)})


def test_a_module_that_cannot_be_imported_is_named_with_what_to_do(tmp_path):
    """`--env=my_module:MyEnv` needs `my_module` importable: run from another folder, the bridge
    says so in one line (stdout stays the protocol's) instead of a traceback."""
    done = subprocess.run([sys.executable, "-m", "environments.mcp.server", "--env=my_notes_envs:NotesEnv"],
                          cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode != 0 and done.stdout == ""
    assert done.stderr.strip() == ("error: --env=my_notes_envs:NotesEnv: no module named 'my_notes_envs' here; "
                                   "run from the folder that holds it, or add that folder to PYTHONPATH")
