"""`EnvPool`: many episodes over one or many environment servers, for a batched rollout engine.

A *slot* is one place in the rollout batch; it holds one server session and plays one episode
at a time. Slots are spread over the server URLs (`slot % len(urls)`). Calls never raise for
environment failures: every result carries the episode's end status when the episode ended
(DESIGN rule 5), so one dead server ends its own episodes with `infra_error` and the rest go on.

- `infra_error`: the server stayed unreachable through `max_retries` retries with exponential
  backoff, or answered with an HTTP error (4xx are never retried).
- `env_timeout`: the server was reachable but slow: a step got no answer within the request
  time-out, or the episode used up `episode_timeout_s` of time waiting on the environment.

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
# (url, http_session, request_timeout_s=, auth_token=) -> client: `EnvClient` or a dialect's.
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
class Turn:
    action: str
    observation: str
    reward: float


@dataclasses.dataclass(frozen=True)
class Episode:
    """A whole episode played by `run_episode`: the transcript and how it ended."""

    data_idx: int
    first_observation: str
    turns: tuple[Turn, ...]
    status: EpisodeStatus
    info: dict[str, Any]  # the last step's info (`success`, `score`, ...)
    error: str | None = None

    @property
    def reward(self) -> float:
        return sum(t.reward for t in self.turns)


@dataclasses.dataclass
class _Slot:
    client: EnvClient
    session_id: SessionId | None = None
    data_idx: int | None = None
    env_time_s: float = 0.0  # time this episode has spent waiting on the environment
    status: EpisodeStatus | None = None  # set once the episode has ended
    busy: bool = False


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
        request_timeout_s: float = 30.0,
        episode_timeout_s: float = 600.0,
        max_retries: int = 6,
        backoff_s: float = 0.1,
        max_backoff_s: float = 2.0,
        auth_token: str = "",
        client_factory: ClientFactory = EnvClient,
    ):
        urls = [urls] if isinstance(urls, str) else list(urls)
        if not urls:
            raise ValueError("EnvPool needs at least one server URL")
        if max_concurrency < 1 or max_retries < 0 or request_timeout_s <= 0 or episode_timeout_s <= 0:
            raise ValueError("max_concurrency >= 1, max_retries >= 0 and positive time-outs required")
        self.urls = urls
        self.episode_timeout_s = episode_timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self._request_timeout_s = request_timeout_s
        self._auth_token = auth_token
        self._client_factory = client_factory
        self._max_concurrency = max_concurrency
        self._http: aiohttp.ClientSession | None = None
        self._clients: list[EnvClient] = []
        self._semaphore: asyncio.Semaphore | None = None
        self._slots: dict[int, _Slot] = {}
        self._scratch_slots = itertools.count(-1, -1)  # run_episode's own slots, apart from the batch

    async def __aenter__(self) -> EnvPool:
        connector = aiohttp.TCPConnector(limit=self._max_concurrency, limit_per_host=0)
        self._http = aiohttp.ClientSession(connector=connector)
        self._semaphore = asyncio.Semaphore(self._max_concurrency)
        self._clients = [
            self._client_factory(url, self._http, request_timeout_s=self._request_timeout_s, auth_token=self._auth_token)
            for url in self.urls
        ]
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def close(self) -> None:
        """Closes every open session (best effort, briefly) and the HTTP connection pool."""
        if self._http is None:
            return
        open_slots = [s for s in self._slots if self._slots[s].session_id is not None]
        await asyncio.gather(*(self._close_session(s) for s in open_slots))
        await self._http.close()
        self._http = None

    # -- one slot -----------------------------------------------------------------------------

    async def reset(self, slot: int, data_idx: int) -> SlotResult:
        """Starts task `data_idx` in `slot` (opening a session if the slot has none)."""
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
                    await self._open_session(slot, state)  # reaped, or its server died: start over once
                    observation = await self._call(state, reset, idempotent=True)
            return SlotResult(slot, observation)
        except _EpisodeEnded as e:
            return self._end(slot, state, e, drop_session=True)
        finally:
            state.busy = False

    async def step(self, slot: int, action: str) -> SlotResult:
        """Sends one action; `status` is set when this step ended the episode."""
        state = self._acquire(slot, resetting=False)
        try:
            result = await self._call(state, lambda c: c.step(state.session_id, action), idempotent=False)
        except _EpisodeEnded as e:
            return self._end(slot, state, e, drop_session=e.status is EpisodeStatus.INFRA_ERROR)
        finally:
            state.busy = False
        status = None
        if result.done:
            status = EpisodeStatus.SUCCESS if result.info.get("success") else EpisodeStatus.FAILURE
            state.status = status
        return SlotResult(slot, result.observation, result.reward, result.done, result.info, status)

    async def oracle_action(self, slot: int) -> str:
        """The oracle's next action for the slot's live episode (raises `EnvError` on failure)."""
        state = self._slots.get(slot)
        if state is None or state.session_id is None:
            raise ValueError(f"slot {slot} has no session: reset it first")
        try:
            return await self._call(state, lambda c: c.oracle_action(state.session_id), idempotent=True)
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

    async def run_episode(self, data_idx: int, policy: Policy, horizon: int = 100) -> Episode:
        """Plays task `data_idx` to the end on a slot of its own, e.g. with `self.oracle_policy`."""
        slot = next(self._scratch_slots)
        try:
            first = await self.reset(slot, data_idx)
            turns: list[Turn] = []
            last = first
            while last.status is None and len(turns) < horizon:
                try:
                    action = await policy(slot, last.observation)
                except EnvError as e:  # e.g. the oracle's server went away
                    last = self._end(slot, self._slots[slot], _EpisodeEnded(EpisodeStatus.INFRA_ERROR, e), True)
                    break
                last = await self.step(slot, action)
                turns.append(Turn(action, last.observation, last.reward))
            status = last.status or EpisodeStatus.MAX_TURNS
            return Episode(data_idx, first.observation, tuple(turns), status, last.info, last.error)
        finally:
            if self._slots[slot].session_id is not None:
                await self._close_session(slot)
            del self._slots[slot]

    async def tasks(self) -> TaskInfo:
        """The environment's task splits (asked of the first server)."""
        self._check_open()
        return await self._clients[0].tasks()

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
            state = self._slots[slot] = _Slot(self._clients[slot % len(self._clients)])
        if state.busy:
            raise ValueError(f"slot {slot} already has a request in flight")
        if not resetting and state.status is not None:
            raise ValueError(f"slot {slot}'s episode already ended ({state.status.value}); reset it first")
        state.busy = True
        return state

    async def _open_session(self, slot: int, state: _Slot) -> None:
        """Creates a session on the slot's server, failing over to the next URLs if it is down."""
        start = self._clients.index(state.client)
        error: _EpisodeEnded | None = None
        for k in range(len(self._clients)):
            state.client = self._clients[(start + k) % len(self._clients)]
            try:
                state.session_id = await self._call(state, lambda c: c.create(), idempotent=True)
                return
            except _EpisodeEnded as e:
                error = e
                if not _unreachable(e.cause):
                    break
        assert error is not None
        raise error

    async def _call(self, state: _Slot, request: Callable[[EnvClient], Awaitable[Any]], *, idempotent: bool) -> Any:
        """One request with retries; raises `_EpisodeEnded` with the status when it gives up."""
        last_error: EnvError | None = None
        for attempt in range(self.max_retries + 1):
            remaining = self.episode_timeout_s - state.env_time_s
            if remaining <= 0:
                break
            async with self._semaphore:
                start = time.monotonic()
                try:
                    return await asyncio.wait_for(request(state.client), remaining)
                except asyncio.TimeoutError:
                    last_error = EnvRequestTimeout(f"{state.client.url}: episode time-out of {self.episode_timeout_s} s")
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

    def _end(self, slot: int, state: _Slot, e: _EpisodeEnded, drop_session: bool) -> SlotResult:
        log.warning("slot %d (task %s) ended %s: %s", slot, state.data_idx, e.status.value, e.error)
        state.status = e.status
        if drop_session:
            state.session_id = None  # its server is gone or it was never opened: the next reset opens one
        return SlotResult(slot, "", done=True, status=e.status, error=e.error)

    async def _close_session(self, slot: int) -> None:
        state = self._slots[slot]
        session_id, state.session_id = state.session_id, None
        try:
            async with self._semaphore:
                await asyncio.wait_for(state.client.close(session_id), min(self._request_timeout_s, 5.0))
        except (EnvError, asyncio.TimeoutError) as e:
            log.info("closing session %s on %s failed: %s", session_id, state.client.url, e)


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
