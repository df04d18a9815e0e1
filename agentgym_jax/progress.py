"""How far a job's phase has got: a bar on a terminal, plain lines in a log.

Every long phase of a job (oracle demonstrations, SFT batches, evaluation episodes, an RL step's
rollout, RL steps) reports through one `Progress`. Where stderr is a terminal it draws a tqdm
bar; where stderr is a file or a pipe (a log, a batch system, a notebook) it writes plain lines
instead,

    eval before RL 16/64 episodes | 9.1 s/episode | 2:25 elapsed | ETA 1:40 | turns=412 tokens=20931

one as the phase starts, then one every `interval_s` seconds (also while nothing finishes: the
elapsed time and the latest values keep a log from looking dead), and its last one, so that a
log says where the job is without carriage-return clutter. The ETA comes from the share of the
phase's work done: the items' count, or `work` where the count lags it (the episodes of a
batch finish together; the turns they played say how far the batch is). Only process 0 of a
multi-process job shows anything; `enabled=False` shows nothing (library calls, tests).
`AGENTGYM_PROGRESS_INTERVAL_S` sets the default spacing of the lines (10 s).
"""

from __future__ import annotations

import os
import sys
import threading
import time
import weakref
from typing import Any, TextIO

import tqdm

from agentgym_jax.parallel.distributed import is_writer

TICK_S = 1.0  # how often a bar's clock and a log's heartbeat are looked at


def _interval_s() -> float:
    raw = os.environ.get("AGENTGYM_PROGRESS_INTERVAL_S", "10")
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise ValueError(f"AGENTGYM_PROGRESS_INTERVAL_S={raw!r} is not valid: want seconds >= 0 (0: a line per update)")
    return value


