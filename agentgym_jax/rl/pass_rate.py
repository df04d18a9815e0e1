"""Steering RL toward groups that carry signal: a target pass rate per task.

A group of binary-reward samples teaches a group-relative estimator (GRPO, RLOO) most when about
half of it succeeds, and nothing when all or none do. Two controls aim each task's group at a
target pass rate (default 0.5), both pure functions of their inputs:

- `ReplayControl`: how many turns `k` of the task's oracle demonstration an episode replays before
  the policy plays on (a replayed-prefix curriculum, started near the goal like a reverse
  curriculum): a group that succeeded more than `target + band` gets one turn less (k moves toward
  0, the policy trained from the start), one that succeeded less than `target - band` one more.
- `sampling_weights` / `draw_tasks`: tasks drawn with weights that peak at the target pass rate,
  so tasks already solved and tasks still hopeless are drawn less.

`PassRate` folds each group's success into a task's running pass rate. The host state (which k,
which pass rate) lives with the trainer (`train/rl_signal.py`); nothing here holds any.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class ReplayControl:
    """Replayed oracle turns per task (or grade) steered toward a target group pass rate."""

    target: float = 0.5  # the group success k steers toward
    band: float = 0.25  # k moves once a group's success is beyond target +- band
    start: float = 1.0  # a new task's k: this fraction of its demonstration's turns before the last

    def __post_init__(self):
        if not 0 < self.target < 1:
            raise ValueError(f"target_pass_rate must lie in (0, 1), got {self.target!r}")
        if not 0 <= self.band <= min(self.target, 1 - self.target):
            raise ValueError(f"replay_band must lie in [0, min(target, 1 - target)] = [0, "
                             f"{min(self.target, 1 - self.target)}], got {self.band!r}")
        if not 0 <= self.start <= 1:
            raise ValueError(f"replay_start must lie in [0, 1] (a fraction of the demonstration), got {self.start!r}")

    def first(self, most: int) -> int:
        """k of a task first drawn, whose demonstration allows at most `most` replayed turns."""
        return math.floor(self.start * most)

    def next(self, k: int, pass_rate: float, most: int) -> int:
        """k after a group (or the groups of a grade) succeeded at `pass_rate` from k turns in."""
        if pass_rate > self.target + self.band:
            k -= 1
        elif pass_rate < self.target - self.band:
            k += 1
        return min(max(k, 0), most)


@dataclasses.dataclass(frozen=True)
class PassRate:
    """A task's running pass rate: the first group's success, then an exponential moving average
    that keeps `memory` of the old value at each new group."""

    memory: float = 0.5

    def __post_init__(self):
        if not 0 <= self.memory < 1:
            raise ValueError(f"pass_rate_memory must lie in [0, 1), got {self.memory!r}")

    def update(self, old: float | None, group: float) -> float:
        return group if old is None else self.memory * old + (1 - self.memory) * group


def sampling_weights(pass_rates: Sequence[float | None], target: float, floor: float) -> np.ndarray:
    """`[n]` weights: 1 at the target pass rate (and for a task never played), falling linearly to
    `floor` at the farther of 0 and 1."""
    if not 0 < floor <= 1:
        raise ValueError(f"sampling_floor must lie in (0, 1], got {floor!r}")
    known = np.array([p is not None for p in pass_rates], bool)
    rates = np.array([target if p is None else p for p in pass_rates], np.float64)
    closeness = 1 - np.abs(rates - target) / max(target, 1 - target)
    return np.where(known, floor + (1 - floor) * closeness, 1.0)


def draw_tasks(task_ids: Sequence[int], weights: np.ndarray, count: int, rng: np.random.Generator) -> list[int]:
    """`count` tasks drawn in proportion to `weights`, without repeats while the pool allows."""
    p = np.asarray(weights, np.float64)
    picks = rng.choice(len(task_ids), size=count, replace=count > len(task_ids), p=p / p.sum())
    return [int(task_ids[i]) for i in picks]
