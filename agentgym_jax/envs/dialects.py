"""Dialect adapters: drive AgentGym's own environment servers with the same client and `EnvPool`.

AgentGym's servers agree on the shape of the protocol (create, reset, step, observation) but not
on the details: paths (LMRL-Gym under `/maze/`, `/wordle/`), the session-id field (`id` or
`env_idx`), the task-id field of `/reset` (`data_idx`, `game`, `seed`, `session_id`, `item_id`,
`id`, `idx`), how answers look (objects, bare ids and strings, `[observation, null]` pairs) and
the step fields (`state` for `observation`, `terminated` for `done`, `score` for `reward`).
Most report failures as HTTP 200 with `{"error": "..."}`. One frozen `Dialect` per server
describes those facts; `DialectClient` maps `EnvClient`'s calls onto it and turns 200-with-error
answers into `EnvServerError`. The table is documented in `docs/dialects.md`.

    pool = EnvPool(url, client_factory=dialect_client_factory("textcraft"))
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any

import aiohttp

from agentgym_jax.envs.client import EnvClient, EnvServerError, SessionId
from agentgym_jax.envs.protocol import StepResult, TaskInfo


@dataclasses.dataclass(frozen=True)
class Dialect:
    """How one AgentGym server spells the protocol."""

    name: str
    id_field: str = "id"  # session id in request bodies and query strings
    reset_field: str = "data_idx"  # task id in the /reset body
    prefix: str = ""  # path prefix, e.g. "/maze"
    create_body: tuple[tuple[str, Any], ...] = ()  # fields /create expects (tool servers pick a task here)
    create_id_key: str | None = "id"  # where /create puts the session id; None: the answer is the bare id
    reset_extra: tuple[tuple[str, Any], ...] = ()  # extra /reset fields, e.g. ALFWorld's world_type
    reset_observation_keys: tuple[str, ...] = ("observation",)  # joined with newlines (SciWorld: 2)
    observation_key: str = "observation"  # step answer field holding the observation
    reward_key: str = "reward"  # step answer field the AgentGym client reads as the reward
    done_key: str = "done"
    success_threshold: float = 1.0  # reward at or above which a finished episode counts as a success
    # True: every finished episode is a success, whatever its reward (BabyAI's server ends an episode
    # only when solved, with reward 1 - 0.9 * steps / max_steps, e.g. 0.8875)
    success_when_done: bool = False
    available_actions_path: str | None = None  # GET path listing the valid actions, if the server has one
    has_close: bool = True
    close_missing_ok: bool = False  # True: a 404 to /close is fine (AgentGym's LMRL-Gym server has none; ours has)
    error_style: str = "200 + {error}"  # how the server reports failures (documentation)


_FASTAPI_500 = "HTTP 500 (unhandled exception)"
_TOOL = dict(
    id_field="env_idx", reset_field="id", create_body=(("id", 0),), create_id_key=None,
    has_close=False, error_style=_FASTAPI_500,
)

DIALECTS: dict[str, Dialect] = {
    d.name: d
    for d in [
        Dialect("textcraft", create_body=(("commands", None), ("goal", None))),
        Dialect("babyai", reward_key="score", success_when_done=True),
        Dialect("sciworld", reset_observation_keys=("task_description", "observation"), reward_key="score",
                success_threshold=100.0),
        Dialect("alfworld", reset_field="game", reset_extra=(("world_type", "Text"),),
                available_actions_path="/available_actions", has_close=False),
        Dialect("maze", prefix="/maze", reset_field="game", available_actions_path="/available_actions",
                close_missing_ok=True),
        Dialect("wordle", prefix="/wordle", reset_field="seed", close_missing_ok=True),
        Dialect("webshop", id_field="env_idx", reset_field="session_id", create_id_key=None,
                observation_key="state", available_actions_path="/available_actions", has_close=False,
                error_style=_FASTAPI_500),
        Dialect("sqlgym", id_field="env_idx", reset_field="item_id", create_id_key=None,
                observation_key="state", has_close=False, error_style=_FASTAPI_500),
        Dialect("searchqa", **{**_TOOL, "has_close": True}),
        Dialect("weather", **_TOOL),
        Dialect("movie", **_TOOL),
        Dialect("todo", **_TOOL),
        Dialect("sheet", **_TOOL),
        Dialect("academia", **_TOOL),
        Dialect("webarena", id_field="env_idx", reset_field="idx", create_id_key="env_idx",
                reset_extra=(("seed", 0),), done_key="terminated", error_style="Quart: exceptions as HTTP 500"),
    ]
}

# AgentGym's messages for a session the server does not know / has finished.
# (and ours under --agentgym_errors: "unknown session id 3 (...)")
_UNKNOWN_SESSION = re.compile(r"is not valid|has been deleted|not found|not exist|unknown session", re.IGNORECASE)
_FINISHED = re.compile(r"has finished", re.IGNORECASE)


def get_dialect(name: str) -> Dialect:
    if name not in DIALECTS:
        raise KeyError(f"unknown dialect {name!r}; valid: {', '.join(sorted(DIALECTS))}")
    return DIALECTS[name]


class DialectClient(EnvClient):
    """`EnvClient`'s calls spoken in one AgentGym dialect; results are our protocol types."""

    def __init__(self, url: str, session: aiohttp.ClientSession, *, dialect: Dialect | str, **kwargs: Any):
        super().__init__(url, session, **kwargs)
        if self.reward_shaping:
            raise ValueError(f"reward_shaping={self.reward_shaping!r}: AgentGym's servers pay their own rewards only")
        self.dialect = get_dialect(dialect) if isinstance(dialect, str) else dialect

    async def _send(self, method: str, path: str, session_id: SessionId | None = None, **fields: Any) -> Any:
        """One request on the dialect's path; a 200 `{"error"}` answer raises `EnvServerError`."""
        d = self.dialect
        if session_id is None:
            answer = await self.request(method, d.prefix + path, body=fields if method == "POST" else None)
        elif method == "GET":
            answer = await self.request(method, d.prefix + path, params={d.id_field: session_id})
        else:
            answer = await self.request(method, d.prefix + path, body={d.id_field: session_id, **fields})
        if isinstance(answer, dict) and "error" in answer and len(answer) == 1:
            message = str(answer["error"])
            status = 404 if _UNKNOWN_SESSION.search(message) else 409 if _FINISHED.search(message) else 500
            raise EnvServerError(status, message, self.url + d.prefix + path)
        return answer

    async def create(self) -> SessionId:
        answer = await self._send("POST", "/create", **dict(self.dialect.create_body))
        key = self.dialect.create_id_key
        if key is None and isinstance(answer, dict):  # our servers answer {"id": ...} to every dialect
            key = "id"
        return answer[key] if key else answer

    async def reset(self, session_id: SessionId, data_idx: int) -> str:
        d = self.dialect
        answer = await self._send("POST", "/reset", session_id, **{d.reset_field: data_idx, **dict(d.reset_extra)})
        if isinstance(answer, list):  # WebShop, SQLGym: [observation, null]
            answer = answer[0]
        if isinstance(answer, dict):
            return "\n".join(str(answer[k]) for k in d.reset_observation_keys if k in answer)
        return str(answer)

    async def step(self, session_id: SessionId, action: str) -> StepResult:
        d = self.dialect
        answer = await self._send("POST", "/step", session_id, action=action)
        reward = float(answer.get(d.reward_key, answer.get("reward", 0.0)))
        done = bool(answer.get(d.done_key, False))
        info = dict(answer.get("info") or {}) if isinstance(answer.get("info"), dict) else {}
        info.setdefault("score", answer.get("score", reward))
        info.setdefault("success", done and (d.success_when_done or reward >= d.success_threshold))
        info.setdefault("invalid_action", False)
        return StepResult(str(answer.get(d.observation_key, "")), reward, done, info)

    async def observation(self, session_id: SessionId) -> str:
        answer = await self._send("GET", "/observation", session_id)
        return str(answer.get("observation", "")) if isinstance(answer, dict) else str(answer)

    async def available_actions(self, session_id: SessionId) -> list[str]:
        path = self.dialect.available_actions_path
        if path is None:
            raise EnvServerError(501, f"the {self.dialect.name} dialect has no available-actions endpoint", self.url)
        answer = await self._send("GET", path, session_id)
        if isinstance(answer, dict):  # ours: {"available_actions"}; WebShop: {"clickables", ...}
            answer = answer.get("available_actions", answer.get("clickables", []))
        return [str(a) for a in answer]

    async def oracle_action(self, session_id: SessionId, oracle: str = "") -> str:
        """Only our servers have an oracle; AgentGym's answer 404."""
        if oracle:
            raise ValueError(f"oracle={oracle!r}: AgentGym's servers have no oracles")
        answer = await self._send("GET", "/oracle_action", session_id)
        return str(answer["action"] if isinstance(answer, dict) else answer)

    async def close(self, session_id: SessionId) -> None:
        if not self.dialect.has_close:
            return
        try:
            await self._send("POST", "/close", session_id)
        except EnvServerError as e:
            if not (self.dialect.close_missing_ok and e.status == 404):
                raise

    async def health(self) -> dict[str, Any]:
        """Ours answer `/health`; AgentGym's greet on `GET /` (unprefixed): a 200 there means up."""
        try:
            return await self._send("GET", "/health")
        except EnvServerError as e:
            if e.status != 404:
                raise
        return {"status": "ok", "greeting": await self.request("GET", "/")}

    async def tasks(self) -> TaskInfo:
        return TaskInfo.from_json(await self._send("GET", "/tasks"))


def dialect_client_factory(dialect: Dialect | str) -> functools.partial[DialectClient]:
    """An `EnvPool(client_factory=...)` that speaks `dialect`."""
    return functools.partial(DialectClient, dialect=get_dialect(dialect) if isinstance(dialect, str) else dialect)