INTERVAL_S = _interval_s()  # the default spacing of a log's lines


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
    """`update(n, **values)` or `set(n, work=..., **values)` as items finish (`values`: the latest
    metrics to show beside the count); `close()` at the end, or use it as a context manager.

    `unit` is singular ("step", "episode", "batch"); `initial` counts items done before this
    process (a resumed run); `interval_s` spaces the plain lines (0: one line per update, and no
    heartbeat); `show_after_s` keeps a phase quiet until it has run that long (an RL step's
    rollout: only a long one shows).
    """

    def __init__(
        self,
        desc: str,
        total: int,
        unit: str,
        *,
        initial: int = 0,
        enabled: bool | None = None,
        interval_s: float | None = None,
        show_after_s: float = 0.0,
        stream: TextIO | None = None,
    ):
        if enabled is None:
            enabled = is_writer()
        self.desc, self.total, self.unit, self.n = desc, total, unit, initial
        self.interval_s = INTERVAL_S if interval_s is None else interval_s
        self.values: dict[str, Any] = {}
        self.work: float | None = None  # the share of the phase done, where the count lags it
        self._stream = stream or sys.stderr
        self._enabled = enabled
        self._terminal = _is_terminal(self._stream)
        self._bar: tqdm.tqdm | None = None
        self._lock = threading.Lock()  # the heartbeat thread and the caller both write
        self._start = self._last_time = time.monotonic()
        self._initial = self._last_n = initial
        # The rate a line shows: from when the count last shown was reached to when the count is
        # (heartbeat lines in between write the same count, and move neither).
        self._rate_time = self._changed_time = self._start
        self._rate_n = initial
        self._show_at = self._start + show_after_s
        self._shown = False
        self._stop = threading.Event()
        if not enabled:
            return
        if show_after_s <= 0:
            self._show(self._start)
        if self._terminal or self.interval_s > 0 or show_after_s > 0:
            threading.Thread(target=_heartbeat, args=(weakref.ref(self), self._stop), name=f"progress {desc}",
                             daemon=True).start()

    def update(self, n: int = 1, **values: Any) -> None:
        """`n` more items done; `values` replace the ones shown."""
        self.set(self.n + n, **values)

    def set(self, n: int, *, work: float | None = None, **values: Any) -> None:
        """`n` items done in all (a count that only grows: episodes finished so far); `work`, the
        share of the phase done (0..1) where the count lags it, for the ETA."""
        with self._lock:
            self.values.update(values)
            done, self.n = n - self.n, n
            self.work = work
            if not self._enabled:
                return
            now = time.monotonic()
            if done:
                self._changed_time = now
            if not self._shown:
                if now < self._show_at:
                    return
                self._show(now)
            if self._bar is not None:
                self._bar.set_postfix(self._postfix(now), refresh=False)
                self._bar.total = self.total
                self._bar.update(done)
            elif now - self._last_time >= self.interval_s or (self.n >= self.total and self.n != self._last_n):
                self._print(now)

    def add_total(self, extra: int) -> None:
        """`extra` more items to do than announced (retries)."""
        self.total += extra

    def eta_s(self, now: float) -> float | None:
        """Seconds left, from the share of the work done so far (None before any is done)."""
        if self.work is not None:
            share = self.work
        else:
            share = (self.n - self._initial) / max(self.total - self._initial, 1)
        if share <= 0 or share >= 1:
            return None
        return (now - self._start) * (1 - share) / share

    def _postfix(self, now: float) -> dict[str, str]:
        shown = {k: _format_value(v) for k, v in self.values.items()}
        eta = self.eta_s(now) if self.work is not None else None  # (tqdm shows its own from the count)
        return {"ETA": _format_duration(eta), **shown} if eta is not None else shown

    def _line(self, now: float) -> str:
        """The plain line for the current count:
        `<desc> <n>/<total> <unit> | <s>/<item> | <elapsed> | ETA <left> | k=v ...`."""
        parts = [f"{self.desc} {self.n}/{self.total} {_plural(self.unit)}"]
        if self.n > self._rate_n and self._changed_time > self._rate_time:  # recent, not averaged over the phase
            parts.append(f"{(self._changed_time - self._rate_time) / (self.n - self._rate_n):.3g} s/{self.unit}")
        parts.append(f"{_format_duration(now - self._start)} elapsed")
        eta = self.eta_s(now)
        if eta is not None:
            parts.append(f"ETA {_format_duration(eta)}")
        if self.values:
            parts.append(" ".join(f"{k}={_format_value(v)}" for k, v in self.values.items()))
        return " | ".join(parts)

    def _show(self, now: float) -> None:
        """The phase becomes visible: its bar, or its first line."""
        self._shown = True
        if self._terminal:
            self._bar = tqdm.tqdm(total=self.total, initial=self.n, desc=self.desc, unit=self.unit, file=self._stream,
                                  dynamic_ncols=True, leave=self._show_at <= self._start)
            self._bar.start_t -= now - self._start  # (it ran before it showed)
            self._last_n = self.n
        else:
            self._print(now)

    def _print(self, now: float) -> None:
        print(self._line(now), file=self._stream, flush=True)
        self._last_time, self._last_n = now, self.n
        if self.n > self._rate_n:
            self._rate_time, self._rate_n = self._changed_time, self.n

    def _tick(self) -> bool:
        """(the heartbeat) Shows a phase that reached `show_after_s`, keeps a bar's clock and ETA
        moving, and in a log writes a line after `interval_s` without one; False once closed."""
        with self._lock:
            if not self._enabled:
                return False
            now = time.monotonic()
            if not self._shown:
                if now >= self._show_at:
                    self._show(now)
            elif self._bar is not None:
                self._bar.set_postfix(self._postfix(now), refresh=False)
                self._bar.refresh()
            elif 0 < self.interval_s <= now - self._last_time:
                self._print(now)
            return True

    def close(self) -> None:
        """Ends the bar; in a log, the last line unless it was written already (nothing for a
        phase that never showed)."""
        self._stop.set()
        with self._lock:
            if not self._enabled:
                return
            if self._bar is not None:
                self._bar.close()
            elif self._shown and self._last_n != self.n:
                self._print(time.monotonic())
            self._enabled = False

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _heartbeat(progress: weakref.ref[Progress], stop: threading.Event) -> None:
    """A phase's heartbeat thread: ends when the phase is closed, or dropped unclosed."""
    while not stop.wait(TICK_S):
        shown = progress()
        if shown is None or not shown._tick():
            return
        del shown
