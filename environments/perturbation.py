"""Perturbed environments, for evaluations that report the clean-versus-perturbed gap (AgentGym2).

`python -m environments.serve --env=weather --perturbation=noise=0.05,tool_failure=0.1` serves
the environment wrapped by `perturbed`; `/tasks` names the perturbation in `metadata`, so a
report can say which server a result came from. The perturbations:

- `noise=P`: each non-space character of a step's observation is replaced by a random letter
  with probability P;
- `truncate=N`: a step's observation is cut to N characters (then `...[truncated]`);
- `tool_failure=P`: with probability P a step fails without effect ("temporary failure, try
  again"; a valid action, reward 0);
- `schema_change=T` (tool environments): from turn T on, every tool parameter `x` is renamed
  `x_v2`; calls with the old names are refused with a message listing the new ones, and
  `GET /tools?id=` shows them;
- `hidden_tools=K` (tool environments): the last K tools are left out of the instruction and
  `/tools` until the session calls `check_valid_actions`, which then lists every tool with its
  parameters; hidden tools can be called all along.

The first observation (the goal) is never perturbed. Random draws are seeded by the
perturbation, the task id and the turn, so a task is perturbed the same way on every run.
Success and rewards stay the environment's own.
"""

from __future__ import annotations

import dataclasses
import random
import string
from typing import Any, ClassVar

from agentgym_jax.envs.protocol import StepResult, TaskInfo
from agentgym_jax.envs.protocol.tool_calls import ToolCall
from environments.base import Environment
from environments.tools.base import Result, Tool, ToolEnvironment

TRUNCATED = " ...[truncated]"
TOOL_FAILURE = "Error: the action failed (a temporary failure of the service); nothing changed. Try again."
RENAMED_SUFFIX = "_v2"
HIDDEN_NOTE = " More tools exist than are listed here: check_valid_actions lists every tool with its parameters."
_LETTERS = string.ascii_letters


@dataclasses.dataclass(frozen=True)
class Perturbation:
    noise: float = 0.0
    truncate: int = 0
    tool_failure: float = 0.0
    schema_change: int = 0
    hidden_tools: int = 0

    @classmethod
    def parse(cls, spec: str) -> Perturbation:
        """`"noise=0.05,truncate=300"` -> Perturbation; a clear error naming the valid keys."""
        fields = {f.name: f.type for f in dataclasses.fields(cls)}
        values: dict[str, Any] = {}
        for part in filter(None, (p.strip() for p in spec.split(","))):
            key, _, raw = part.partition("=")
            key = key.strip()
            if key not in fields:
                raise ValueError(f"unknown perturbation {key!r}; valid: {', '.join(fields)}")
            kind = float if fields[key] == "float" else int
            try:
                value = kind(raw)
            except ValueError:
                raise ValueError(f"perturbation {key} needs a {kind.__name__} value, got {raw!r}") from None
            if value < 0 or (kind is float and value > 1):
                raise ValueError(f"perturbation {key}={raw} is out of range ({'0..1' if kind is float else '>= 0'})")
            values[key] = value
        return cls(**values)

    def __str__(self) -> str:
        return ",".join(f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self) if getattr(self, f.name))

    @property
    def needs_tools(self) -> bool:
        return bool(self.schema_change or self.hidden_tools)


def noisy(text: str, rate: float, rng: random.Random) -> str:
    return "".join(rng.choice(_LETTERS) if not ch.isspace() and rng.random() < rate else ch for ch in text)


