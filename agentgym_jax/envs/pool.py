"""`EnvPool`: many episodes over one or many environment servers, for a batched rollout engine.

A *slot* is one place in the rollout batch; it plays one episode at a time, on a server session
it holds while the episode runs. Slots are spread over the server URLs (`slot % len(urls)`). Calls never raise for
environment failures: every result carries the episode's end status when the episode ended
(architecture rule 5), so one dead server ends its own episodes with `infra_error` and the rest go on.

- `infra_error`: the server stayed unreachable through `max_retries` retries with exponential
  backoff, or answered with an HTTP error (4xx are never retried).
- `env_timeout`: the server was reachable but slow: a step got no answer within the request
  time-out, or the episode used up `episode_timeout_s` of time waiting on the environment.

Live sessions are bounded per server: at most `max_sessions` (0: no bound of the pool's own) and
never more than the server's own cap (`max_sessions` of its `/health`, asked once; a server
that refuses a `/create` at its cap while this pool holds sessions there lowers the bound to
those). A reset that needs a session past the bound waits, without using up its episode's time,
until another episode of this pool gives one back: an episode the environment ended returns its
session for the next reset of any slot, `close_sessions` closes them. A caller that resets more
slots at once than `session_capacity()` and only steps them once all resets answered waits
forever, so the rollout engine plays its episodes in waves of at most that many.

    async with EnvPool(urls) as pool:
        firsts = await pool.reset_many([(slot, data_idx), ...])
        async for result in pool.step_as_completed([(slot, action_text), ...]):
            ...  # continue the episodes whose observations arrived first
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import aiohttp

from agentgym_jax.envs.client import (
    EnvClient,
    EnvConnectionError,
    EnvError,
    EnvRequestTimeout,
    EnvServerError,
    SessionId,
)
from agentgym_jax.envs.protocol import EpisodeStatus, TaskInfo

log = logging.getLogger(__name__)

# (slot, observation) -> action text; the oracle and a model sampler both fit.
Policy = Callable[[int, str], Awaitable[str]]
# (url, http_session, request_timeout_s=, auth_token=, reward_shaping=) -> client: `EnvClient` or a dialect's.
ClientFactory = Callable[..., EnvClient]

_RETRIED_STATUSES = (502, 503, 504)  # overloaded or restarting: worth another try
_SESSION_LOST_STATUSES = (404, 410)  # reaped after idling: a reset opens a new session


@dataclasses.dataclass(frozen=True)
class SlotResult:
    """The answer to one reset or step of one slot.

    `status` is None while the episode goes on and the end status once it has ended
    (`done` from the environment, or an infrastructure failure described by `error`).
    """

    slot: int
    observation: str
    reward: float = 0.0
    done: bool = False
    info: dict[str, Any] = dataclasses.field(default_factory=dict)
    status: EpisodeStatus | None = None
    error: str | None = None


@dataclasses.dataclass(frozen=True)
class PlayedTurn:
    action: str
    observation: str
    reward: float


@dataclasses.dataclass(frozen=True)
class PlayedEpisode:
    """A whole episode played by `run_episode`: the transcript and how it ended."""

    data_idx: int
    first_observation: str
    turns: tuple[PlayedTurn, ...]
    status: EpisodeStatus
    info: dict[str, Any]  # the last step's info (`success`, `score`, ...)
    error: str | None = None

    @property
    def reward(self) -> float:
        return sum(t.reward for t in self.turns)


@dataclasses.dataclass(eq=False)
class _Server:
    """This pool's sessions on one server: how many are open, which are free, the bound."""

    client: EnvClient
    limit: float  # most sessions open at once: the pool's bound, lowered to the server's cap
    cap_asked: bool = False  # its /health was read (or it has none)
    open: int = 0  # sessions open there: held by slots, idle, or being created
    idle: list[SessionId] = dataclasses.field(default_factory=list)  # open, no episode: any slot's next
    changed: asyncio.Condition = dataclasses.field(default_factory=asyncio.Condition)
    health_lock: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)

    def has_room(self) -> bool:
        return bool(self.idle) or self.open < self.limit


