"""Rows that share a prefix, computed once: a batch's rows packed as prefix trees.

The six samples of a GRPO group share their prompt (in the TextCraft recipe ~430 of ~560
tokens), often more (a replayed prefix, a first thought they agree on). `pack` lays the rows of
each *unit* (a group, or any rows the caller puts together) into one row of the update as a
prefix tree: every run of tokens the unit's rows have in common appears once, followed by the
subtrees that branch off after it, depth first. A token attends to its own path from the root
(`decoder.flash_attention`'s `k_ends`: key j is visible to query i where j <= i < ends[j]), its
RoPE position is its depth (its index in its own row), so every hidden state equals the one the
plain row computes, and the gradient of every row's loss flows into the one shared computation.

`PackedRows` is what the trainer needs besides the rows themselves: the packed tokens, their
depths and subtree ends, and for each row token the packed index whose hidden state predicts it
(`sources`: the packed index of the token before it), so log-probs are taken where the rows'
losses read them (`train/scoring.py`), and each row token's own packed index (`origins`: where
its routing through a mixture of experts is read). Packing is host-side NumPy, once per batch, exact by
construction: a unit with nothing in common packs its rows one after another (packing without
sharing, which still drops the padding between them).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from agentgym_jax.rollout.batch import PackedRows, TokenBatch, bucket


def prefix_tree(rows: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[np.ndarray]]:
    """The prefix tree of `rows` (token id arrays) laid out depth first.

    Returns (tokens, positions, ends) [n] and, per row, `origin` [len(row)]: the packed index of
    each of its tokens. A run shared by several rows is laid out once, then the subtrees that
    branch off after it, in the order their rows come, so rows with nothing in common are laid
    out one after another. Recursion depth is bounded by the number of rows (every branch point
    splits the rows below it).
    """
    tokens: list[int] = []
    positions: list[int] = []
    ends: list[int] = []
    origins = [np.full(len(row), -1, np.int64) for row in rows]

    def lay(members: list[int], depth: int) -> None:  # rows that agree up to and at `depth`
        shortest = min(len(rows[i]) for i in members)
        block = np.stack([rows[i][depth:shortest] for i in members])
        differs = np.any(block != block[0], axis=0)
        common = depth + (int(np.argmax(differs)) if differs.any() else shortest - depth)
        start = len(tokens)
        tokens.extend(rows[members[0]][depth:common].tolist())
        positions.extend(range(depth, common))
        ends.extend([0] * (common - depth))
        for i in members:
            origins[i][depth:common] = np.arange(start, start + common - depth)
        for child in _branches(rows, members, common):
            lay(child, common)
        ends[start : start + common - depth] = [len(tokens)] * (common - depth)  # the run's whole subtree

    for tree in _branches(rows, list(range(len(rows))), 0):
        lay(tree, 0)
    return np.asarray(tokens, np.int64), np.asarray(positions, np.int64), np.asarray(ends, np.int64), origins


def _branches(rows: Sequence[np.ndarray], members: list[int], depth: int) -> list[list[int]]:
    """`members` longer than `depth`, grouped by their token at `depth` (first appearance first)."""
    children: dict[int, list[int]] = {}
    for i in members:
        if len(rows[i]) > depth:
            children.setdefault(int(rows[i][depth]), []).append(i)
    return list(children.values())


def units_of(group_ids: np.ndarray, rows_per_unit: int, trained: np.ndarray) -> list[list[int]]:
    """Batch rows grouped into units of at most `rows_per_unit`: the trained rows of each group
    together, whole groups sharing a unit while they fit (each its own tree in the packed row: no
    padding between them), a group larger than a unit cut into several; groups in order of
    first appearance. Rows that train nothing (padding, masked groups) are left out: they need
    no computation, and the units they would have filled are not run."""
    by_group: dict[int, list[int]] = {}
    for row in np.flatnonzero(trained):
        by_group.setdefault(int(group_ids[row]), []).append(int(row))
    units: list[list[int]] = []
    for rows in by_group.values():
        for i in range(0, len(rows), rows_per_unit):
            part = rows[i : i + rows_per_unit]
            if units and len(units[-1]) + len(part) <= rows_per_unit:
                units[-1] += part
            else:
                units.append(part)
    return units


def group_units(batch: TokenBatch, rows_per_unit: int) -> list[list[int]]:
    """`units_of` the batch's groups and trained rows (a row with a loss token)."""
    return units_of(np.asarray(batch.group_ids), rows_per_unit, np.any(np.asarray(batch.loss_mask) > 0, axis=1))


def packed_lengths(batch: TokenBatch, units: Sequence[Sequence[int]]) -> tuple[list[int], list[int]]:
    """Per unit, the tokens it takes packed as one prefix tree and the tokens of its rows."""
    rows = [_rows(batch, unit) for unit in units]
    return [len(prefix_tree(r)[0]) for r in rows], [sum(len(x) for x in r) for r in rows]