class PerturbedEnvironment(Environment):
    """Mixed in before an environment class: perturbs its steps (any environment)."""

    perturbation: ClassVar[Perturbation]

    def __init__(self) -> None:
        super().__init__()
        # A session can be asked for its tools and observation before its first reset (an MCP
        # client lists tools as it connects; `GET /tools?id=` right after `/create`).
        self._task_id, self._turn, self._perturbed = -1, 0, ""

    def reset(self, data_idx: int) -> str:
        self._task_id, self._turn = data_idx, 0
        self._perturbed = super().reset(data_idx)
        return self._perturbed

    def _rng(self, what: str) -> random.Random:
        return random.Random(f"{self.perturbation}:{what}:{self._task_id}:{self._turn}")

    def step(self, action: str) -> StepResult:
        """`self._turn` counts the steps done; during a step the one being taken is `_turn + 1`."""
        if self.perturbation.tool_failure and self._rng("failure").random() < self.perturbation.tool_failure:
            result = self.result(TOOL_FAILURE, 0.0, False, invalid=False, perturbed="tool_failure")
        else:
            result = super().step(action)
        observation = result.observation
        if self.perturbation.noise:
            observation = noisy(observation, self.perturbation.noise, self._rng("noise"))
        if self.perturbation.truncate and len(observation) > self.perturbation.truncate:
            observation = observation[:self.perturbation.truncate] + TRUNCATED
        self._turn += 1
        self._perturbed = observation
        return dataclasses.replace(result, observation=observation)

    def observation(self) -> str:
        return self._perturbed


class PerturbedToolEnvironment(PerturbedEnvironment, ToolEnvironment):
    """Adds renamed parameters and hidden tools to a tool environment."""

    def __init__(self) -> None:
        super().__init__()
        self._discovered = False

    def reset(self, data_idx: int) -> str:
        self._discovered = False
        return super().reset(data_idx)

    @classmethod
    def hidden(cls) -> set[str]:
        names = [t.name for t in cls.tools]
        return set(names[len(names) - cls.perturbation.hidden_tools:]) if cls.perturbation.hidden_tools else set()

    def _renamed(self) -> bool:
        """Whether the step being taken (or the next one, between steps) sees renamed parameters."""
        return bool(self.perturbation.schema_change) and self._turn + 1 >= self.perturbation.schema_change

    def tool_table(self) -> dict[str, Tool]:
        table = super().tool_table()
        if not self._renamed():
            return table
        return {name: dataclasses.replace(tool, properties={k + RENAMED_SUFFIX: v for k, v in tool.properties.items()},
                                          required=tuple(k + RENAMED_SUFFIX for k in tool.required))
                for name, tool in table.items()}

    def original_arguments(self, tool: str, arguments: dict[str, Any]) -> dict[str, Any]:
        if not self._renamed():
            return arguments
        return {k[:-len(RENAMED_SUFFIX)]: v for k, v in arguments.items()}

    def present_call(self, call: ToolCall) -> ToolCall:
        if not self._renamed():
            return call
        return ToolCall(call.name, {k + RENAMED_SUFFIX: v for k, v in call.arguments.items()})

    def visible_tools(self) -> list[Tool]:
        hidden = set() if self._discovered else self.hidden()
        return [tool for tool in super().visible_tools() if tool.name not in hidden]

    def tool_check_valid_actions(self) -> Result:
        """Every tool with its parameters; from now on `/tools?id=` shows the hidden ones too."""
        self._discovered = True
        return Result([tool.schema()["function"] for tool in self.tool_table().values()])


def perturbed(env_cls: type[Environment], perturbation: Perturbation) -> type[Environment]:
    """`env_cls` with `perturbation` applied to every session (the class itself when it is empty)."""
    if not str(perturbation):
        return env_cls
    is_tool = issubclass(env_cls, ToolEnvironment)
    if perturbation.needs_tools and not is_tool:
        raise ValueError(f"schema_change and hidden_tools need a tool environment; {env_cls.name} has none")
    mixin = PerturbedToolEnvironment if is_tool else PerturbedEnvironment
    cls = type(env_cls.__name__, (mixin, env_cls), {"perturbation": perturbation, "__module__": env_cls.__module__})
    original = env_cls.task_info

    def task_info(klass: type[Environment]) -> TaskInfo:
        info = original()
        metadata = {**info.metadata, "perturbation": str(perturbation)}
        if is_tool and perturbation.hidden_tools:
            shown = [t for t in cls.all_tools() if t.name not in cls.hidden()]
            metadata["tools"] = [t.schema() for t in shown]
            return dataclasses.replace(info, instruction=cls.build_instruction(shown, HIDDEN_NOTE), metadata=metadata)
        return dataclasses.replace(info, metadata=metadata)

    cls.task_info = classmethod(task_info)
    return cls
