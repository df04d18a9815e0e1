"""Trajectories -> the RL step's `TokenBatch`: which episodes train, and with what reward.

Host-side (NumPy) choices made once per step, before the jitted `prepare`:
- unscored episodes (`env_timeout`, `infra_error`: the infrastructure, not the policy, ended
  them; no verifier result) never train: their rows get `loss_mask = 0`, so they are also out of
  the group statistics (GRPO / RLOO baselines over the scored members) and of every whitening;
- with a group baseline (GRPO, Dr. GRPO, RLOO), a group left with fewer than 2 trained members
  carries no relative signal: its rows are masked too;
- overlong handling (DAPO) for episodes cut by the token budget: "mask" leaves them out,
  "penalty" adds the soft overlong punishment to every episode's return by its response length;
- a turn penalty: each policy turn costs `turn_penalty` of the episode's return (success is the
  verifier's, untouched), so of two episodes that reach the same outcome the shorter ranks higher:
  a wasted turn (an invalid action, a move into a wall) costs even in a successful episode, where
  an outcome reward alone reinforces it with the rest (MiniGrid's `1 - 0.9 t / T` success reward
  prices time the same way);
- dynamic sampling (DAPO): groups whose trained members all have the same return (zero
  advantage under a group baseline) are left out; the step reports how many groups it lost
  (`dynamic_sampling/shortfall`). With `max_extra_groups` the RL step first plays up to that
  many more groups to replace them (`train/rl_signal.py`, which asks `signal_groups` which
  groups carry signal); the batch keeps its number of groups either way, so its shape (and the
  compiled step) stays the same.
Masked rows stay in the batch (their tokens, padding-like), so shapes never depend on the data.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence

import numpy as np

from agentgym_jax.envs.protocol import EpisodeStatus
from agentgym_jax.rollout.batch import TokenBatch, make_token_batch
from agentgym_jax.rollout.trajectory import Trajectory

OVERLONG_MODES = ("off", "mask", "penalty")


@dataclasses.dataclass(frozen=True)
class BatchFilter:
    """Which episodes of a rollout train, and how overlong ones are treated (config `algo.*`)."""

    grouped: bool = True  # the estimator uses a group baseline (GRPO, Dr. GRPO, RLOO)
    dynamic_sampling: bool = False  # drop groups whose trained returns are all equal
    max_extra_groups: int = 0  # with dynamic_sampling: the most groups a step plays beyond its batch to replace them
    overlong: str = "off"  # one of OVERLONG_MODES
    max_response_length: int = 4096  # the rollout's token budget (policy + environment tokens)
    overlong_buffer: int = 0  # DAPO's L_cache: the penalty ramps over the budget's last tokens
    overlong_penalty: float = 1.0  # the penalty at (and beyond) the budget
    turn_penalty: float = 0.0  # subtracted from an episode's return per policy turn

    def __post_init__(self):
        if self.overlong not in OVERLONG_MODES:
            raise ValueError(f"overlong={self.overlong!r} is not one of {', '.join(OVERLONG_MODES)}")
        if self.overlong == "penalty" and not 0 < self.overlong_buffer <= self.max_response_length:
            raise ValueError(
                f"overlong='penalty' needs 0 < overlong_buffer <= max_response_length "
                f"({self.max_response_length}), got {self.overlong_buffer}"
            )
        if self.overlong_penalty < 0:
            raise ValueError(f"overlong_penalty must be >= 0, got {self.overlong_penalty}")
        if self.turn_penalty < 0:
            raise ValueError(f"turn_penalty must be >= 0 (a cost per policy turn), got {self.turn_penalty}")
        if not isinstance(self.max_extra_groups, int) or self.max_extra_groups < 0:
            raise ValueError(f"max_extra_groups must be an integer >= 0, got {self.max_extra_groups!r}")
        if self.max_extra_groups and not self.dynamic_sampling:
            raise ValueError("max_extra_groups replaces the groups dynamic sampling leaves out: set dynamic_sampling=True")


def response_length(t: Trajectory) -> int:
    """Policy and environment tokens after the prompt (what the token budget bounds)."""
    return len(t.token_ids) - t.turn_spans[0][0] if t.turn_spans else 0


def overlong_penalty(lengths: np.ndarray, max_length: int, buffer: int, penalty: float) -> np.ndarray:
    """DAPO's soft overlong punishment, `[n] -> [n]`: 0 up to `max_length - buffer`, then falling
    linearly to `-penalty` at `max_length`, and `-penalty` beyond."""
    lengths = np.asarray(lengths, np.float64)
    over = np.clip((lengths - (max_length - buffer)) / buffer, 0.0, 1.0)
    return -penalty * over


@dataclasses.dataclass(frozen=True)
class _Groups:
    """What `rules` make of a rollout's episodes before any group is dropped."""

    trajectories: list[Trajectory]  # with the overlong and turn penalties in their reward, where they apply
    trained: np.ndarray  # [n] bool: scored, and not masked as overlong
    truncated: np.ndarray  # [n] bool: cut by the token budget
    members: dict[int, list[int]]  # group id -> its trained rows
    small: list[int]  # groups with fewer than 2 trained members under a group baseline
    uniform: list[int]  # the other groups whose trained members all have the same return


