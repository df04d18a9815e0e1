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

import numpy as np

from agentgym_jax.envs.protocol import EpisodeStatus
from agentgym_jax.rollout import packing
from agentgym_jax.rollout.batch import PackedRows, TokenBatch, bucket, make_token_batch
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
    pairs: Sequence[PreferencePair], seq_len: int | None = None, rows: int | None = None
) -> tuple[TokenBatch, TokenBatch]:
    """(chosen, rejected) token batches `[rows, seq_len]`, row i of each from pair i.

    `seq_len` defaults to the bucket of the longest trajectory, `rows` to `len(pairs)` (more rows
    are empty padding). Padding holds token id 0, never the tokenizer's pad id: padded slots are
    neither attended nor scored, but their embeddings are still looked up, and a pad id outside
    the model's vocabulary (transformers adds `<|endoftext|>` at id `len(vocab)` to tokenizers
    without a pad token) embeds as NaN, which the attention's `0 * NaN` spreads to every row.
    """
    if not pairs:
        raise ValueError("no preference pairs (need tasks with both a success and a failure)")
    seq_len = seq_len or bucket(max(len(t.token_ids) for pair in pairs for t in pair))
    chosen = make_token_batch([p.chosen for p in pairs], seq_len, rows)
    rejected = make_token_batch([p.rejected for p in pairs], seq_len, rows)
    return chosen, rejected


def pair_layout(chosen: TokenBatch, rejected: TokenBatch, width: int | None = None) -> PackedRows:
    """Each pair's two rows (`pair_batches`) packed as one prefix tree: the prompt and the turns a
    success and a failure of one task share, computed once (`rollout/packing.py`)."""
    rows = interleaved(chosen, rejected)
    pairs = chosen.tokens.shape[0]
    return packing.pack(rows, [[2 * i, 2 * i + 1] for i in range(pairs)], 2, width=width).layout


def pair_width(pairs: Sequence[PreferencePair]) -> int:
    """The bucket of the longest pair packed as a prefix tree: one width for every batch of `pairs`."""
    chosen, rejected = pair_batches(pairs)
    rows = interleaved(chosen, rejected)
    packed, _ = packing.packed_lengths(rows, [[2 * i, 2 * i + 1] for i in range(len(pairs))])
    return bucket(max(packed))


def interleaved(chosen: TokenBatch, rejected: TokenBatch) -> TokenBatch:
    """Host rows chosen 0, rejected 0, chosen 1, ... (what `steps.pair_logprobs` scores with a layout)."""
    def weave(a, b):
        a, b = np.asarray(a), np.asarray(b)
        return np.stack([a, b], axis=1).reshape(-1, *a.shape[1:])

    return TokenBatch(*(weave(getattr(chosen, f), getattr(rejected, f)) for f in
                        ("tokens", "positions", "loss_mask", "old_logprobs", "token_rewards", "group_ids", "scores")))
