"""Trajectories -> the padded token-level arrays the update step consumes.

Arrays are aligned with tokens: entry t describes token t. Each turn's reward (the environment's
reward for the action of that turn) sits on the turn's last policy token, so the outcome reward
of a sparse-reward episode sits on its last policy token (never on an environment token, where
masked estimators would lose it); whatever of `reward` the turn rewards do not account for (a
record with an outcome only, a shaping penalty) is added on the last policy token, so a row's
policy-token rewards always sum to `scores`, the episode return. Shapes are padded to buckets so
the jitted update compiles once per bucket.
"""

from __future__ import annotations

from collections.abc import Sequence

import flax.struct
import jax
import numpy as np

from agentgym_jax.rollout.trajectory import Trajectory, expert_array


@flax.struct.dataclass
class PackedRows:
    """The rows of `units` units, `rows` rows each, packed as prefix trees of `width` tokens.

    Built by `rollout/packing.pack`, which lays out each unit's rows as one prefix tree; row r
    of unit u is row `u * rows + r` of the batch it belongs to."""

    tokens: jax.Array  # [units, width] int32; 0 on padding
    positions: jax.Array  # [units, width] int32: the token's depth (its index in its rows); -1 on padding
    ends: jax.Array  # [units, width] int32: the index past the token's subtree; 0 on padding (seen by nothing)
    sources: jax.Array  # [units, rows, seq] int32: where the hidden state predicting row token t sits; -1: none
    origins: jax.Array  # [units, rows, seq] int32: where row token t itself sits (its routing); -1: padding.
    # `sources` are these shifted by one: token t is predicted where token t - 1 sits.

    @property
    def rows_per_unit(self) -> int:
        return self.sources.shape[1]

    @property
    def width(self) -> int:
        return self.tokens.shape[1]


@flax.struct.dataclass
class TokenBatch:
    tokens: jax.Array  # [batch, seq] int32
    positions: jax.Array  # [batch, seq] int32; -1 on padding
    loss_mask: jax.Array  # [batch, seq] float32; 1 on policy-sampled tokens
    old_logprobs: jax.Array  # [batch, seq] float32; sampler log-probs on policy tokens
    token_rewards: jax.Array  # [batch, seq] float32; each turn's reward on its last policy token
    group_ids: jax.Array  # [batch] int32; rows of padding get their own unused group
    scores: jax.Array  # [batch] float32; the episode return (sum of turn rewards) per row
    layout: PackedRows | None = None  # the rows packed as prefix trees (`rollout/packing.py`); None: plain rows
    # A mixture of experts' routing as the sampler recorded it (`Trajectory.experts`): [batch, seq,
    # layers, k] int16, -1 where none (off the loss mask); None: not recorded.
    experts: jax.Array | None = None
    # GiGPO's anchor states: [batch, seq] int32, on each policy token the id of the state its turn
    # started from (`step_groups`), -1 elsewhere; None: not built (no estimator reads it).
    step_groups: jax.Array | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return self.tokens.shape


def bucket(n: int, minimum: int = 16) -> int:
    """The smallest length >= max(n, minimum) of the form 2^k or 3 * 2^(k-1) (16, 24, 32, 48, ...).

    Few distinct shapes, so few compilations, and at most a third of a row is padding: attention
    cost grows with the square of the length, so padding 300 tokens to 384 rather than 512 saves
    almost half of it.
    """
    n = max(int(n), minimum)
    power = 1 << max(0, n - 1).bit_length()  # smallest power of two >= n
    return power * 3 // 4 if power >= 4 and power * 3 // 4 >= n else power


def length_grouped_batches(lengths: Sequence[int], batch_size: int, rng: np.random.Generator, window: int) -> list[np.ndarray]:
    """One epoch's batches (row indices): shuffled, then sorted by length within each run of `window`
    batches, in shuffled batch order, so a batch pads to its own longest row instead of the data's.

    Rows of similar length share a batch (with a median demonstration of 600 tokens and a longest of
    1400, padding every batch to the longest computes more than twice the real tokens); the
    window keeps batches random across the data. `window=1`: plain shuffled batches.
    """
    if batch_size < 1 or window < 1:
        raise ValueError(f"batch_size and window must be >= 1, got {batch_size} and {window}")
    lengths = np.asarray(lengths)
    order = rng.permutation(len(lengths))
    span = batch_size * window
    batches = []
    for start in range(0, len(order), span):
        chunk = order[start : start + span]
        chunk = chunk[np.argsort(lengths[chunk], kind="stable")]
        batches += [chunk[i : i + batch_size] for i in range(0, len(chunk), batch_size)]
    return [batches[i] for i in rng.permutation(len(batches))]


