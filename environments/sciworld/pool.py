"""A warm pool of ScienceWorld engines, so that `/create` and the first `/reset` are fast.

A new JVM takes seconds to start and its first loads are slow (class loading, cold JIT: the
first gold-path load of `boil` takes ~25 s in a fresh engine, ~2 s in a used one). So engines
are reused: the pool starts `size` warmed engines, hands one to each new session, and takes it
back when the session closes (a `load` resets the world); clients such as `EnvPool` open a
session per episode, so the same few hot engines serve episode after episode. When a session
takes the last idle engine, a background thread starts a replacement (one at a time, so warming
never competes with itself for the CPU); a session that finds none idle waits for that one or
starts its own. At most `size` engines stay idle: past that, the one idle longest is shut down.
Memory is bounded per engine by the JVM heap cap and in total by the number of engines: at most
`max_sessions + size` (the server's session cap plus the idle ones), each about heap +
`ENGINE_OVERHEAD_MB` resident (330 MB measured at a 256 MB heap); the server's default cap
follows from that (`SciWorldEnv.session_memory_mb`). At most `PARALLEL_STARTS` engines start at
once: a JVM start is seconds of CPU, and more at once only make every one of them later.

Configuration (read once per process): `SCIWORLD_POOL_SIZE` (default 2, 0 disables warming) and
`SCIWORLD_HEAP_MB` (default `simulator.DEFAULT_HEAP_MB`).
"""

from __future__ import annotations

import functools
import logging
import os
import threading

from environments.sciworld.simulator import DEFAULT_HEAP_MB, Simulator

log = logging.getLogger(__name__)

WARM_UP_TASK = ("boil", 0)  # the slowest first load; loading it once warms the engine's classes
ENGINE_OVERHEAD_MB = 80  # an engine's resident memory beyond its heap
PARALLEL_STARTS = 2
_STARTS = threading.Semaphore(PARALLEL_STARTS)


def configured_size() -> int:
    return int(os.environ.get("SCIWORLD_POOL_SIZE", "2"))


def configured_heap_mb() -> int:
    return int(os.environ.get("SCIWORLD_HEAP_MB", str(DEFAULT_HEAP_MB)))


def start(heap_mb: int) -> Simulator:
    """A new engine, once fewer than `PARALLEL_STARTS` others are starting."""
    with _STARTS:
        return Simulator(heap_mb)


def start_warm(heap_mb: int) -> Simulator:
    """Starts an engine and loads one task so that the session's first load is quick."""
    simulator = start(heap_mb)
    simulator.load(*WARM_UP_TASK)
    simulator.step("look around")
    return simulator


class SimulatorPool:
    """Idle warm engines plus one background thread that tops them up to `size`."""

    def __init__(self, size: int, heap_mb: int = DEFAULT_HEAP_MB):
        if size < 0 or heap_mb < 64:
            raise ValueError(f"need size >= 0 and heap_mb >= 64, got size={size}, heap_mb={heap_mb}")
        self.size = size
        self.heap_mb = heap_mb
        self._idle: list[Simulator] = []
        self._cond = threading.Condition()
        self._closed = False
        self._primed = False  # the first `size` engines have been started
        self._starting = False  # the filler is starting an engine
        self._waiting = 0  # acquirers waiting for that engine
        self._filler: threading.Thread | None = None

    def start(self) -> None:
        """Starts the background filler (idempotent); returns at once."""
        with self._cond:
            if self._filler is None and self.size > 0 and not self._closed:
                self._filler = threading.Thread(target=self._fill_forever, name="sciworld-pool", daemon=True)
                self._filler.start()

    def _needs_engine(self) -> bool:
        if len(self._idle) >= self.size:
            self._primed = True
        return not self._idle or (not self._primed and len(self._idle) < self.size)

    def _fill_forever(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._closed or self._needs_engine())
                if self._closed:
                    return
                self._starting = True
            try:
                simulator = start_warm(self.heap_mb)
            except Exception:
                log.exception("could not start a ScienceWorld engine for the pool")
                with self._cond:  # back off, but wake at once on close
                    self._starting = False
                    self._cond.notify_all()
                    self._cond.wait_for(lambda: self._closed, timeout=10.0)
                continue
            added = self._put(simulator, hot=False)
            with self._cond:
                self._starting = False
                self._cond.notify_all()
            if not added:
                simulator.close()

    def _put(self, simulator: Simulator, hot: bool) -> bool:
        """Adds an engine to the idle list; False when the caller must close it.

        Hot (used) engines go last, where `acquire` takes from; fresh ones first. Past `size`
        the first one (idle longest, or never used) is shut down.
        """
        with self._cond:
            if self._closed or not simulator.alive():
                return False
            if hot:
                self._idle.append(simulator)
            else:
                self._idle.insert(0, simulator)
            evicted = self._idle.pop(0) if len(self._idle) > self.size else None
            self._cond.notify_all()
        if evicted is simulator:
            return False
        if evicted is not None:
            evicted.close()
        return True

    def acquire(self) -> Simulator:
        """An idle warm engine; else the one the filler is starting, unless another caller waits
        for it already; else a freshly started one."""
        self.start()
        with self._cond:
            if not self._idle and self._starting and self._waiting == 0:
                self._waiting += 1
                self._cond.wait_for(lambda: self._idle or not self._starting)
                self._waiting -= 1
            while self._idle:
                simulator = self._idle.pop()
                self._cond.notify_all()  # the filler tops up
                if simulator.alive():
                    return simulator
                simulator.close()
        return start(self.heap_mb)

    def release(self, simulator: Simulator) -> None:
        """Takes an engine back from a closed session: kept if there is room, else shut down."""
        if not self._put(simulator, hot=True):
            simulator.close()

    def idle(self) -> int:
        with self._cond:
            return len(self._idle)

    def close(self) -> None:
        """Shuts down the idle engines and stops the filler; later releases close their engine."""
        with self._cond:
            self._closed = True
            idle, self._idle = self._idle, []
            self._cond.notify_all()
        for simulator in idle:
            simulator.close()


@functools.cache
def shared_pool() -> SimulatorPool:
    """The process's pool, configured from `SCIWORLD_POOL_SIZE` and `SCIWORLD_HEAP_MB`."""
    return SimulatorPool(configured_size(), configured_heap_mb())
