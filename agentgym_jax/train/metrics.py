"""Per-step metrics to three places: the console (a bar, or a line per step in a log), a JSONL
file and TensorBoard events.

The JSONL file is the record of truth (append-only, one line per step, fsynced), so a killed run
keeps every metric it logged; TensorBoard is for looking at curves. A resumed run
(`start_step` > 0) first cuts both back to `start_step`: the steps logged after the restored
checkpoint are replayed, and must not appear twice (metrics.jsonl is rewritten without them,
TensorBoard's new events file purges them with `purge_step`).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from typing import Any

import numpy as np
from tensorboardX import SummaryWriter

from agentgym_jax.progress import Progress

# What the console shows beside the step count (those a step's metrics have), in this order.
CONSOLE_KEYS = ("success_rate", "horizon", "loss", "nll", "kl", "mean_reward", "accuracy")
# The RL step's wall-time measures: they differ between runs that are otherwise the same.
TIMING_KEYS = frozenset({"rollout_s", "update_s", "step_s", "tokens_per_s", "sampler_idle_fraction",
                         "sampler_wait_fraction", "trainer_idle_fraction", "compile_s", "compiled_programs"})


def to_scalars(metrics: Mapping[str, Any]) -> dict[str, float]:
    """Flattens nested dicts (`status/success`) and converts arrays to Python floats."""
    flat: dict[str, float] = {}
    for key, value in metrics.items():
        if isinstance(value, Mapping):
            flat.update({f"{key}/{k}": v for k, v in to_scalars(value).items()})
        else:
            flat[key] = float(np.asarray(value))
    return flat


class MetricsLogger:
    """`log(step, metrics)` once per step; `close()` at the end. With `write=False` (every
    process but the first of a multi-process job) it only returns the scalars.

    The console shows one line (a bar on a terminal) per step with `desc`, the step's seconds
    and the `CONSOLE_KEYS` it has (`agentgym_jax/progress.py`). The TensorBoard events file
    opens with the first step logged: a resumed run with no step left to take adds none.
    """

    def __init__(self, logdir: str, total_steps: int, start_step: int = 0, console: bool = True, write: bool = True,
                 desc: str = "train"):
        self.jsonl_path = os.path.join(logdir, "metrics.jsonl")
        self._logdir, self._start_step = logdir, start_step
        self._write = write
        if not write:
            return
        os.makedirs(logdir, exist_ok=True)
        if start_step > 0:
            truncate_metrics(self.jsonl_path, start_step)
        self._jsonl = open(self.jsonl_path, "a", encoding="utf-8")
        self._tb: SummaryWriter | None = None
        self._progress = Progress(desc, total_steps, "step", initial=start_step, enabled=console, interval_s=0)

    def _tensorboard(self) -> SummaryWriter:
        if self._tb is None:  # files are named by the second they open in: the suffix keeps a resume's apart
            self._tb = SummaryWriter(
                os.path.join(self._logdir, "tensorboard"), purge_step=self._start_step + 1 if self._start_step else None,
                filename_suffix=f".{os.getpid()}.{self._start_step}",
            )
        return self._tb

    def log(self, step: int, metrics: Mapping[str, Any]) -> dict[str, float]:
        scalars = to_scalars(metrics)
        if not self._write:
            return scalars
        self._jsonl.write(json.dumps({"step": step, **scalars}) + "\n")
        self._jsonl.flush()
        os.fsync(self._jsonl.fileno())
        tb = self._tensorboard()
        for key, value in scalars.items():
            if math.isfinite(value):
                tb.add_scalar(key, value, step)
        tb.flush()
        self._progress.set(step, **{k: scalars[k] for k in CONSOLE_KEYS if k in scalars})
        return scalars

    def close(self) -> None:
        if not self._write:
            return
        self._progress.close()
        if self._tb is not None:
            self._tb.close()
        self._jsonl.close()


def truncate_metrics(path: str, last_step: int) -> None:
    """Rewrites `path` keeping only the records of steps <= `last_step` (atomically: a kill
    leaves the old file or the new one)."""
    if not os.path.exists(path):
        return
    kept = [r for r in read_metrics(path) if r["step"] <= last_step]
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in kept)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_metrics(path: str) -> list[dict[str, float]]:
    """All records of a metrics.jsonl, in order (a torn last line from a kill is skipped)."""
    records = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                break
    return records
