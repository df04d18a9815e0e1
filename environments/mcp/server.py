"""Any environment served as an MCP server over stdio: `python -m environments.mcp.server --env=weather`.

The server holds one episode. Its tools: `reset` (`{"task_id": int}`, answers the task's goal)
and, for a tool environment, the environment's own tools with their schemas (as the session
shows them, so perturbations apply); for any other environment one tool, `act`
(`{"action": str}`, the text an agent would send to `/step`). A tool call is one step. A tool
environment's answer is the tool's result as JSON (a JSON string for a text result), without
the `Observation: ... Give me one action.` wrapper of the text protocol; a text environment's is
its observation. `isError` marks an invalid action or a failed tool (its text says what went
wrong), and the result's `_meta` carries `reward`, `done`, `success`, `score` and `progress`.
The tools may be listed and called before any reset. The server advertises `tools.listChanged`
and sends `notifications/tools/list_changed` whenever a call changes the tools the session
shows (a perturbation's `schema_change` or `hidden_tools`, and the reset that undoes them). Add
it to an MCP client (e.g. Claude Desktop's `mcpServers`) as the command above, run from the
repository root.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

import anyio
import mcp_types as types
from mcp.server.lowlevel import NotificationOptions, Server
from mcp.server.stdio import stdio_server

from agentgym_jax.envs.protocol.tool_calls import ToolCall, format_agentgym
from environments.base import Environment
from environments.perturbation import Perturbation, perturbed
from environments.serve import resolve_environment
from environments.tools.base import ToolEnvironment

log = logging.getLogger(__name__)
RESET = types.Tool(name="reset", description="Start the task with this id; answers its goal.",
                   input_schema={"type": "object", "properties": {"task_id": {"type": "integer"}}, "required": ["task_id"]})
ACT = types.Tool(name="act", description="Take one action (the text of a turn); answers the observation.",
                 input_schema={"type": "object", "properties": {"action": {"type": "string"}}, "required": ["action"]})


def _answer(text: str, is_error: bool = False, **meta: Any) -> types.CallToolResult:
    return types.CallToolResult(content=[types.TextContent(type="text", text=text)], is_error=is_error, meta=meta or None)


class EpisodeHost:
    """One environment session behind the MCP tools."""

    def __init__(self, env_cls: type[Environment]):
        self.env_cls = env_cls
        self.env = env_cls()
        if isinstance(self.env, ToolEnvironment):  # results as JSON, not the text protocol's observations
            self.env.json_results = True
        self.num_tasks = env_cls.task_info().num_tasks
        self.started = self.done = False

    def tools(self) -> list[types.Tool]:
        schemas = self.env.session_tool_schemas()
        if not schemas:
            return [RESET, ACT]
        return [RESET] + [types.Tool(name=s["function"]["name"], description=s["function"]["description"],
                                     input_schema=s["function"]["parameters"]) for s in schemas]

    def call(self, name: str, arguments: dict[str, Any]) -> types.CallToolResult:
        if name == RESET.name:
            task_id = arguments.get("task_id")
            if not isinstance(task_id, int) or isinstance(task_id, bool) or not 0 <= task_id < self.num_tasks:
                return _answer(f"task_id must be an integer in 0..{self.num_tasks - 1}", is_error=True)
            observation = self.env.reset(task_id)
            self.started, self.done = True, False
            return _answer(observation, task_id=task_id, num_tasks=self.num_tasks)
        if not self.started:
            return _answer("No episode yet: call reset with a task_id first.", is_error=True)
        if self.done:
            return _answer("The episode is done: call reset to start another.", is_error=True)
        if self.env.session_tool_schemas():
            action = format_agentgym(ToolCall(name, arguments))
        elif name == ACT.name and isinstance(arguments.get("action"), str):
            action = self.env.parse_action(arguments["action"])
        else:
            return _answer("Call act with {\"action\": \"<your action>\"}.", is_error=True)
        result = self.env.step(action) if action is not None else None
        if result is None:
            return _answer("Invalid action: no action found.", is_error=True, reward=0.0, done=False, success=False)
        self.done = result.done
        failed = bool(result.info.get("invalid_action") or result.info.get("tool_failed"))
        meta = {"reward": result.reward, "done": result.done, "success": bool(result.info.get("success")),
                "score": result.info.get("score", 0.0), "progress": result.info.get("progress")}
        return _answer(result.observation, is_error=failed, **meta)


def make_server(env_cls: type[Environment]) -> Server:
    host = EpisodeHost(env_cls)

    async def list_tools(ctx: Any, params: Any) -> types.ListToolsResult:
        return types.ListToolsResult(tools=host.tools())

    async def call_tool(ctx: Any, params: types.CallToolRequestParams) -> types.CallToolResult:
        try:
            before = host.tools()
            answer = host.call(params.name, dict(params.arguments or {}))
            changed = host.tools() != before  # renamed parameters, tools shown by check_valid_actions, a reset
        except Exception as e:  # an environment failure ends the episode, never the server
            log.exception("%s failed", env_cls.name)
            host.started, changed = False, False
            answer = _answer(f"The environment failed: {type(e).__name__}: {e}; call reset.", is_error=True)
        if changed:
            await ctx.session.send_tool_list_changed()
        return answer

    return Server(f"agentgym-{env_cls.name}", instructions=env_cls.task_info().instruction,
                  on_list_tools=list_tools, on_call_tool=call_tool)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m environments.mcp.server", description=__doc__.splitlines()[0])
    parser.add_argument("--env", required=True, help="a registered environment name or module:Class")
    parser.add_argument("--perturbation", default="", help="as environments.serve's --perturbation")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)  # stdout carries the protocol; logs go to stderr
    try:
        env_cls = perturbed(resolve_environment(args.env), Perturbation.parse(args.perturbation))
    except (KeyError, ValueError, ImportError) as e:  # stdout is the protocol's: one line on stderr
        sys.exit(f"error: {e.args[0] if isinstance(e, KeyError) else e}")
    server = make_server(env_cls)

    async def run() -> None:
        async with stdio_server() as (read, write):
            options = server.create_initialization_options(NotificationOptions(tools_changed=True))
            await server.run(read, write, options)

    anyio.run(run)


if __name__ == "__main__":
    main()
