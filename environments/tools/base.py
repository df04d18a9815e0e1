"""The shared engine of AgentGym's tool environments (Weather, Movie, Academia, TODOList, Sheet).

A `ToolEnvironment` is a set of `Tool`s (OpenAI function schemas; each runs the method
`tool_<name>`) and a list of `ToolTask`s. A reply is read by `parse_tool_call` in either of
AgentGym's `Action: <tool> with Action Input: {...}` or a function call (`<tool_call>...`,
Llama 3 JSON, plain `tool(key=value)`); its arguments are checked against the tool's schema.
A reply that cannot be read, names an unknown tool or has bad arguments is an invalid action
(reward 0) whose observation says what was wrong; a tool that fails on good arguments (an
unknown city, a missing cell) answers with an error observation and is a valid action.

Progress (AgentGym's progress rate): a task lists the facts its solution must uncover (its
sub-goals); each tool result reveals facts, and a stateful environment counts the parts of the
goal state already reached. `score` is 1 once `verify` holds (finished, the answer right and,
where the task changes state, the state equal to the goal), else the best progress so far;
each step's reward is the rise of the score, so an episode's return is its final score. The
episode ends at `finish` or after `MAX_TURNS` turns.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, ClassVar, Sequence

from agentgym_jax.envs.protocol import StepResult, TaskInfo
from agentgym_jax.envs.protocol.tool_calls import (
    ToolCall, ToolCallError, check_arguments, format_agentgym, format_hermes, function_schema, parse_tool_call)
from environments.base import Environment, every_kth_held_out

MAX_TURNS = 30
TEST_EVERY = 5  # task ids divisible by this form the test split
FLOAT_TOLERANCE = 0.051  # answers are rounded to 1 decimal: 18.5 matches 18.46 and 18.54
ANSWER_TYPES = ["string", "number", "array"]
NEXT = "\nGive me one action."


@dataclasses.dataclass(frozen=True)
class Tool:
    """One tool: its function schema and AgentGym's `Returns:` line."""

    name: str
    description: str
    properties: dict[str, Any] = dataclasses.field(default_factory=dict)
    required: tuple[str, ...] = ()
    returns: str = ""

    def schema(self) -> dict[str, Any]:
        return function_schema(self.name, self.description, self.properties, self.required)


@dataclasses.dataclass(frozen=True)
class Result:
    """What a tool answered: a JSON-able value, the facts it revealed, and whether it failed."""

    value: Any
    facts: frozenset[str] = frozenset()
    ok: bool = True


def failure(message: str) -> Result:
    return Result(message, ok=False)


@dataclasses.dataclass(frozen=True)
class Step:
    """One call of a task's solution and the facts it uncovers (its sub-goals)."""

    call: ToolCall
    facts: frozenset[str] = frozenset()


@dataclasses.dataclass(frozen=True)
class ToolTask:
    """One task: the goal text, the answer (None: an operation, answered "done"), the solution."""

    goal: str
    answer: Any
    plan: tuple[Step, ...]
    template: str
    setup: dict[str, Any] = dataclasses.field(default_factory=dict)  # what the episode starts from


def arg(name: str, kind: str | list[str], description: str, **extra: Any) -> tuple[str, dict[str, Any]]:
    return name, {"type": kind, "description": description, **extra}


CHECK_VALID_ACTIONS = Tool("check_valid_actions", "Get supported actions for current tool.",
                           returns="The names of the supported actions.")
FINISH = Tool("finish", "Return an answer and finish the task.",
              dict([arg("answer", ANSWER_TYPES, "The answer to be returned (for an operation task: 'done').")]))


def tool_instruction(intro: str, tools: Sequence[Tool], rules: str, example: str) -> str:
    """AgentGym's tool prompt: the actions with their parameters, the rules, the reply format."""
    blocks = []
    for tool in tools:
        names = ", ".join(tool.properties)
        lines = [f"Name: {tool.name}({names})", f"Description: {tool.description}"]
        if tool.properties:
            lines.append("Parameters:")
            lines += [f"- {key} (Type: {spec['type']}): {spec.get('description', '')}" for key, spec in tool.properties.items()]
        if tool.returns:
            lines += ["Returns:", tool.returns]
        blocks.append("\n".join(lines))
    return (
        f"You are an autonomous intelligent agent. {intro}\n"
        "We detail name, description, input(parameters) and output(returns) of each action as follows:\n"
        + "\n\n".join(blocks) + f"\n\n{rules} If you are finished, you will call \"finish\" action.\n"
        "Please provide your thought to solve the question. You should give the thought with no more than 3 "
        "sentences. You need to give your thought together with your action!\n\n"
        "Your response must be in the format of:\nThought: [your thought]\n\n"
        "Action: [your action] with Action Input: [your action input]\n\n"
        "(A function call such as <tool_call>{\"name\": \"finish\", \"arguments\": {\"answer\": \"done\"}}</tool_call> "
        f"is read too.)\n\nHere is an example:\n\n{example}"
    )


