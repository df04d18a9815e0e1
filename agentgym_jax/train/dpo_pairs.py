"""Preference pairs for DPO from collected trajectories: a success and a failure of the same task.

Chosen: status `success` (the environment's verifier decided it). Rejected: any other scored
status (failure, max turns, token budget, invalid-action limit). Environment timeouts and
infrastructure errors say nothing about the policy and are never paired, nor are trajectories
without a policy token. Within a task, successes and failures are each ordered by
(sample_idx, attempt, group_id, policy_version) and paired in that order, each trajectory used at
most once: min(#successes, #failures) pairs per task, the same pairs for any input order.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from agentgym_jax.envs.protocol import EpisodeStatus
from agentgym_jax.rollout.batch import TokenBatch, bucket, make_token_batch
from agentgym_jax.rollout.trajectory import Trajectory


class PreferencePair(NamedTuple):
    chosen: Trajectory
    rejected: Trajectory


def _order(t: Trajectory) -> tuple[int, int, int, int]:
    return (t.sample_idx, t.attempt, t.group_id, t.policy_version)


def build_pairs(trajectories: Iterable[Trajectory]) -> list[PreferencePair]:
    """Pairs, sorted by (env, task_id), from tasks that have both a success and a failure."""
    groups: dict[tuple[str, int], list[Trajectory]] = collections.defaultdict(list)
    for t in trajectories:
        if t.status.is_scored and any(t.loss_mask):
            groups[(t.env, t.task_id)].append(t)
    pairs = []
    for key in sorted(groups):
        ordered = sorted(groups[key], key=_order)
        chosen = [t for t in ordered if t.status == EpisodeStatus.SUCCESS]
        rejected = [t for t in ordered if t.status != EpisodeStatus.SUCCESS]
        pairs.extend(PreferencePair(c, r) for c, r in zip(chosen, rejected))
    return pairs


def pair_batches(
    pairs: Sequence[PreferencePair], batch_size: int | None = None, pad_id: int = 0
) -> tuple[TokenBatch, TokenBatch]:
    """(chosen, rejected) token batches, row i of each from pair i, padded to one bucketed length."""
    if not pairs:
        raise ValueError("no preference pairs (need tasks with both a success and a failure)")
    longest = max(len(t.token_ids) for pair in pairs for t in pair)
    seq_len = bucket(longest)
    chosen = make_token_batch([p.chosen for p in pairs], seq_len, batch_size, pad_id)
    rejected = make_token_batch([p.rejected for p in pairs], seq_len, batch_size, pad_id)
    return chosen, rejected