@dataclasses.dataclass
class _Slot:
    server: _Server
    session_id: SessionId | None = None
    data_idx: int | None = None
    env_time_s: float = 0.0  # time this episode has spent waiting on the environment
    status: EpisodeStatus | None = None  # set once the episode has ended
    busy: bool = False


class _ServerFull(Exception):
    """A /create refused at the server's cap (503) while this pool holds other sessions there."""


class _EpisodeEnded(Exception):
    """Raised inside the pool when a request gives up; turned into a `SlotResult` status."""

    def __init__(self, status: EpisodeStatus, cause: EnvError):
        super().__init__(str(cause))
        self.status = status
        self.cause = cause
        self.error = str(cause)


class EnvPool:
    """Sessions over `urls` with bounded concurrency, time-outs and retries. See module doc."""

    def __init__(
        self,
        urls: str | Sequence[str],
        *,
        max_concurrency: int = 64,
        max_sessions: int = 0,
        request_timeout_s: float = 30.0,
        episode_timeout_s: float = 600.0,
        max_retries: int = 6,
        backoff_s: float = 0.1,
        max_backoff_s: float = 2.0,
        auth_token: str = "",
        reward_shaping: str = "",
        client_factory: ClientFactory = EnvClient,
    ):
        urls = [urls] if isinstance(urls, str) else list(urls)
        if not urls:
            raise ValueError("EnvPool needs at least one server URL")
        if max_concurrency < 1 or max_retries < 0 or request_timeout_s <= 0 or episode_timeout_s <= 0:
            raise ValueError("max_concurrency >= 1, max_retries >= 0 and positive time-outs required")
        if max_sessions < 0:
            raise ValueError(f"max_sessions must be >= 0 (0: the servers' own caps), got {max_sessions}")
        self.urls = urls
        self.episode_timeout_s = episode_timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self._request_timeout_s = request_timeout_s
        self._auth_token = auth_token
        self._reward_shaping = reward_shaping
        self._client_factory = client_factory
        self._max_concurrency = max_concurrency
        self._max_sessions = max_sessions
        self._http: aiohttp.ClientSession | None = None
        self._servers: list[_Server] = []
        self._semaphore: asyncio.Semaphore | None = None
        self._slots: dict[int, _Slot] = {}
        self._scratch_slots = itertools.count(-1, -1)  # run_episode's own slots, apart from the batch

    async def __aenter__(self) -> EnvPool:
        connector = aiohttp.TCPConnector(limit=self._max_concurrency, limit_per_host=0)
        self._http = aiohttp.ClientSession(connector=connector)
        self._semaphore = asyncio.Semaphore(self._max_concurrency)
        self._servers = [
            _Server(
                self._client_factory(url, self._http, request_timeout_s=self._request_timeout_s, auth_token=self._auth_token,
                                     reward_shaping=self._reward_shaping),
                limit=self._max_sessions or float("inf"),
            )
            for url in self.urls
        ]
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def close(self) -> None:
        """Closes every open session (best effort, briefly) and the HTTP connection pool."""
        if self._http is None:
            return
        await self.close_sessions()
        await self._http.close()
        self._http = None

    # -- one slot -----------------------------------------------------------------------------

    async def reset(self, slot: int, data_idx: int, *, tools: bool = False) -> SlotResult:
        """Starts task `data_idx` in `slot` (opening a session if the slot has none); with `tools`,
        the session's tools (`GET /tools?id=`) come in `info["tools"]`."""
        state = self._acquire(slot, resetting=True)
        state.data_idx, state.env_time_s, state.status = data_idx, 0.0, None
        reset = lambda c: c.reset(state.session_id, data_idx)  # noqa: E731
        try:
            if state.session_id is None:
                await self._open_session(slot, state)
                observation = await self._call(state, reset, idempotent=True)
            else:
                try:
                    observation = await self._call(state, reset, idempotent=True)
                except _EpisodeEnded as e:
                    if not _session_unusable(e.cause):
                        raise
                    await self._forget_session(state)
                    await self._open_session(slot, state)  # reaped, or its server died: start over once
                    observation = await self._call(state, reset, idempotent=True)
            info = {}
            if tools:
                info["tools"] = await self._call(state, lambda c: c.tools(state.session_id), idempotent=True)
            return SlotResult(slot, observation, info=info)
        except _EpisodeEnded as e:
            return await self._end(slot, state, e, release=True)
        finally:
            state.busy = False

    async def step(self, slot: int, action: str) -> SlotResult:
        """Sends one action; `status` is set when this step ended the episode."""
        state = self._acquire(slot, resetting=False)
        try:
            result = await self._call(state, lambda c: c.step(state.session_id, action), idempotent=False)
        except _EpisodeEnded as e:
            return await self._end(slot, state, e, release=False)
        finally:
            state.busy = False
        status = None
        if result.done:
            status = EpisodeStatus.SUCCESS if result.info.get("success") else EpisodeStatus.FAILURE
            state.status = status
            await self._release_session(state)  # a waiting reset (any slot) may take it
        return SlotResult(slot, result.observation, result.reward, result.done, result.info, status)

    async def oracle_action(self, slot: int, oracle: str = "") -> str:
        """The next action of the environment's oracle (or the one named `oracle`) for the slot's
        live episode (raises `EnvError` on failure)."""
        state = self._slots.get(slot)
        if state is None or state.session_id is None:
            raise ValueError(f"slot {slot} has no session: reset it first")
        try:
            return await self._call(state, lambda c: c.oracle_action(state.session_id, oracle), idempotent=True)
        except _EpisodeEnded as e:
            raise e.cause from None

    async def oracle_policy(self, slot: int, observation: str) -> str:
        """`oracle_action` with the `Policy` signature, for `run_episode`."""
        del observation
        return await self.oracle_action(slot)

    # -- many slots ---------------------------------------------------------------------------

    async def reset_many(self, items: Sequence[tuple[int, int]]) -> list[SlotResult]:
        """`[(slot, data_idx), ...]` -> results in the same order, requests concurrent."""
        return list(await asyncio.gather(*(self.reset(s, i) for s, i in items)))

    async def step_many(self, items: Sequence[tuple[int, str]]) -> list[SlotResult]:
        """`[(slot, action_text), ...]` -> results in the same order, requests concurrent."""
        return list(await asyncio.gather(*(self.step(s, a) for s, a in items)))

    def reset_as_completed(self, items: Sequence[tuple[int, int]]) -> AsyncIterator[SlotResult]:
        """Like `reset_many`, but yields each slot's result as soon as it arrives."""
        return _as_completed([self.reset(s, i) for s, i in items])

    def step_as_completed(self, items: Sequence[tuple[int, str]]) -> AsyncIterator[SlotResult]:
        """Like `step_many`, but yields each slot's result as soon as it arrives."""
        return _as_completed([self.step(s, a) for s, a in items])

    # -- whole episodes and server info -------------------------------------------------------

    async def run_episode(self, data_idx: int, policy: Policy, horizon: int = 100) -> PlayedEpisode:
        """Plays task `data_idx` to the end on a slot of its own, e.g. with `self.oracle_policy`."""
        slot = next(self._scratch_slots)
        try:
            first = await self.reset(slot, data_idx)
            turns: list[PlayedTurn] = []
            last = first
            while last.status is None and len(turns) < horizon:
                try:
                    action = await policy(slot, last.observation)
                except EnvError as e:  # e.g. the oracle's server went away
                    last = await self._end(slot, self._slots[slot], _EpisodeEnded(EpisodeStatus.INFRA_ERROR, e), release=True)
                    break
                last = await self.step(slot, action)
                turns.append(PlayedTurn(action, last.observation, last.reward))
            status = last.status or EpisodeStatus.MAX_TURNS
            return PlayedEpisode(data_idx, first.observation, tuple(turns), status, last.info, last.error)
        finally:
            await self.release(slot)

    async def release(self, slot: int) -> None:
        """Forgets `slot` and gives its session back for any slot's next reset (closes it instead
        if the episode timed out: the server may still be busy with it). For callers that end
        episodes themselves (a turn limit) and go on with other slots, e.g. a stream of episodes."""
        state = self._slots.pop(slot, None)
        if state is not None and state.session_id is not None:
            if state.status is EpisodeStatus.ENV_TIMEOUT:  # it may still be busy: not for another episode
                await self._close_session(state.server, state.session_id)
            else:
                await self._release_session(state)

    async def tasks(self) -> TaskInfo:
        """The environment's task splits (asked of the first server)."""
        self._check_open()
        return await self._servers[0].client.tasks()

    async def session_capacity(self) -> int:
        """The most sessions this pool holds open at once over all its servers (their caps asked)."""
        self._check_open()
        limits = [await self._server_limit(server) for server in self._servers]
        return int(min(sum(limits), 2**31 - 1))

    async def close_sessions(self) -> None:
        """Closes every session of the pool (best effort, briefly): the slots' next resets open new
        ones, and other clients of the servers (another pool) get the room."""
        self._check_open()
        closing = [(server, sid) for server in self._servers for sid in server.idle]
        for server in self._servers:
            server.idle = []
        for state in self._slots.values():
            if state.session_id is not None:
                closing.append((state.server, state.session_id))
                state.session_id = None
        await asyncio.gather(*(self._close_session(server, sid) for server, sid in closing))

    # -- internals ----------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._http is None:
            raise RuntimeError("EnvPool is not open: use `async with EnvPool(urls) as pool:`")

    def _acquire(self, slot: int, *, resetting: bool) -> _Slot:
        self._check_open()
        state = self._slots.get(slot)
        if state is None:
            if not resetting:
                raise ValueError(f"slot {slot} has no episode: reset it before stepping")
            state = self._slots[slot] = _Slot(self._servers[slot % len(self._servers)])
        if state.busy:
            raise ValueError(f"slot {slot} already has a request in flight")
        if not resetting and state.status is not None:
            raise ValueError(f"slot {slot}'s episode already ended ({state.status.value}); reset it first")
        state.busy = True
        return state

    async def _open_session(self, slot: int, state: _Slot) -> None:
        """Gives the slot a session on its server, failing over to the next URLs if it is down."""
        start = self._servers.index(state.server)
        error: _EpisodeEnded | None = None
        for k in range(len(self._servers)):
            state.server = self._servers[(start + k) % len(self._servers)]
            try:
                state.session_id = await self._session_on(state)
                return
            except _EpisodeEnded as e:
                error = e
                if not _unreachable(e.cause):
                    break
        assert error is not None
        raise error

    async def _session_on(self, state: _Slot) -> SessionId:
        """An idle session of the slot's server, else a new one within its bound (waiting for a
        session to be given back while the bound is reached)."""
        server = state.server
        await self._server_limit(server)
        while True:
            async with server.changed:
                await server.changed.wait_for(server.has_room)
                if server.idle:
                    return server.idle.pop()
                server.open += 1
            try:
                return await self._call(state, lambda c: self._create(c, server), idempotent=True)
            except _ServerFull:
                async with server.changed:  # its cap is what this pool holds there: wait for one of those
                    server.open -= 1
                    server.limit = max(1, min(server.limit, server.open))
                log.info("%s refused a session at its cap; this pool now holds at most %d there",
                         server.client.url, server.limit)
            except BaseException:
                await self._count_closed(server)
                raise

    async def _create(self, client: EnvClient, server: _Server) -> SessionId:
        try:
            return await client.create()
        except EnvServerError as e:
            if e.status == 503 and server.open > 1:  # this pool's other sessions fill it
                raise _ServerFull(str(e)) from e
            raise

    async def _server_limit(self, server: _Server) -> float:
        """The server's bound for this pool: `max_sessions`, at most the cap its /health reports."""
        async with server.health_lock:
            if not server.cap_asked:
                try:
                    health = await asyncio.wait_for(server.client.health(), self._request_timeout_s)
                    server.cap_asked = True
                    cap = health.get("max_sessions") if isinstance(health, dict) else None
                    if isinstance(cap, int) and cap >= 1:
                        server.limit = min(server.limit, cap)
                except EnvServerError:
                    server.cap_asked = True  # a server without /health: its /create answers tell
                except (EnvError, asyncio.TimeoutError):
                    pass  # down for now: the requests' own retries and errors tell, ask again later
        return server.limit

    async def _count_closed(self, server: _Server) -> None:
        async with server.changed:
            server.open -= 1
            server.changed.notify_all()

    async def _release_session(self, state: _Slot) -> None:
        """The slot's episode is over: its session waits, open, for the next reset of any slot."""
        if state.session_id is None:
            return
        server, session_id, state.session_id = state.server, state.session_id, None
        async with server.changed:
            server.idle.append(session_id)
            server.changed.notify_all()

    async def _forget_session(self, state: _Slot) -> None:
        """The slot's session is gone (reaped, or its server unreachable): it no longer counts."""
        if state.session_id is not None:
            state.session_id = None
            await self._count_closed(state.server)

    async def _call(self, state: _Slot, request: Callable[[EnvClient], Awaitable[Any]], *, idempotent: bool) -> Any:
        """One request with retries; raises `_EpisodeEnded` with the status when it gives up."""
        last_error: EnvError | None = None
        client = state.server.client
        for attempt in range(self.max_retries + 1):
            remaining = self.episode_timeout_s - state.env_time_s
            if remaining <= 0:
                break
            async with self._semaphore:
                start = time.monotonic()
                try:
                    return await asyncio.wait_for(request(client), remaining)
                except asyncio.TimeoutError:
                    last_error = EnvRequestTimeout(f"{client.url}: episode time-out of {self.episode_timeout_s} s")
                    break
                except EnvRequestTimeout as e:
                    last_error = e
                    if not idempotent:  # the server may have applied it: sending it again could step twice
                        break
                except EnvConnectionError as e:
                    last_error = e
                except EnvServerError as e:
                    last_error = e
                    if e.status not in _RETRIED_STATUSES:
                        break
                finally:
                    state.env_time_s += time.monotonic() - start
            if attempt < self.max_retries:
                delay = min(self.backoff_s * 2**attempt, self.max_backoff_s, max(remaining, 0.0))
                await asyncio.sleep(delay)
                state.env_time_s += delay
        if last_error is None or isinstance(last_error, EnvRequestTimeout):
            error = last_error or EnvRequestTimeout(f"episode time-out of {self.episode_timeout_s} s")
            raise _EpisodeEnded(EpisodeStatus.ENV_TIMEOUT, error)
        raise _EpisodeEnded(EpisodeStatus.INFRA_ERROR, last_error)

    async def _end(self, slot: int, state: _Slot, e: _EpisodeEnded, *, release: bool) -> SlotResult:
        """The episode ended on `e`. A session that is gone no longer counts; a working one is
        given back (`release`: the request, not the session, failed) or stays the slot's."""
        log.warning("slot %d (task %s) ended %s: %s", slot, state.data_idx, e.status.value, e.error)
        state.status = e.status
        if _session_unusable(e.cause):
            await self._forget_session(state)  # the next reset opens one (on another server if need be)
        elif release and not isinstance(e.cause, EnvRequestTimeout):  # a slow one stays with its slot
            await self._release_session(state)
        return SlotResult(slot, "", done=True, status=e.status, error=e.error)

    async def _close_session(self, server: _Server, session_id: SessionId) -> None:
        try:
            async with self._semaphore:
                await asyncio.wait_for(server.client.close(session_id), min(self._request_timeout_s, 5.0))
        except (EnvError, asyncio.TimeoutError) as e:
            log.info("closing session %s on %s failed: %s", session_id, server.client.url, e)
        finally:
            await self._count_closed(server)


def _is_session_lost(error: EnvError) -> bool:
    return isinstance(error, EnvServerError) and error.status in _SESSION_LOST_STATUSES


def _unreachable(error: EnvError) -> bool:
    return isinstance(error, EnvConnectionError) and not isinstance(error, EnvRequestTimeout)


def _session_unusable(error: EnvError) -> bool:
    """The session is gone (reaped) or its server unreachable, so a new one is worth opening."""
    return _unreachable(error) or _is_session_lost(error)


def _as_completed(coros: list[Awaitable[SlotResult]]) -> AsyncIterator[SlotResult]:
    """Starts every request now; yields results in the order they arrive."""
    return _yield_as_completed([asyncio.ensure_future(c) for c in coros])


async def _yield_as_completed(tasks: list[asyncio.Future]) -> AsyncIterator[SlotResult]:
    try:
        for next_done in asyncio.as_completed(tasks):
            yield await next_done
    finally:
        for task in tasks:
            task.cancel()