def pack(batch: TokenBatch, units: Sequence[Sequence[int]], rows_per_unit: int, *, num_units: int | None = None,
         width: int | None = None) -> TokenBatch:
    """`batch` (host arrays) with its rows reordered into `units` and their `PackedRows` layout.

    Unit u's rows become rows `u * rows_per_unit ..` of the result, empty rows (no tokens, no
    loss, a group of their own) filling units that have fewer and the units after `len(units)`
    up to `num_units`; rows of `batch` in no unit are dropped (they must train nothing). The
    packed width is `width` (default: the bucket of the longest unit); `seq` stays the batch's.
    """
    if any(len(unit) > rows_per_unit for unit in units):
        raise ValueError(f"a unit has more than rows_per_unit={rows_per_unit} rows")
    num_units = num_units or len(units)
    if len(units) > num_units:
        raise ValueError(f"{len(units)} units do not fit num_units={num_units}")
    seq = batch.tokens.shape[1]
    trees = [prefix_tree(_rows(batch, unit)) for unit in units]
    longest = max((len(tree[0]) for tree in trees), default=1)
    width = width or bucket(longest)
    if longest > width:
        raise ValueError(f"a unit packs to {longest} tokens, more than width={width}")

    tokens = np.zeros((num_units, width), np.int32)
    positions = np.full((num_units, width), -1, np.int32)
    ends = np.zeros((num_units, width), np.int32)
    sources = np.full((num_units, rows_per_unit, seq), -1, np.int32)
    origins = np.full((num_units, rows_per_unit, seq), -1, np.int32)
    order = np.full(num_units * rows_per_unit, -1, np.int64)  # batch row of each result row; -1: empty
    for u, (unit, (tree_tokens, tree_positions, tree_ends, tree_origins)) in enumerate(zip(units, trees)):
        n = len(tree_tokens)
        tokens[u, :n], positions[u, :n], ends[u, :n] = tree_tokens, tree_positions, tree_ends
        for r, (row, origin) in enumerate(zip(unit, tree_origins)):
            order[u * rows_per_unit + r] = row
            origins[u, r, : len(origin)] = origin
            sources[u, r, 1 : len(origin)] = origin[:-1]  # token t is predicted at token t - 1
    layout = PackedRows(tokens=tokens, positions=positions, ends=ends, sources=sources, origins=origins)
    return _reordered(batch, order).replace(layout=layout)


def _rows(batch: TokenBatch, unit: Sequence[int]) -> list[np.ndarray]:
    """The real tokens of each row of `unit`."""
    return [np.asarray(batch.tokens[row])[np.asarray(batch.positions[row]) >= 0] for row in unit]


def _reordered(batch: TokenBatch, order: np.ndarray) -> TokenBatch:
    """`batch`'s rows in `order`; -1 gives an empty row with a group of its own."""
    taken = np.maximum(order, 0)
    empty = order < 0

    def take(x: np.ndarray, fill) -> np.ndarray:
        x = np.asarray(x)[taken]
        return np.where(empty.reshape(-1, *[1] * (x.ndim - 1)), fill, x).astype(x.dtype)

    # Group ids renumbered densely (0.. in order of first appearance), as `make_token_batch` has them:
    # every id below the row count, what the estimators' segment sums assume.
    dense: dict[int, int] = {}
    kept = [dense.setdefault(int(g), len(dense)) for g in np.asarray(batch.group_ids)[order[~empty]]]
    group_ids = np.empty(len(order), np.int32)
    group_ids[~empty] = kept
    group_ids[empty] = len(dense) + np.arange(int(empty.sum()))
    return batch.replace(
        tokens=take(batch.tokens, 0), positions=take(batch.positions, -1), loss_mask=take(batch.loss_mask, 0),
        old_logprobs=take(batch.old_logprobs, 0), token_rewards=take(batch.token_rewards, 0),
        group_ids=group_ids, scores=take(batch.scores, 0),
        experts=None if batch.experts is None else take(batch.experts, -1),
        step_groups=None if batch.step_groups is None else take(batch.step_groups, -1),
    )


def pack_groups(batch: TokenBatch, rows_per_unit: int, *, num_units: int | None = None,
                width: int | None = None) -> TokenBatch:
    """`batch` (host arrays) with each group's trained rows packed as prefix trees of at most
    `rows_per_unit` rows (`pack`); rows that train nothing are left out. Where no unit shares a
    token, the plain batch: packing would only move its padding."""
    units = group_units(batch, rows_per_unit)
    packed, rows = packed_lengths(batch, units)
    if packed == rows:
        return batch
    return pack(batch, units, rows_per_unit, num_units=num_units, width=width)
