"""An environment over the tools of an MCP server you name, with your tasks and your verifier.

    # my_envs.py
    from environments.mcp.env import mcp_environment

    def notes_saved(episode):                         # True / False, or a score in [0, 1]
        listing = episode.call_tool("list_notes", {})  # read the server's state
        return episode.task["title"] in listing

    NotesEnv = mcp_environment(
        name="notes", command=["python", "-m", "my_notes_server"],
        tasks=[{"goal": "Save a note titled 'milk' that says 'buy 2 litres'.", "title": "milk",
                "solution": [{"name": "add_note", "arguments": {"title": "milk", "text": "buy 2 litres"}}]}],
        verifier=notes_saved)

    python -m environments.serve --env=my_envs:NotesEnv

The server's tools are listed once, when the class is made; each episode starts its own server
process (so state never leaks between episodes) and ends it at the next reset or close. The
agent calls tools in either action format and ends with `finish` (its `answer` is
`episode.answer`); the verifier then decides success (a score of 1 or True). A task's optional
`solution` (a list of calls) is the oracle and its calls are the progress sub-goals; `answer`,
when given, must also match the finish answer.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Callable, ClassVar, Sequence

from agentgym_jax.envs.protocol.tool_calls import ToolCall
from environments.mcp.connection import MCPConnection, result_text
from environments.tools.base import (
    CHECK_VALID_ACTIONS, FINISH, Result, Step, Tool, ToolEnvironment, ToolTask, same_answer)

RESERVED = (CHECK_VALID_ACTIONS.name, FINISH.name)


@dataclasses.dataclass
class Episode:
    """What a verifier sees: the task, the calls made (call, answer text, failed?), the finish
    answer, and `call_tool(name, arguments) -> text` on the episode's live server."""

    task: dict[str, Any]
    calls: list[tuple[ToolCall, str, bool]]
    answer: Any
    call_tool: Callable[[str, dict[str, Any]], str]


Verifier = Callable[[Episode], "bool | float"]


def _fact(call: ToolCall) -> str:
    return f"call:{call.name}:{json.dumps(call.arguments, sort_keys=True)}"


def mcp_environment(name: str, command: Sequence[str], tasks: Sequence[dict[str, Any]], verifier: Verifier, *,
                    intro: str = "", rules: str = "", env: dict[str, str] | None = None, cwd: str | None = None,
                    timeout_s: float = 30.0) -> type[ToolEnvironment]:
    """A `ToolEnvironment` class whose tools are the MCP server's (see the module docstring)."""
    if not tasks or not all(isinstance(t.get("goal"), str) for t in tasks):
        raise ValueError("tasks must be a non-empty list of dicts, each with a 'goal' text")
    with MCPConnection(command, env=env, cwd=cwd, timeout_s=timeout_s) as probe:
        listed = probe.list_tools()
    clashes = [t.name for t in listed if t.name in RESERVED]
    if clashes:
        raise ValueError(f"the MCP server's tools {clashes} clash with the environment's own {RESERVED}")
    tools = tuple(Tool(t.name, t.description or t.name, dict(t.input_schema.get("properties", {})),
                       tuple(t.input_schema.get("required", []))) for t in listed)
    tool_tasks = tuple(
        ToolTask(t["goal"], t.get("answer"),
                 tuple(Step(call, frozenset({_fact(call)})) for call in
                       (ToolCall(c["name"], dict(c.get("arguments", {}))) for c in t.get("solution", []))),
                 t.get("template", name), {"task": t})
        for t in tasks)

    class MCPEnvironment(ToolEnvironment):
        """Episodes over an MCP server's tools, judged by the user's verifier."""

        blocking: ClassVar[bool] = True  # every call waits on a process
        max_sessions: ClassVar[int] = 16
        has_oracle: ClassVar[bool] = all(t.get("solution") for t in tasks)
        oracle_sweep_concurrency: ClassVar[int] = 4

        def __init__(self) -> None:
            super().__init__()
            self.connection: MCPConnection | None = None
            self.calls: list[tuple[ToolCall, str, bool]] = []
            self.verdict = 0.0

        @classmethod
        def all_tasks(cls) -> tuple[ToolTask, ...]:
            return tool_tasks

        def start(self, task: ToolTask) -> None:
            self.close()
            self.connection = MCPConnection(command, env=env, cwd=cwd, timeout_s=timeout_s)
            self.calls, self.verdict = [], 0.0

        def run_tool(self, call: ToolCall) -> Result:
            answer = self.connection.call_tool(call.name, call.arguments)
            text = result_text(answer)
            self.calls.append((call, text, bool(answer.is_error)))
            return Result(text, frozenset() if answer.is_error else frozenset({_fact(call)}), ok=not answer.is_error)

        def on_finish(self) -> None:
            self.verdict = self._judge()

        def _judge(self) -> float:
            episode = Episode(self.task.setup["task"], list(self.calls), self.answer,
                              lambda tool, arguments: result_text(self.connection.call_tool(tool, arguments)))
            verdict = verifier(episode)
            return float(verdict) if not isinstance(verdict, bool) else (1.0 if verdict else 0.0)

        def answer_right(self) -> bool:
            return self.finished and (self.task.answer is None or same_answer(self.answer, self.task.answer))

        def verify(self) -> bool:
            return self.task is not None and self.answer_right() and self.verdict >= 1.0

        def score(self) -> float:
            if self.task is None:
                return 0.0
            if self.finished:
                return 1.0 if self.verify() else max(self.best, min(self.verdict, 1.0) if self.answer_right() else 0.0)
            return max(self.best, self.progress())

        def close(self) -> None:
            if self.connection is not None:
                self.connection.close()
                self.connection = None

    cls = type(f"{name.title().replace('_', '')}MCPEnv", (MCPEnvironment,), {
        "name": name, "tools": tools, "intro": intro or f"You can use the tools of the {name} MCP server to reach the goal.",
        "rules": rules or "Use only the tools listed here.", "example": _example(tools), "__module__": __name__})
    return cls


def _example(tools: tuple[Tool, ...]) -> str:
    """A format example with the first tool's parameters (no invented results)."""
    tool = tools[0] if tools else FINISH
    arguments = {k: f"<{k}>" for k in tool.required}
    return (f"Thought: I will call {tool.name}.\n\nAction: {tool.name} with Action Input: {json.dumps(arguments)}\n"
            "Observation: <what the tool answers>\n")
