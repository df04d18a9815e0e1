"""The environment wire protocol, shared by the servers (`environments/`) and the clients here.

AgentGym-compatible: `POST /create` -> `{"id"}`; `POST /reset {id, data_idx}`;
`POST /step {id, action}` -> `{observation, reward, done, info}`; `GET /observation?id=`;
`GET /available_actions?id=`; `POST /close {id}`; plus `GET /health` and `GET /tasks`.
Our extensions: `GET /oracle_action?id=` (the next action of the environment's oracle) and
`GET /tools` (`?id=` for a session's own view): the tools of a tool environment in the OpenAI
function format (`tool_calls.py` parses calls to them), `[]` elsewhere.

Errors are real HTTP errors with a JSON body `{"error": "..."}`. This module imports nothing
heavy (no jax) so that servers can use it.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from typing import Any

# Field names AgentGym's per-environment servers use for the same thing.
SESSION_ID_ALIASES = ("id", "env_idx")
TASK_ID_ALIASES = ("data_idx", "idx", "game", "seed", "task_idx")
ACTION_ALIASES = ("action",)

ENDPOINTS = (
    "POST /create",
    "POST /reset",
    "POST /step",
    "GET /observation",
    "GET /available_actions",
    "GET /oracle_action",
    "POST /close",
    "GET /health",
    "GET /tasks",
    "GET /tools",
)


class EpisodeStatus(str, enum.Enum):
    """Every way an episode can end (architecture rule 5: honest accounting)."""

    SUCCESS = "success"
    FAILURE = "failure"
    MAX_TURNS = "max_turns"
    TOKEN_BUDGET = "token_budget"
    INVALID_ACTION_LIMIT = "invalid_action_limit"
    ENV_TIMEOUT = "env_timeout"
    INFRA_ERROR = "infra_error"

    @property
    def is_scored(self) -> bool:
        """Whether the policy, not the infrastructure, decided the outcome."""
        return self not in (EpisodeStatus.ENV_TIMEOUT, EpisodeStatus.INFRA_ERROR)


@dataclasses.dataclass(frozen=True)
class StepResult:
    """What `/step` returns. `info` always carries `invalid_action`, `success` and `score`."""

    observation: str
    reward: float
    done: bool
    info: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> StepResult:
        return cls(
            observation=str(body["observation"]),
            reward=float(body.get("reward", 0.0)),
            done=bool(body.get("done", False)),
            info=dict(body.get("info") or {}),
        )


@dataclasses.dataclass(frozen=True)
class TaskInfo:
    """What `/tasks` returns: the environment's fixed task-id splits and how to read its scores."""

    env: str
    instruction: str  # AgentGym's `conversation_start`: the first message a policy sees
    success_threshold: float  # reward/score at or above which an episode counts as a success
    splits: dict[str, list[int]]  # e.g. {"train": [...], "test": [...]}, sorted ids
    num_tasks: int
    has_oracle: bool = True
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)  # e.g. {"depth": [...]}

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> TaskInfo:
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in body.items() if k in fields})

    def where(self, key: str, values: Sequence[str]) -> TaskInfo:
        """The same environment with every split cut to the tasks whose `metadata[key]` entry
        (a per-task-id list, e.g. TextArena's `game`) reads as one of `values`; ids are kept.

        A job that trains and evaluates on part of an environment (one TextArena game) sees only
        those tasks; a key the metadata lacks, or values no task has, raise `ValueError`.
        """
        per_task = self.metadata.get(key)
        if not isinstance(per_task, (list, tuple)) or len(per_task) != self.num_tasks:
            lists = [k for k, v in self.metadata.items() if isinstance(v, (list, tuple)) and len(v) == self.num_tasks]
            raise ValueError(f"{self.env} has no per-task metadata {key!r} to select tasks by; "
                             f"it has: {', '.join(lists) or 'none'}")
        present = sorted({str(v) for v in per_task})
        unknown = [v for v in values if v not in present]
        if unknown or not values:
            raise ValueError(f"no {self.env} task has {key}={','.join(unknown) or '(nothing)'}; its values: {', '.join(present)}")
        keep = set(values)
        splits = {name: [i for i in ids if str(per_task[i]) in keep] for name, ids in self.splits.items()}
        return dataclasses.replace(self, splits=splits)


class ProtocolError(ValueError):
    """A request that breaks the protocol; servers answer it with a 4xx."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def pick(body: dict[str, Any], aliases: tuple[str, ...], kind: type, name: str) -> Any:
    """Reads the first present alias of a field and checks its type; a clear error otherwise."""
    for key in aliases:
        if key in body:
            value = body[key]
            if kind is int and isinstance(value, str) and value.strip().lstrip("-").isdigit():
                return int(value)  # query strings carry ids as text
            if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                raise ProtocolError(
                    f"field {key!r} must be {kind.__name__}, got {type(value).__name__}"
                )
            return value
    raise ProtocolError(f"missing field {name!r} (accepted names: {', '.join(aliases)})")
