"""How far a job's phase has got: a bar on a terminal, plain lines in a log.

Every long phase of a job (oracle demonstrations, SFT batches, evaluation episodes, RL steps)
reports through one `Progress`. Where stderr is a terminal it draws a tqdm bar; where stderr is
a file or a pipe (a log, a batch system, a notebook) it writes plain lines instead,

    rl 3/24 steps | 21.4 s/step | 1:04 elapsed | success_rate=0.25 horizon=4

one as the phase starts, then at most one per `interval_s` seconds, and its last one, so that a
log says where the job is without carriage-return clutter. Only process 0 of a multi-process job shows anything;
`enabled=False` shows nothing (library calls, tests).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, TextIO

import tqdm

from agentgym_jax.parallel.distributed import is_writer


def _is_terminal(stream: TextIO) -> bool:
    """A terminal a bar can be drawn on (a pseudo-terminal without a width, as some CI runners
    open, gets lines: tqdm would draw nothing there)."""
    if not stream.isatty():
        return False
    try:
        return os.get_terminal_size(stream.fileno()).columns > 0
    except (OSError, ValueError):  # no file descriptor behind it: trust isatty
        return True


def _plural(unit: str) -> str:
    return unit + ("es" if unit.endswith(("s", "x", "ch", "sh")) else "s")


def _format_value(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _format_duration(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class Progress:
    """`update(n, **values)` as items finish (`values`: the latest metrics to show beside the
    count); `close()` at the end, or use it as a context manager.

    `unit` is singular ("step", "episode", "batch"); `initial` counts items done before this
    process (a resumed run); `interval_s` spaces the plain lines (0: one line per update).
    """

    def __init__(
        self,
        desc: str,
        total: int,
        unit: str,
        *,
        initial: int = 0,
        enabled: bool | None = None,
        interval_s: float = 10.0,
        stream: TextIO | None = None,
    ):
        if enabled is None:
            enabled = is_writer()
        self.desc, self.total, self.unit, self.n = desc, total, unit, initial
        self.interval_s = interval_s
        self.values: dict[str, Any] = {}
        self._stream = stream or sys.stderr
        self._enabled = enabled
        self._bar = None
        if enabled and _is_terminal(self._stream):
            self._bar = tqdm.tqdm(total=total, initial=initial, desc=desc, unit=unit,
                                  file=self._stream, dynamic_ncols=True)
        self._start = self._last_time = time.monotonic()
        self._last_n = initial
        if enabled and self._bar is None:  # the phase has begun: a log says what the job does now
            self._print(self._start)

    def update(self, n: int = 1, **values: Any) -> None:
        """`n` more items done; `values` replace the ones shown."""
        self.set(self.n + n, **values)

    def set(self, n: int, **values: Any) -> None:
        """`n` items done in all (a count that only grows: episodes finished so far)."""
        self.values.update(values)
        done, self.n = n - self.n, n
        if not self._enabled:
            return
        if self._bar is not None:
            if self.values:
                self._bar.set_postfix({k: _format_value(v) for k, v in self.values.items()}, refresh=False)
            self._bar.total = self.total
            self._bar.update(done)
            return
        now = time.monotonic()
        if now - self._last_time >= self.interval_s or self.n >= self.total:
            self._print(now)

    def add_total(self, extra: int) -> None:
        """`extra` more items to do than announced (retries)."""
        self.total += extra

    def _line(self, now: float) -> str:
        """The plain line for the current count: `<desc> <n>/<total> <unit> | <s>/<item> | <elapsed> | k=v ...`."""
        parts = [f"{self.desc} {self.n}/{self.total} {_plural(self.unit)}"]
        if self.n > self._last_n:  # the rate since the last line: recent, not averaged over the phase
            parts.append(f"{(now - self._last_time) / (self.n - self._last_n):.3g} s/{self.unit}")
        parts.append(f"{_format_duration(now - self._start)} elapsed")
        if self.values:
            parts.append(" ".join(f"{k}={_format_value(v)}" for k, v in self.values.items()))
        return " | ".join(parts)

    def _print(self, now: float) -> None:
        print(self._line(now), file=self._stream, flush=True)
        self._last_time, self._last_n = now, self.n

    def close(self) -> None:
        """Ends the bar; in a log, the last line unless it was written already."""
        if not self._enabled:
            return
        if self._bar is not None:
            self._bar.close()
        elif self._last_n != self.n:
            self._print(time.monotonic())
        self._enabled = False

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

