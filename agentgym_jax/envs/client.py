"""Async HTTP client for one environment server (the protocol in `protocol/`).

One `EnvClient` per server URL; many clients share one `aiohttp.ClientSession` (one connection
pool). Failures come back typed so callers can decide what to retry:
`EnvServerError` (the server answered 4xx/5xx), `EnvConnectionError` (no answer: refused, reset,
disconnected) and its subclass `EnvRequestTimeout` (no answer in time).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp

from agentgym_jax.envs.protocol import StepResult, TaskInfo

SessionId = int | str


class EnvError(Exception):
    """Base of every error an environment call raises."""


class EnvServerError(EnvError):
    """The server answered with an HTTP error status; `message` is its `{"error": ...}` text."""

    def __init__(self, status: int, message: str, url: str = ""):
        super().__init__(f"HTTP {status} from {url}: {message}" if url else f"HTTP {status}: {message}")
        self.status = status
        self.message = message
        self.url = url

    @property
    def is_client_error(self) -> bool:
        """4xx: the request was wrong; sending it again gives the same answer."""
        return 400 <= self.status < 500


class EnvConnectionError(EnvError):
    """No HTTP answer: connection refused or reset, server gone."""


class EnvRequestTimeout(EnvConnectionError):
    """No HTTP answer within the request time-out."""


class EnvClient:
    """Calls one server. Every method is one HTTP request (no retries: `EnvPool` does those)."""

    def __init__(
        self,
        url: str,
        session: aiohttp.ClientSession,
        *,
        request_timeout_s: float = 30.0,
        auth_token: str = "",
        reward_shaping: str = "",
    ):
        self.url = url.rstrip("/")
        self.reward_shaping = reward_shaping  # asked of every session at /create ("": the environment's own reward)
        self._session = session
        self.request_timeout_s = request_timeout_s
        self._timeout = aiohttp.ClientTimeout(total=request_timeout_s)
        self._headers = {"Authorization": f"Bearer {auth_token}"} if auth_token else {}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    async def request(
        self,
        method: str,
        path: str,
        *,
        body: dict[str, Any] | None = None,
        params: dict[str, Any] | None = None,
    ) -> Any:
        """One request -> the decoded JSON body (or the text when the body is not JSON)."""
        url = self.url + path
        params = {k: str(v) for k, v in (params or {}).items()}
        try:
            async with self._session.request(
                method, url, json=body, params=params, headers=self._headers, timeout=self._timeout
            ) as response:
                text = await response.text()
                status = response.status
                is_json = response.content_type == "application/json"
        except asyncio.TimeoutError as e:
            raise EnvRequestTimeout(f"{method} {url}: no answer within {self.request_timeout_s:.3g} s") from e
        except aiohttp.ClientConnectionError as e:
            raise EnvConnectionError(f"{method} {url}: {type(e).__name__}: {e}") from e
        answer = _decode(text) if is_json else text
        if status >= 400:
            message = answer.get("error", text) if isinstance(answer, dict) else text
            raise EnvServerError(status, str(message), url)
        return answer

    async def create(self) -> SessionId:
        """A new session; with `reward_shaping`, one the server confirmed pays it (else `EnvServerError` 400:
        a server that ignored the field would train on rewards other than the ones asked for)."""
        if not self.reward_shaping:
            return (await self.request("POST", "/create"))["id"]
        answer = await self.request("POST", "/create", body={"reward_shaping": self.reward_shaping})
        if answer.get("reward_shaping") != self.reward_shaping:
            raise EnvServerError(400, f"the server did not confirm reward_shaping={self.reward_shaping!r} "
                                      "(an older or AgentGym server ignores it)", self.url + "/create")
        return answer["id"]

    async def reset(self, session_id: SessionId, data_idx: int) -> str:
        """Starts task `data_idx` in the session; returns the first observation.

        A `task_description` field (ScienceWorld's) comes first, on its own line, as AgentGym's
        client joins them.
        """
        body = await self.request("POST", "/reset", body={"id": session_id, "data_idx": data_idx})
        observation = _field(body, "observation")
        if isinstance(body, dict) and body.get("task_description"):
            return f"{body['task_description']}\n{observation}"
        return observation

    async def tools(self, session_id: SessionId | None = None) -> list[dict[str, Any]]:
        """The environment's tools (OpenAI function schemas), or with `session_id` the session's own
        (a perturbation may rename or hide some); [] for an environment without tools."""
        params = {} if session_id is None else {"id": session_id}
        return list(_field(await self.request("GET", "/tools", params=params), "tools"))

    async def step(self, session_id: SessionId, action: str) -> StepResult:
        body = await self.request("POST", "/step", body={"id": session_id, "action": action})
        return StepResult.from_json(body)

    async def observation(self, session_id: SessionId) -> str:
        return _field(await self.request("GET", "/observation", params={"id": session_id}), "observation")

    async def available_actions(self, session_id: SessionId) -> list[str]:
        body = await self.request("GET", "/available_actions", params={"id": session_id})
        return list(_field(body, "available_actions"))

    async def oracle_action(self, session_id: SessionId, oracle: str = "") -> str:
        """The next action of the environment's oracle, or of the one named `oracle` (which the
        server must confirm: one that ignored the name would answer with its default oracle)."""
        answer = await self.request("GET", "/oracle_action", params={"id": session_id, **({"oracle": oracle} if oracle else {})})
        if oracle and (not isinstance(answer, dict) or answer.get("oracle") != oracle):
            raise EnvServerError(400, f"the server did not confirm oracle={oracle!r} (an older server ignores it)",
                                 self.url + "/oracle_action")
        return _field(answer, "action")

    async def close(self, session_id: SessionId) -> None:
        await self.request("POST", "/close", body={"id": session_id})

    async def health(self) -> dict[str, Any]:
        return await self.request("GET", "/health")

    async def tasks(self) -> TaskInfo:
        return TaskInfo.from_json(await self.request("GET", "/tasks"))


def _decode(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def _field(body: Any, name: str) -> Any:
    """`body[name]` for object answers; bare answers (AgentGym style) are the value itself."""
    if isinstance(body, dict):
        if name not in body:
            raise EnvServerError(200, f"answer lacks field {name!r}: {str(body)[:200]}")
        return body[name]
    return body
