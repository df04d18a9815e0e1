"""Seconds XLA spends compiling, so a step's time splits into compiling and running.

A short recipe over a real model meets new shapes at every step for a while (decodes by rows
and slots, fills, packed update lengths), and on a 2-core CPU their compiles can take as long as
the step's own work: without this split a step's seconds cannot be compared with a benchmark's
warm ones (`bench/rl_step.py`).
"""

from __future__ import annotations

import threading

import jax

BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"  # jax._src.dispatch.BACKEND_COMPILE_EVENT


class CompileClock:
    """Counts the backend compiles of this process (every thread) while open: `seconds`, `programs`."""

    def __init__(self):
        self.seconds, self.programs = 0.0, 0
        self._lap = (0.0, 0)
        self._lock = threading.Lock()

    def lap(self) -> tuple[float, int]:
        """Seconds and programs compiled since the last lap (or since the clock was made)."""
        with self._lock:
            lap, self._lap = (self.seconds - self._lap[0], self.programs - self._lap[1]), (self.seconds, self.programs)
        return lap

    def _on_duration(self, event: str, duration: float, **kwargs) -> None:
        if event == BACKEND_COMPILE:
            with self._lock:
                self.seconds += duration
                self.programs += 1

    def __enter__(self) -> CompileClock:
        jax.monitoring.register_event_duration_secs_listener(self._on_duration)
        return self

    def __exit__(self, *exc) -> None:
        jax.monitoring.unregister_event_duration_listener(self._on_duration)
