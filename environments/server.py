"""The aiohttp server that hosts any `Environment` subclass behind the AgentGym protocol.

`make_app(env_cls, ...)` returns an `aiohttp.web.Application`; `environments/serve.py` runs it.
Requests and answers are described in `docs/protocol.md`. Every error is an HTTP status with a
JSON body `{"error": ...}` (with `agentgym_errors`, refusals and environment failures are HTTP
200 `{"error": ...}`, as AgentGym's servers answer them); nothing a client sends can crash the
server or touch another session.
Cheap environments run inline on the event loop (one call at a time), except a step with a reply
longer than `INLINE_REPLY_CHARS`, which runs in a thread while the environment's other calls
wait; `Environment.blocking = True` moves all of an environment's calls to a thread pool (one
call per session at a time, per the session lock). A reply (the `/step` action text) longer than
`max_action_chars` is an invalid turn that never reaches the environment.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import hmac
import json
import logging
from typing import Any, Awaitable, Callable, TypeVar

from aiohttp import web

from agentgym_jax.envs import protocol
from agentgym_jax.envs.protocol import ProtocolError
from environments.base import Environment
from environments.sessions import Session, SessionTable, default_max_sessions, reap_forever

log = logging.getLogger(__name__)
T = TypeVar("T")

DEFAULT_MAX_BODY_BYTES = 256 * 1024  # far above any model turn; a 1 MB action is refused (413)
# Characters of one `/step` action (the model's whole reply) an environment is given: ~2000
# tokens, far above a turn's `max_tokens_per_turn` (256 by default); longer is an invalid turn.
DEFAULT_MAX_ACTION_CHARS = 8192
# The longest reply an inline environment is stepped with on the event loop: Python string work
# over a megabyte takes ~0.1 s, which /health and every other session would wait for.
INLINE_REPLY_CHARS = 16_384
ERROR_STATUS_HEADER = "X-Error-Status"  # with --agentgym_errors: the status a 200 error answer stands for
# AgentGym's SearchQA and tool clients name the session `env_idx` and the task `id` at /reset
TOOL_SESSION_FIELD, TOOL_TASK_FIELD = "env_idx", "id"
UNPARSED_ACTION = (
    "Invalid action: no action found in your reply. "
    "Answer in the format \"Thought: <your thoughts> Action: <one action>\"."
)
REPLY_TOO_LONG = (
    "Invalid action: your reply is {chars} characters long and this server reads at most {limit}. "
    "Answer briefly in the format \"Thought: <your thoughts> Action: <one action>\"."
)


class EnvironmentFailure(Exception):
    """An exception escaped the environment; the session is marked broken (HTTP 500)."""


def _error(status: int, message: str, **headers: str) -> web.Response:
    return web.json_response({"error": message}, status=status, headers=headers or None)


def _agentgym_error(status: int, message: str) -> web.Response:
    """AgentGym's env wrappers' way: HTTP 200 with `{"error"}`; the real status in a header."""
    return web.json_response({"error": message}, headers={ERROR_STATUS_HEADER: str(status)})


def _error_middleware(env_name: str, body_limit: int, agentgym_errors: bool = False):
    """Turns every failure into a JSON `{"error"}` answer (aiohttp's own pages are text/HTML).

    `agentgym_errors`: the errors AgentGym's servers report as HTTP 200 `{"error"}` (a refused
    request, an environment failure) are answered that way; HTTP-level ones (unknown path,
    wrong method, body too large, missing token) keep their status, as FastAPI gives them too.
    """
    refuse = _agentgym_error if agentgym_errors else _error

    @web.middleware
    async def middleware(request: web.Request, handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except ProtocolError as e:
            return refuse(e.status, str(e))
        except web.HTTPException as e:
            if e.status < 400:
                raise
            if isinstance(e, web.HTTPNotFound):
                return _error(404, f"unknown path {request.path!r}; endpoints: {', '.join(protocol.ENDPOINTS)}")
            if isinstance(e, web.HTTPMethodNotAllowed):
                allowed = ", ".join(sorted(e.allowed_methods))
                return _error(405, f"{request.method} not allowed on {request.path}; use {allowed}", Allow=allowed)
            if isinstance(e, web.HTTPRequestEntityTooLarge):
                return _error(413, f"request body too large (limit {body_limit} bytes)")
            return _error(e.status, e.text or e.reason)
        except EnvironmentFailure as e:
            return refuse(500, str(e))
        except Exception as e:  # a bug in the framework itself; keep serving
            log.exception("internal error on %s %s", request.method, request.path)
            return _error(500, f"internal error in the {env_name} server: {type(e).__name__}: {e}")

    return middleware


def _auth_middleware(token: str, open_paths: frozenset[str]):
    """Requires `Authorization: Bearer <token>` on every path except the health checks."""
    expected = f"Bearer {token}".encode()

    @web.middleware
    async def middleware(request: web.Request, handler) -> web.StreamResponse:
        if request.path not in open_paths:
            given = request.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(given, expected):
                return _error(401, "missing or wrong bearer token", **{"WWW-Authenticate": "Bearer"})
        return await handler(request)

    return middleware


async def _json_body(request: web.Request) -> dict[str, Any]:
    """The request's JSON object; an empty body is `{}` (AgentGym's clients post none to /create)."""
    raw = await request.read()  # raises 413 past client_max_size
    if not raw.strip():
        return {}
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ProtocolError(f"request body is not UTF-8 text ({e.reason} at byte {e.start})") from None
    try:
        body = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise ProtocolError(f"request body is not valid JSON: {e}"[:300]) from None
    if not isinstance(body, dict):
        raise ProtocolError(f"request body must be a JSON object, got {type(body).__name__}")
    return body


def _pick(fields: Any, aliases: tuple[str, ...], kind: type, name: str) -> Any:
    """`protocol.pick`, with ids too long for `int()` (over 4300 digits) also a 400."""
    try:
        return protocol.pick(fields, aliases, kind, name)
    except ProtocolError:
        raise
    except ValueError as e:
        raise ProtocolError(f"field {name!r} is not a usable {kind.__name__}: {e}"[:300]) from None


class EnvServer:
    """The protocol handlers for one environment class over one session table."""

    def __init__(self, env_cls: type[Environment], table: SessionTable, executor: concurrent.futures.Executor | None,
                 max_action_chars: int = DEFAULT_MAX_ACTION_CHARS, max_sessions_from: str = "--max_sessions"):
        self.env_cls = env_cls
        self.table = table
        self.executor = executor  # None: call the environment inline on the event loop
        self.max_action_chars = max_action_chars
        self.max_sessions_from = max_sessions_from  # what the cap follows from, named in /health
        self.inline_turn = asyncio.Lock()  # an inline environment's code never runs twice at once
        self.task_info = env_cls.task_info()
        self.num_tasks = self.task_info.num_tasks
        self.tasks_body = json.dumps(self.task_info.to_json())

    async def _call(self, fn: Callable[..., T], *args: Any, long: bool = False) -> T:
        """Runs an environment call: in the pool for blocking environments, else on the event loop,
        or, when `long`, in a thread while the inline environment's other calls wait."""
        loop = asyncio.get_running_loop()
        if self.executor is not None:
            return await loop.run_in_executor(self.executor, fn, *args)
        async with self.inline_turn:  # free unless a long call is in its thread: no wait then
            return await loop.run_in_executor(None, fn, *args) if long else fn(*args)

    async def _call_env(self, session: Session, fn: Callable[..., T], *args: Any, long: bool = False) -> T:
        """Runs an environment call; an exception marks the session broken and becomes a 500.

        A `ProtocolError` the environment raises is a refusal (its 4xx), not a failure.
        """
        try:
            return await self._call(fn, *args, long=long)
        except ProtocolError:
            raise  # the environment refused this request (a 4xx); the episode is intact
        except Exception as e:
            session.broken = True
            log.exception("%s session %d failed", self.env_cls.name, session.id)
            raise EnvironmentFailure(
                f"{self.env_cls.name} session {session.id} failed: {type(e).__name__}: {e}; "
                "the session is broken: reset or close it"
            ) from e

    def _session(self, fields: Any) -> Session:
        """The session a request names: `env_idx` where given (then `id` may be a task id), else `id`."""
        aliases = (TOOL_SESSION_FIELD,) if TOOL_SESSION_FIELD in fields else protocol.SESSION_ID_ALIASES
        return self.table.get(_pick(fields, aliases, int, "id"))

    @staticmethod
    def _check_live(session: Session, what: str) -> None:
        """Refuses calls that need a running episode (409: the request conflicts with the state)."""
        if session.closed:
            raise ProtocolError(f"session {session.id} was closed", 404)
        if session.broken:
            raise ProtocolError(f"session {session.id} is broken by an earlier environment error; reset or close it", 409)
        if session.data_idx is None:
            raise ProtocolError(f"session {session.id} has no episode yet: POST /reset before {what}", 409)

    async def close_session(self, session: Session) -> None:
        """Closes the environment of a session already popped from the table."""
        async with session.lock:  # waits for a call in flight to finish
            try:
                await self._call(session.env.close)
            except Exception:
                log.exception("%s session %d failed to close", self.env_cls.name, session.id)

    # --- handlers ---

    async def create(self, request: web.Request) -> web.Response:
        body = await _json_body(request)  # AgentGym's TextCraft client posts settings we do not need
        self.env_cls.check_create(body)
        session = await self.table.create(functools.partial(self._call, self.env_cls))
        if request.transport is None or request.transport.is_closing():
            # The client gave up while the environment was built (a time-out); nobody knows this
            # id, so its engine would sit unused until the idle reaper: release it now.
            log.info("%s session %d built for a client that went away; closing it", self.env_cls.name, session.id)
            await self.close_session(self.table.pop(session.id))
            raise ProtocolError("the client went away before its session was built; it was closed", 408)
        answer = {"id": session.id, "observation": ""}  # TextCraft's client reads `observation`; /reset starts the episode
        if shaping := body.get("reward_shaping"):
            session.env.reward_shaping = shaping
            answer["reward_shaping"] = shaping  # the confirmation a client checks (a server without shaping omits it)
        return web.json_response(answer)

    async def reset(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        task_aliases = protocol.TASK_ID_ALIASES + ((TOOL_TASK_FIELD,) if TOOL_SESSION_FIELD in body else ())
        data_idx = _pick(body, task_aliases, int, "data_idx")
        if not 0 <= data_idx < self.num_tasks:
            raise ProtocolError(f"data_idx {data_idx} out of range: valid task ids are 0..{self.num_tasks - 1}")
        session = self._session(body)
        async with session.lock:
            if session.closed:
                raise ProtocolError(f"session {session.id} was closed", 404)
            observation, score, extra = await self._call_env(session, _reset, session.env, data_idx)
            session.data_idx, session.done, session.broken = data_idx, False, False
            session.invalid_actions = 0
        return web.json_response(
            {"id": session.id, "data_idx": data_idx, "observation": observation,
             "reward": 0.0, "score": score, "done": False, **extra}
        )

    async def step(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        text = _pick(body, protocol.ACTION_ALIASES, str, "action")
        session = self._session(body)
        async with session.lock:
            self._check_live(session, "/step")
            if session.done:
                raise ProtocolError(f"episode of session {session.id} is done; POST /reset to start another", 409)
            result = await self._call_env(session, _step, session.env, text, self.max_action_chars,
                                          long=len(text) > INLINE_REPLY_CHARS)
            session.done = result.done
            if result.info.get("invalid_action"):
                session.invalid_actions += 1
            info = {**result.info, "invalid_actions": session.invalid_actions}
        # `StepResult.to_json()` plus the top-level `score` AgentGym's BabyAI client reads; built
        # by hand because `dataclasses.asdict` deep-copies and shows up on the hot path.
        return web.json_response({"observation": result.observation, "reward": result.reward, "done": result.done,
                                  "info": info, "score": info.get("score", 0.0)})

    async def _query(self, request: web.Request, what: str, read: Callable[[Environment], Any],
                     needs_episode: bool = True, refuse_done: bool = False) -> Any:
        session = self._session(request.query)
        async with session.lock:
            if needs_episode:
                self._check_live(session, what)
            elif session.closed:
                raise ProtocolError(f"session {session.id} was closed", 404)
            if refuse_done and session.done:
                raise ProtocolError(f"episode of session {session.id} is done; nothing left for {what}", 409)
            return await self._call_env(session, read, session.env)

    async def observation(self, request: web.Request) -> web.Response:
        observation = await self._query(request, "/observation", lambda env: env.observation())
        return web.json_response({"observation": observation})

    async def available_actions(self, request: web.Request) -> web.Response:
        actions = await self._query(request, "/available_actions", lambda env: list(env.available_actions()))
        return web.json_response({"available_actions": actions})

    async def oracle_action(self, request: web.Request) -> web.Response:
        if not self.env_cls.has_oracle:
            raise ProtocolError(f"{self.env_cls.name} has no oracle", 501)
        oracle = request.query.get("oracle", "")
        if oracle and oracle not in self.env_cls.oracles:
            valid = ", ".join(repr(o) for o in self.env_cls.oracles) or "none besides the default"
            raise ProtocolError(f"{self.env_cls.name} has no oracle {oracle!r}; valid: {valid}")
        read = (lambda env: env.named_oracle_action(oracle)) if oracle else (lambda env: env.oracle_action())
        action = await self._query(request, "/oracle_action", read, refuse_done=True)
        # A named oracle is echoed: the confirmation a client checks.
        return web.json_response({"action": action, **({"oracle": oracle} if oracle else {})})

    def extra_query(self, name: str) -> Callable[[web.Request], Awaitable[web.Response]]:
        async def handler(request: web.Request) -> web.Response:
            value = await self._query(request, f"/{name}", lambda env: getattr(env, name)(), needs_episode=False)
            return web.json_response(value)

        return handler

    async def close(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        session_id = _pick(body, protocol.SESSION_ID_ALIASES, int, "id")
        session = self.table.pop(session_id)
        await self.close_session(session)
        return web.json_response({"id": session_id, "closed": True})

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"status": "ok", "env": self.env_cls.name, "sessions": len(self.table),
             "max_sessions": self.table.max_sessions, "max_sessions_from": self.max_sessions_from,
             "max_action_chars": self.max_action_chars}
        )

    async def tasks(self, request: web.Request) -> web.Response:
        return web.Response(text=self.tasks_body, content_type="application/json")

    async def tools(self, request: web.Request) -> web.Response:
        """The class's tools, or with `?id=` the session's (which a perturbation may change)."""
        if not any(key in request.query for key in protocol.SESSION_ID_ALIASES):
            return web.json_response({"tools": self.env_cls.tool_schemas()})
        tools = await self._query(request, "/tools", lambda env: env.session_tool_schemas(), needs_episode=False)
        return web.json_response({"tools": tools})

    async def close_all(self) -> None:
        for session in self.table.all():
            self.table.pop(session.id)
            await self.close_session(session)


def _reset(env: Environment, data_idx: int) -> tuple[str, float, dict[str, Any]]:
    observation = env.reset(data_idx)
    return observation, env.score(), env.reset_fields()


def _step(env: Environment, text: str, max_action_chars: int) -> protocol.StepResult:
    """Model text or a parsed action -> one step; unreadable or over-long text is an ordinary invalid turn."""
    if len(text) > max_action_chars:
        return env.result(REPLY_TOO_LONG.format(chars=len(text), limit=max_action_chars), 0.0, False, invalid=True)
    action = env.parse_action(text)
    if action is None:
        return env.result(UNPARSED_ACTION, 0.0, False, invalid=True)
    return env.step(action)


def make_app(
    env_cls: type[Environment],
    *,
    max_sessions: int | None = None,
    idle_timeout_s: float = 900.0,
    auth_token: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_action_chars: int = DEFAULT_MAX_ACTION_CHARS,
    threads: int | None = None,
    agentgym_errors: bool = False,
) -> web.Application:
    """An aiohttp app serving `env_cls` on the plain paths and on each of its `route_prefixes`.

    `max_sessions` None: the environment's default (`sessions.default_max_sessions`: from memory
    for engine-backed ones). `auth_token` guards every path but `/health` (so launchers can wait
    for readiness without it). `threads` sizes the pool used when `env_cls.blocking` (default:
    min(32, max_sessions)). `agentgym_errors` answers refusals and environment failures as HTTP
    200 `{"error"}`, for AgentGym's unchanged clients (see `_error_middleware`).
    """
    if max_action_chars < 1:
        raise ValueError(f"max_action_chars must be >= 1, got {max_action_chars}")
    max_sessions_from = "--max_sessions"
    if max_sessions is None:
        max_sessions, max_sessions_from = default_max_sessions(env_cls)
    table = SessionTable(max_sessions=max_sessions, idle_timeout_s=idle_timeout_s)
    executor = None
    if env_cls.blocking:
        workers = threads or min(32, max_sessions)
        executor = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix=f"{env_cls.name}-env")
    server = EnvServer(env_cls, table, executor, max_action_chars, max_sessions_from)

    prefixes = ("",) + tuple(env_cls.route_prefixes)
    middlewares = [_error_middleware(env_cls.name, max_body_bytes, agentgym_errors)]
    if auth_token:
        middlewares.append(_auth_middleware(auth_token, frozenset(f"{p}/health" for p in prefixes)))
    app = web.Application(client_max_size=max_body_bytes, middlewares=middlewares)

    routes = [
        ("POST", "/create", server.create),
        ("POST", "/reset", server.reset),
        ("POST", "/step", server.step),
        ("GET", "/observation", server.observation),
        ("GET", "/available_actions", server.available_actions),
        ("GET", "/oracle_action", server.oracle_action),
        ("POST", "/close", server.close),
        ("GET", "/health", server.health),
        ("GET", "/tasks", server.tasks),
        ("GET", "/tools", server.tools),
    ] + [("GET", f"/{name}", server.extra_query(name)) for name in env_cls.extra_queries]
    for prefix in prefixes:
        app.router.add_routes([web.route(method, prefix + path, handler) for method, path, handler in routes])

    async def lifetime(app: web.Application):
        env_cls.on_server_start()
        reaper = asyncio.create_task(reap_forever(table, server.close_session))
        yield
        reaper.cancel()
        await server.close_all()
        env_cls.on_server_stop()
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)

    app.cleanup_ctx.append(lifetime)
    return app
