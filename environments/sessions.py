"""The server's session table: random integer ids, a cap, last-used times, idle reaping, one lock each.

A session is one `Environment` instance (one live episode). Unlike AgentGym, a full table is
refused (HTTP 503), never shared, and sessions a client forgot are closed after an idle time-out
by a background reaper, so a crashed trainer cannot exhaust the server. Ids are random 63-bit
integers: a client reaches only the sessions whose ids it was given (AgentGym's clients read and
send them as JSON integers, which 63 bits keep exact in Python and in any 64-bit reader).

The default cap of an environment whose session holds an engine process (a JVM, a browser)
follows from the machine's memory (`default_max_sessions`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import secrets
import time
from typing import Awaitable, Callable

from agentgym_jax.envs.protocol import ProtocolError
from environments.base import Environment

log = logging.getLogger(__name__)

ID_BITS = 63  # ids in [0, 2**63): a signed 64-bit integer in any client
# The share of the machine's memory the engines of one server's sessions may hold by default
# (the trainer and the rest of the machine keep the other half).
MEMORY_SHARE = 0.5


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
        session = Session(id=self._new_id(), env=env, last_used=time.monotonic())
        self._sessions[session.id] = session
        return session

    def _new_id(self) -> int:
        """A random id no live session has; a stale id reaches a new session with chance 2**-63."""
        while (session_id := secrets.randbits(ID_BITS)) in self._sessions:
            pass
        return session_id

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


def machine_memory_mb() -> float:
    """The memory this process may use: the machine's, or its cgroup's limit when lower (containers)."""
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    for limit_file in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(limit_file) as f:
                limit = f.read().strip()
        except OSError:
            continue
        if limit.isdigit():
            total = min(total, int(limit))
    return total / 2**20


def default_max_sessions(env_cls: type[Environment]) -> tuple[int, str]:
    """(cap, what it follows from) for a server started without `--max_sessions`.

    An environment whose session holds an engine of `session_memory_mb` (a JVM, a browser) gets as
    many sessions as `MEMORY_SHARE` of the machine's memory holds engines, less its idle warm ones,
    and at least one; any other gets its class's `max_sessions`.
    """
    if not env_cls.session_memory_mb:
        return env_cls.max_sessions, f"the {env_cls.name} environment's default"
    memory_mb, idle = machine_memory_mb(), env_cls.idle_engines()
    engines = int(MEMORY_SHARE * memory_mb // env_cls.session_memory_mb)
    cap = max(1, min(env_cls.max_sessions, engines - idle))
    return cap, (f"memory: {MEMORY_SHARE:.0%} of {memory_mb / 1024:.1f} GiB holds {engines} engines of "
                 f"{env_cls.session_memory_mb:g} MiB, less {idle} kept idle")