def _groups(trajectories: Sequence[Trajectory], rules: BatchFilter) -> _Groups:
    trained = np.array([t.status.is_scored for t in trajectories], bool)
    truncated = np.array([t.status == EpisodeStatus.TOKEN_BUDGET for t in trajectories], bool)
    if rules.overlong == "mask":
        trained &= ~truncated
    if rules.overlong == "penalty":
        lengths = np.array([response_length(t) for t in trajectories])
        penalties = overlong_penalty(lengths, rules.max_response_length, rules.overlong_buffer, rules.overlong_penalty)
        trajectories = [dataclasses.replace(t, reward=t.reward + float(p)) for t, p in zip(trajectories, penalties)]
    if rules.turn_penalty:
        trajectories = [dataclasses.replace(t, reward=t.reward - rules.turn_penalty * t.num_turns) for t in trajectories]
    returns = np.array([t.reward for t in trajectories], np.float64)
    members: dict[int, list[int]] = collections.defaultdict(list)
    for row, t in enumerate(trajectories):
        if trained[row]:
            members[t.group_id].append(row)
    small = [g for g, rows in members.items() if rules.grouped and len(rows) < 2]
    uniform = [g for g, rows in members.items() if g not in small and np.ptp(returns[rows]) == 0]
    return _Groups(list(trajectories), trained, truncated, dict(members), small, uniform)


def signal_groups(trajectories: Sequence[Trajectory], rules: BatchFilter) -> set[int]:
    """The ids of the groups whose trained members' returns differ: those dynamic sampling keeps."""
    groups = _groups(trajectories, rules)
    return set(groups.members) - set(groups.small) - set(groups.uniform)


def training_batch(
    trajectories: Sequence[Trajectory], rules: BatchFilter, *, seq_len: int, batch_size: int, anchor_states: bool = False
) -> tuple[TokenBatch, dict[str, float]]:
    """The padded batch of `trajectories` with untrained rows masked, and what was left out
    (`anchor_states`: with GiGPO's `step_groups`)."""
    groups = _groups(trajectories, rules)
    trajectories, trained, members, uniform = groups.trajectories, groups.trained.copy(), groups.members, groups.uniform
    unscored = sum(not t.status.is_scored for t in trajectories)
    num_groups = len({t.group_id for t in trajectories})
    dropped = groups.small + (uniform if rules.dynamic_sampling else [])
    for g in dropped:
        trained[members[g]] = False

    batch = make_token_batch(trajectories, seq_len=seq_len, batch_size=batch_size, anchor_states=anchor_states)
    rows = np.zeros((batch_size,), bool)
    rows[: len(trajectories)] = trained
    batch = batch.replace(loss_mask=np.where(rows[:, None], batch.loss_mask, 0.0).astype(np.float32))
    kept = len(members) - len(dropped)  # groups with a trained row
    metrics = {
        "unscored_episodes": float(unscored),
        "overlong_episodes": float(groups.truncated.sum()),
        "trained_episodes": float(trained.sum()),
        "groups_trained": float(kept),
        "groups_uniform": float(len(uniform)),
        # groups of the step that do not train (uniform, unscored or too small), after any extra groups replaced some
        "dynamic_sampling/shortfall": float(num_groups - kept) if rules.dynamic_sampling else 0.0,
    }
    return batch, metrics
