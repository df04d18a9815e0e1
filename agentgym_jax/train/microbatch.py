"""How an update cuts its batch: units, mini- and micro-batches, and the length each part runs at.

The unit of cutting is what the trainer computes together: a row of a plain batch, or a *unit*
of rows packed as one prefix tree (`rollout/packing.py`: a group's samples). `to_units` views a
batch with every leaf led by its units (a packed batch's rows `[units * rows, ...]` as
`[units, rows, ...]`); parts of units are shuffled, split and merged like rows, so a group's
rows stay together and its shared prefix runs once per micro-batch.

Each part runs at the shortest of a few lengths that holds it (`at_length`: the longest row of
a plain part, the longest packed unit of a packed one), and is skipped when it trains nothing.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from agentgym_jax.parallel.mesh import BATCH_AXES


def rows_per_unit(batch: Any) -> int:
    """Rows of `batch` per unit (1 for plain rows and for batches whose leaves are units already)."""
    layout = getattr(batch, "layout", None)
    return 1 if layout is None or getattr(batch, "rows_are_units", False) else layout.rows_per_unit


def to_units(batch: Any) -> Any:
    """`batch` with its row leaves `[units * rows, ...]` viewed as `[units, rows, ...]` (its
    layout's leaves are per unit already); a plain batch unchanged."""
    rows = rows_per_unit(batch)
    if rows == 1:
        return batch
    grouped = jax.tree.map(lambda x: x.reshape(x.shape[0] // rows, rows, *x.shape[1:]), batch.replace(layout=None))
    return grouped.replace(layout=batch.layout)


def to_rows(units: Any) -> Any:
    """The inverse of `to_units`."""
    rows = rows_per_unit(units)
    if rows == 1:
        return units
    flat = jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), units.replace(layout=None))
    return flat.replace(layout=units.layout)


def count_units(batch: Any) -> int:
    """The units of a batch (its rows when plain)."""
    return batch.tokens.shape[0] // rows_per_unit(batch)


def split(tree: Any, parts: int) -> Any:
    """[units, ...] -> [parts, units // parts, ...] on every leaf; part i takes units i, i + parts, ...

    Strided rather than contiguous, so that with units sharded over devices every part keeps
    units on every device (the reshape needs no communication).
    """
    return jax.tree.map(lambda x: x.reshape(x.shape[0] // parts, parts, *x.shape[1:]).swapaxes(0, 1), tree)


def merge(tree: Any) -> Any:
    """The inverse of `split`: [parts, units // parts, ...] -> [units, ...] in the original order."""
    return jax.tree.map(lambda x: x.swapaxes(0, 1).reshape(-1, *x.shape[2:]), tree)


def share(units: Any, agg_mode: str) -> jax.Array:
    """[parts] weights making the weighted sum of the parts' losses equal the whole loss: each
    part's share of the loss tokens (`token-mean`) or of the sequences with one (the seq modes).
    `units`: split, leaves [parts, units, ...]."""
    mask = units.loss_mask.reshape(units.loss_mask.shape[0], -1, units.loss_mask.shape[-1])  # [parts, rows, seq]
    if agg_mode == "token-mean":
        counts = jnp.sum(mask, axis=(1, 2))
    else:
        counts = jnp.sum(jnp.any(mask > 0, axis=2), axis=1).astype(jnp.float32)
    return counts / jnp.maximum(jnp.sum(counts), 1.0)


def full_length(batch: Any) -> int:
    """The positions a part of `batch` runs at when nothing is cut: the packed width, or the rows'."""
    return batch.layout.width if getattr(batch, "layout", None) is not None else batch.tokens.shape[1]


LENGTH_SPACINGS = ("halving", "even")


def length_buckets(seq: int, count: int, multiple: int = 64, spacing: str = "halving") -> tuple[int, ...]:
    """The lengths a part of `seq` positions can run at, longest first, `count` in all (rounded up
    to a `multiple` of positions, repeats dropped): `seq` and its halvings, for parts whose lengths
    spread over octaves (episodes of 1 to 12 turns); or `seq * k / count`, evenly spaced, for parts
    of like lengths (a group's packed prefix tree: 1,000-1,500 positions at width 1,536 all ran at
    the full width between halvings)."""
    if spacing == "halving":  # else "even"; `Batching` refuses any other
        lengths = (seq >> i for i in range(count))
    else:
        lengths = (-(-seq * (count - i) // count) for i in range(count))
    rounded = (-(-length // multiple) * multiple for length in lengths)
    return tuple(sorted({min(seq, max(length, multiple)) for length in rounded}, reverse=True))


def unit_lengths(units: Any) -> jax.Array:
    """[units] the positions each unit needs: its real (packed) tokens, right-padded at -1; or
    none when it trains no token (e.g. a group the batch filter dropped: it adds nothing)."""
    mask = units.loss_mask
    trains = jnp.any(mask.reshape(mask.shape[0], -1) > 0, axis=1)
    positions = units.layout.positions if getattr(units, "layout", None) is not None else units.positions
    return jnp.where(trains, jnp.sum(positions >= 0, axis=1), 0)


def length_order(units: Any, parts: int) -> jax.Array:
    """[units] an order in which `split(units, parts)` part i holds the i-th shortest `units /
    parts` units: parts of like lengths, so that each can run at its own length."""
    order = jnp.argsort(unit_lengths(units))
    per_part = order.shape[0] // parts
    return order.reshape(parts, per_part).T.reshape(-1)  # part i (units i, i + parts, ...) = order[i * per_part:]


def cut(batch: Any, length: int) -> Any:
    """`batch` with its computed positions cut to the first `length`: a packed batch's layout
    (its rows keep their width; the sources never point past the unit's tokens), or the rows."""
    full = full_length(batch)
    if getattr(batch, "layout", None) is not None:
        trim = lambda x: x[:, :length] if x.ndim == 2 and x.shape[1] == full else x  # noqa: E731
        return batch.replace(layout=batch.layout.replace(tokens=trim(batch.layout.tokens),
                                                         positions=trim(batch.layout.positions),
                                                         ends=trim(batch.layout.ends)))
    return jax.tree.map(lambda x: x[:, :length] if x.ndim >= 2 and x.shape[1] == full else x, batch)  # [rows, seq, ...]


def at_length(fn: Callable, lengths: tuple[int, ...], per_position: bool = False) -> Callable:
    """`fn(params, units)` run on `units` cut to the shortest of `lengths` that holds its longest
    unit (one `lax.switch` branch per length; only the taken one runs), and that length; with
    several lengths, not run at all (zeros, length 0) when no unit trains a token, e.g. groups
    that dynamic sampling left out. `per_position`: the output's [..., seq] leaves are padded
    back to the rows' width (plain rows are cut with their positions).

    Exact: positions past a unit's end are padding, which no real token attends to and no loss
    counts (nor any position of a unit that trains no token), every loss aggregation is
    independent of the padded length, and a part that trains no token has a zero loss, gradient
    and micro-batch weight, and scores that every later use masks out."""

    def at(length: int) -> Callable:
        def run(params, units):
            seq = units.tokens.shape[-1]
            out = fn(params, cut(units, length))
            pad = lambda y: jnp.pad(y, [(0, 0)] * (y.ndim - 1) + [(0, seq - y.shape[-1])])  # noqa: E731
            return jax.tree.map(pad, out) if per_position else out

        return run

    branches = [at(length) for length in lengths]

    def skip(params, units):
        return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(branches[0], params, units))

    if len(lengths) == 1:  # one length: no switch (a conditional costs the update memory at real shapes)
        return lambda params, units: (branches[0](params, units), jnp.float32(lengths[0]))

    def run(params, units):
        needed = jnp.max(unit_lengths(units))
        fits = jnp.sum(jnp.asarray(lengths) >= needed) - 1  # longest first: a prefix fits
        index = jnp.where(needed > 0, fits, len(lengths))
        out = jax.lax.switch(index, [*branches, skip], params, units)
        return out, jnp.asarray((*lengths, 0), jnp.float32)[index]

    return run


def check_parts(units: int, num_minibatches: int, num_microbatches: int, mesh_shape: dict[str, int] | None,
                what: str = "rows") -> None:
    """A clear error unless `units` cut into `num_minibatches x num_microbatches` parts that each
    split evenly over the mesh's batch shards (else a part is replicated and recomputed on every
    device). `what` names the units in the message ("rows", or "units" of a packed batch)."""
    mini, micro = num_minibatches, num_microbatches
    if units % (mini * micro):
        raise ValueError(f"batch of {units} {what} is not divisible into {mini} mini-batches x {micro} micro-batches")
    per_mini = units // mini
    shards = 1 if mesh_shape is None else math.prod(mesh_shape[axis] for axis in BATCH_AXES)
    if (per_mini // micro) % shards:
        fix = (
            f"set num_microbatches to a divisor of {per_mini // shards} (at most {per_mini // shards})"
            if per_mini % shards == 0
            else f"no num_microbatches fits: give each mini-batch a multiple of {shards} {what} (num_minibatches, {what})"
        )
        raise ValueError(
            f"mini-batch of {per_mini} {what} / num_microbatches={micro} = {per_mini // micro} {what} per micro-batch, "
            f"but the mesh has {shards} batch shards (data x fsdp) and a micro-batch needs a multiple of them: {fix}"
        )