def make_token_batch(
    trajectories: Sequence[Trajectory],
    seq_len: int | None = None,
    batch_size: int | None = None,
    pad_id: int = 0,
    anchor_states: bool = False,
) -> TokenBatch:
    """Right-pads trajectories to `[batch_size, seq_len]` (buckets by default).

    Padding rows have an all-zero mask and a group id of their own, so they contribute nothing.
    Group ids are renumbered densely (0..num_groups-1) in order of first appearance. Where a
    trajectory recorded its experts, `experts` holds every row's (-1 where a row has none).
    `anchor_states`: `step_groups` built too (`step_groups`).
    """
    longest = max((len(t.token_ids) for t in trajectories), default=1)
    seq_len = seq_len or bucket(longest)
    batch_size = batch_size or len(trajectories)
    if longest > seq_len:
        raise ValueError(f"a trajectory has {longest} tokens, more than seq_len={seq_len}")
    if len(trajectories) > batch_size:
        raise ValueError(f"{len(trajectories)} trajectories do not fit batch_size={batch_size}")

    tokens = np.full((batch_size, seq_len), pad_id, np.int32)
    positions = np.full((batch_size, seq_len), -1, np.int32)
    loss_mask = np.zeros((batch_size, seq_len), np.float32)
    old_logprobs = np.zeros((batch_size, seq_len), np.float32)
    token_rewards = np.zeros((batch_size, seq_len), np.float32)
    scores = np.zeros((batch_size,), np.float32)
    dense: dict[int, int] = {}
    group_ids = np.zeros((batch_size,), np.int32)
    for row, t in enumerate(trajectories):
        n = len(t.token_ids)
        tokens[row, :n] = t.token_ids
        positions[row, :n] = np.arange(n)
        loss_mask[row, :n] = t.loss_mask
        old_logprobs[row, :n] = t.logprobs
        placed = 0.0
        for (_, end), reward in zip(t.turn_spans, t.turn_rewards):  # a last turn never stepped has none
            token_rewards[row, end - 1] += reward
            placed += reward
        if t.last_policy_index >= 0:  # the rest (outcome-only records, shaping) on the last policy token
            token_rewards[row, t.last_policy_index] += t.reward - placed
        scores[row] = t.reward
        group_ids[row] = dense.setdefault(t.group_id, len(dense))
    for row in range(len(trajectories), batch_size):
        group_ids[row] = len(dense) + row - len(trajectories)
    return TokenBatch(
        tokens=tokens,
        positions=positions,
        loss_mask=loss_mask,
        old_logprobs=old_logprobs,
        token_rewards=token_rewards,
        group_ids=group_ids,
        scores=scores,
        experts=_expert_rows(trajectories, batch_size, seq_len),
        step_groups=step_groups(trajectories, batch_size, seq_len) if anchor_states else None,
    )


def step_groups(trajectories: Sequence[Trajectory], batch_size: int, seq_len: int) -> np.ndarray:
    """[batch_size, seq_len] int32: on the policy tokens of each turn, the id of its anchor state,
    -1 elsewhere. Turns of one group share an id where the ids before them since the previous
    turn (the observation and its template; the prompt before a first turn) are identical: the
    same state seen again, in another episode or after a no-op in the same one. Ids are dense
    from 0 (fewer than the policy tokens, as `advantages.gigpo`'s segment sums assume)."""
    ids = np.full((batch_size, seq_len), -1, np.int32)
    dense: dict[tuple[int, bytes], int] = {}
    for row, t in enumerate(trajectories):
        tokens, mask = np.asarray(t.token_ids, np.int32), np.asarray(t.loss_mask, bool)
        previous_end = 0
        for start, end in t.turn_spans:
            state = dense.setdefault((t.group_id, tokens[previous_end:start].tobytes()), len(dense))
            ids[row, start:end] = np.where(mask[start:end], state, -1)
            previous_end = end
    return ids


def _expert_rows(trajectories: Sequence[Trajectory], batch_size: int, seq_len: int) -> np.ndarray | None:
    """[batch_size, seq_len, layers, k] int16 the trajectories' recorded experts (-1 where none),
    or None where no trajectory recorded any."""
    recorded = {row: [i for i, e in enumerate(t.experts) if e] for row, t in enumerate(trajectories)}
    recorded = {row: policy for row, policy in recorded.items() if policy}
    if not recorded:
        return None
    rows = {row: expert_array([trajectories[row].experts[i] for i in policy]) for row, policy in recorded.items()}
    shape = next(iter(rows.values())).shape[1:]
    if any(a.shape[1:] != shape for a in rows.values()):
        raise ValueError(f"trajectories record experts of different shapes: {sorted({a.shape[1:] for a in rows.values()})}")
    experts = np.full((batch_size, seq_len, *shape), -1, np.int16)
    for row, a in rows.items():
        experts[row, recorded[row]] = a
    return experts
