"""The server's session table: integer ids, a cap, last-used times, idle reaping, one lock each.

A session is one `Environment` instance (one live episode). Unlike AgentGym, a full table is
refused (HTTP 503), never shared, and sessions a client forgot are closed after an idle time-out
by a background reaper, so a crashed trainer cannot exhaust the server.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Awaitable, Callable

from agentgym_jax.envs.protocol import ProtocolError
from environments.base import Environment

log = logging.getLogger(__name__)


@dataclasses.dataclass(eq=False)
class Session:
    """One live episode and what the server knows about it."""

    id: int
    env: Environment
    last_used: float
    lock: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)
    data_idx: int | None = None  # the task of the current episode; None before the first reset
    done: bool = False
    broken: bool = False  # an exception escaped the environment; only reset or close help
    closed: bool = False
    invalid_actions: int = 0

    def touch(self) -> None:
        self.last_used = time.monotonic()


class SessionTable:
    """Creates, finds, pops and lists idle sessions; the server closes their environments."""

    def __init__(self, max_sessions: int, idle_timeout_s: float):
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {max_sessions}")
        if idle_timeout_s <= 0:
            raise ValueError(f"idle_timeout_s must be > 0, got {idle_timeout_s}")
        self.max_sessions = max_sessions
        self.idle_timeout_s = idle_timeout_s
        self._sessions: dict[int, Session] = {}
        self._pending = 0  # environments being built; they count against the cap
        self._next_id = 0  # ids are never reused, so a stale id cannot reach a new episode

    def __len__(self) -> int:
        return len(self._sessions)

    async def create(self, build: Callable[[], Awaitable[Environment]]) -> Session:
        """Builds an environment into a new session, or raises 503 when the cap is reached."""
        if len(self._sessions) + self._pending >= self.max_sessions:
            raise ProtocolError(
                f"session cap {self.max_sessions} reached; close sessions you no longer use "
                f"(idle ones are closed after {self.idle_timeout_s:g} s)",
                status=503,
            )
        self._pending += 1
        try:
            env = await build()
        finally:
            self._pending -= 1
        session = Session(id=self._next_id, env=env, last_used=time.monotonic())
        self._next_id += 1
        self._sessions[session.id] = session
        return session

    def get(self, session_id: int) -> Session:
        session = self._sessions.get(session_id)
        if session is None:
            raise ProtocolError(f"unknown session id {session_id} (closed, reaped or never created)", 404)
        session.touch()
        return session

    def pop(self, session_id: int) -> Session:
        """Removes a session from the table (the caller closes its environment)."""
        session = self.get(session_id)
        del self._sessions[session_id]
        session.closed = True
        return session

    def is_idle(self, session: Session, now: float) -> bool:
        """Unused for longer than the time-out and not busy right now."""
        return now - session.last_used > self.idle_timeout_s and not session.lock.locked()

    def all(self) -> list[Session]:
        return list(self._sessions.values())


async def reap_forever(table: SessionTable, close: Callable[[Session], Awaitable[None]]) -> None:
    """Background task: every quarter time-out, closes the sessions that sat idle past it."""
    interval = min(max(table.idle_timeout_s / 4, 0.05), 30.0)
    while True:
        await asyncio.sleep(interval)
        for session in table.all():
            if session.closed or not table.is_idle(session, time.monotonic()):
                continue  # closing an earlier one awaited; this one may have moved on
            table.pop(session.id)
            log.info("reaping session %d after %.0f s idle", session.id, table.idle_timeout_s)
            await close(session)