def render(value: Any) -> str:
    """A tool result as observation text (strings as they are, the rest as JSON)."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def same_answer(given: Any, gold: Any) -> bool:
    """Numbers within `FLOAT_TOLERANCE`, text case- and space-insensitive (quotes and a final
    period ignored), lists as multisets of such values; a number given as text counts."""
    if isinstance(gold, (list, tuple)):
        if isinstance(given, str):
            given = _list_from_text(given)
        if not isinstance(given, (list, tuple)) or len(given) != len(gold):
            return False
        remaining = list(gold)
        for item in given:
            match = next((g for g in remaining if same_answer(item, g)), None)
            if match is None:
                return False
            remaining.remove(match)
        return True
    if isinstance(gold, (int, float)) and not isinstance(gold, bool):
        number = _number(given)
        return number is not None and abs(number - gold) <= FLOAT_TOLERANCE
    return isinstance(given, (str, int, float)) and _text(str(given)) == _text(str(gold))


def _text(value: str) -> str:
    return " ".join(value.strip().strip("'\"").rstrip(".").split()).casefold()


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value) if math.isfinite(value) else None
    if isinstance(value, str) and len(value) < 40:
        try:
            number = float(value.strip().rstrip(".").replace(",", ""))
        except ValueError:
            return None
        return number if math.isfinite(number) else None
    return None


def _list_from_text(text: str) -> list[Any] | None:
    text = text.strip()
    if text.startswith("["):
        try:
            value = json.loads(text)
        except ValueError:
            return None
        return value if isinstance(value, list) else None
    return [part for part in (p.strip() for p in text.split(",")) if part]


class ToolEnvironment(Environment):
    """One episode of a tool task. Subclasses set `tools` (besides check_valid_actions and
    finish), the prompt parts `intro`, `rules` and `example` (the instruction is built from
    them), `all_tasks()`, the `tool_<name>` methods, and for stateful tasks `start`,
    `state_progress`, `state_matches` and `next_call`."""

    tools: ClassVar[tuple[Tool, ...]]
    intro: ClassVar[str]
    rules: ClassVar[str]
    example: ClassVar[str]
    oracles: ClassVar[tuple[str, ...]] = ("tool_call",)  # the same oracle, written as <tool_call> calls
    # How answers read: AgentGym's text protocol (`Observation: <result>\nGive me one action.`), or
    # for a client that reads tool results itself (the MCP bridge) the result alone as JSON and
    # the goal alone as the first observation.
    json_results: bool = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "tools" in cls.__dict__:
            cls.instruction = cls.build_instruction(cls.all_tools())

    @classmethod
    def build_instruction(cls, tools: Sequence[Tool], note: str = "") -> str:
        return tool_instruction(cls.intro, tools, f"{cls.rules}{note}", cls.example)

    def __init__(self) -> None:
        self.task: ToolTask | None = None
        self.facts: set[str] = set()
        self.turns = 0
        self.finished = False
        self.answer: Any = None
        self.best = 0.0
        self._observation = ""

    # ---- tasks ----

    @classmethod
    def all_tasks(cls) -> Sequence[ToolTask]:
        raise NotImplementedError

    @classmethod
    def all_tools(cls) -> tuple[Tool, ...]:
        return cls.tools + (CHECK_VALID_ACTIONS, FINISH)

    @classmethod
    def tool_schemas(cls) -> list[dict[str, Any]]:
        return [tool.schema() for tool in cls.all_tools()]

    def session_tool_schemas(self) -> list[dict[str, Any]]:
        return [tool.schema() for tool in self.visible_tools()]

    def visible_tools(self) -> list[Tool]:
        """The tools this session shows (a perturbation may hide or change some)."""
        return list(self.tool_table().values())

    def tool_table(self) -> dict[str, Tool]:
        """The tools a call may name, as this session states them (a perturbation may rename
        their parameters: `original_arguments` maps them back)."""
        return {tool.name: tool for tool in self.all_tools()}

    def original_arguments(self, tool: str, arguments: dict[str, Any]) -> dict[str, Any]:
        return arguments

    def present_call(self, call: ToolCall) -> ToolCall:
        """A call as this session's tools state it (the oracle writes its calls through this)."""
        return call

    @classmethod
    def task_info(cls) -> TaskInfo:
        tasks = cls.all_tasks()
        return TaskInfo(
            env=cls.name, instruction=cls.instruction, success_threshold=cls.success_threshold,
            splits=every_kth_held_out(len(tasks), TEST_EVERY), num_tasks=len(tasks), has_oracle=cls.has_oracle,
            metadata={"templates": [t.template for t in tasks], "max_turns": MAX_TURNS, "tools": cls.tool_schemas()},
        )

    @classmethod
    def parse_action(cls, text: str) -> str:
        """The reply itself: `step` reads the tool call, so a malformed one gets its own message."""
        return text

    # ---- episode ----

    def reset(self, data_idx: int) -> str:
        tasks = self.all_tasks()
        if not 0 <= data_idx < len(tasks):
            raise ValueError(f"{self.name} task id {data_idx} out of range [0, {len(tasks)})")
        self.task = tasks[data_idx]
        self.facts, self.turns, self.finished, self.answer, self.best = set(), 0, False, None, 0.0
        self.start(self.task)
        self._observation = self.task.goal if self.json_results else (
            f"Now new trial starts.\nYou should perform actions to accomplish the goal: {self.task.goal}{NEXT}")
        return self._observation

    def reset_fields(self) -> dict[str, Any]:
        return {"tools": self.session_tool_schemas()}

    def start(self, task: ToolTask) -> None:
        """Sets up the state a task starts from (stateful environments)."""

    def step(self, action: str) -> StepResult:
        self.turns += 1
        out_of_turns = self.turns >= MAX_TURNS
        try:
            call = self.read_call(action)
        except ToolCallError as e:
            return self._answer(f"Invalid action: {e}", out_of_turns, invalid=True)
        if call.name == FINISH.name:
            self.finished, self.answer = True, call.arguments.get("answer")
            self.on_finish()
            no_answer = self.answer is None and not self.json_results
            observation = "Observation: finished" if no_answer else self.shown(self.answer)
            return self._answer(observation, True, invalid=False, call=call, value=self.answer)
        result = self.run_tool(call)
        self.facts |= result.facts
        observation = self.shown(result.value, result.ok) + ("" if self.json_results else NEXT)
        return self._answer(observation, out_of_turns, invalid=False, call=call, value=result.value, failed=not result.ok)

    def shown(self, value: Any, ok: bool = True) -> str:
        """A tool's answer as the agent reads it: `Observation: <result>`, or with `json_results`
        the result as JSON (a failed tool's message as it is)."""
        if not self.json_results:
            return f"Observation: {render(value)}"
        return json.dumps(value, ensure_ascii=False) if ok else render(value)

    def read_call(self, text: str) -> ToolCall:
        """Model text -> a checked call of a known tool, or `ToolCallError` saying what is wrong."""
        call = parse_tool_call(text)
        tools = self.tool_table()
        tool = tools.get(call.name)
        if tool is None:
            raise ToolCallError(f"There is no tool {call.name!r}; the tools are: {', '.join(tools)}.")
        arguments = check_arguments(tool.schema()["function"]["parameters"], call.arguments, tool.name)
        return ToolCall(tool.name, self.original_arguments(tool.name, arguments))

    def on_finish(self) -> None:
        """Called once when the agent calls finish, before the step is scored."""

    def run_tool(self, call: ToolCall) -> Result:
        """Runs a checked call (here: the method `tool_<name>`)."""
        return getattr(self, f"tool_{call.name}")(**call.arguments)

    def tool_check_valid_actions(self) -> Result:
        return Result([tool.name for tool in self.all_tools()])

    def _answer(self, observation: str, done: bool, invalid: bool, call: ToolCall | None = None,
                value: Any = None, failed: bool = False) -> StepResult:
        if done and not self.finished and not self.json_results:  # (a JSON client reads `done`)
            observation += f"\nYou have used all {MAX_TURNS} turns. The episode is over."
        before = self.best
        self.best = max(self.best, self.score())
        self._observation = observation
        info: dict[str, Any] = {"progress": self.progress()}
        if call is not None:
            info.update(tool_call=call.to_json(), tool_result=value, tool_failed=failed)
        return self.result(observation, 0.0 if invalid else self.best - before, done, invalid, **info)

    def observation(self) -> str:
        return self._observation

    def available_actions(self) -> list[str]:
        return [tool.name for tool in self.visible_tools()]

    # ---- scoring ----

    def subgoals(self) -> frozenset[str]:
        """The facts the task's solution uncovers."""
        return frozenset().union(*(step.facts for step in self.task.plan))

    def progress(self) -> float:
        """The share of sub-goals reached: the facts uncovered, the changed parts of the goal
        state already in place, and the finish, which counts only when the task is solved (so
        progress reaches 1 exactly on success)."""
        goals = self.subgoals()
        done_parts, parts = self.state_progress()
        reached = len(goals & self.facts) + done_parts + (1 if self.verify() else 0)
        return reached / (len(goals) + parts + 1)

    def state_progress(self) -> tuple[float, int]:
        """(parts of the goal state reached, parts in all); (0, 0) where nothing changes."""
        return 0, 0

    def state_matches(self) -> bool:
        return True

    def answer_right(self) -> bool:
        if not self.finished:
            return False
        if self.task.answer is None:
            return True  # an operation: the state decides
        return self.answer is not None and same_answer(self.answer, self.task.answer)

    def verify(self) -> bool:
        return self.task is not None and self.finished and self.answer_right() and self.state_matches()

    def score(self) -> float:
        if self.task is None:
            return 0.0
        return 1.0 if self.verify() else max(self.best, self.progress())

    # ---- oracle ----

    def next_call(self) -> ToolCall:
        """The first solution step whose facts are not all uncovered yet, then finish (stateful
        environments override this to act on the state)."""
        for step in self.task.plan:
            if not step.facts <= self.facts:
                return step.call
        answer = "done" if self.task.answer is None else self.task.answer
        return ToolCall(FINISH.name, {"answer": answer})

    def oracle_action(self) -> str:
        return format_agentgym(self.present_call(self.next_call()))

    def named_oracle_action(self, oracle: str) -> str:
        return format_hermes(self.present_call(self.next_call()))
