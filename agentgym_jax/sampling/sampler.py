"""Jitted KV-cache generation with multi-turn continuation.

Two pure functions do the work, both over the `KVCache` contract (`models/cache.py`):
- `append_chunk`: writes a right-padded chunk of new tokens (a prompt, or each episode's new
  environment tokens) into the cache in one forward pass. Each row's positions continue from
  `cache.next_positions()`; padding gets position -1, so it is never attended to.
- `decode`: samples one turn in a `lax.while_loop`. Every step feeds the token it sampled back
  through the model; rows that are done write padding (position -1). The loop stops as soon as
  every row is done, so a batch costs as many steps as its longest turn.

For continuous batching (`rollout.num_slots`): `fill_rows` appends to a few rows only (gathered,
run, scattered back), `copy_prefix` copies a row's first tokens (a shared prompt), and `decode_rows` runs
`decode` in chunks over the rows whose turn is in progress (gathered the same way) and the slots
they hold. A `Turn` carries each row's turn across chunks.

`Sampler` is the thin Python driver on top: it pads batches, chunks and the cache to shape
buckets (so nothing recompiles inside a bucket), grows the cache bucket by bucket up to
`max_cache_len` (so decode attends over the filled part, not the maximum), and reports cache
overflow as a status instead of wrapping around.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from agentgym_jax.models import decoder
from agentgym_jax.models.cache import KVCache
from agentgym_jax.models.config import ModelConfig
from agentgym_jax.models.kernels import AttentionKernels
from agentgym_jax.parallel import partition
from agentgym_jax.parallel.mesh import BATCH_AXES
from agentgym_jax.sampling import buckets
from agentgym_jax.sampling.config import SamplingConfig
from agentgym_jax.sampling.filters import sample
from agentgym_jax.sampling.step import Params, StepFn, decoder_step

# (batch, max_len) -> an empty cache
InitCacheFn = Callable[[int, int], KVCache]
# params -> the form the step reads inside the decode loop (e.g. `decoder.unstack_layers`)
LoopParamsFn = Callable[[Params], Params]
# the caller's params -> the copy every call of one rollout reads (e.g. the policy in the compute dtype)
SamplingParamsFn = Callable[[Params], Params]


class StopReason(enum.IntEnum):
    """Why a row's turn ended. The rollout engine maps CACHE_FULL to the token_budget status."""

    NOT_LIVE = 0  # the row's episode is over; it sampled nothing
    END_OF_TURN = 1  # it sampled one of `eot_ids` (included in its tokens)
    TOKEN_LIMIT = 2  # it reached its per-turn token limit
    CACHE_FULL = 3  # the row's real tokens reached `max_cache_len` mid-turn; it is no longer live


@flax.struct.dataclass
class SamplerState:
    """What the sampler carries between turns for a batch of episodes."""

    cache: KVCache  # [.., batch_bucket, cache_bucket, ..]
    logits: jax.Array  # [batch_bucket, vocab] float32: next-token logits of each row
    live: jax.Array  # [batch_bucket] bool: rows whose episode goes on
    num_rows: int = flax.struct.field(pytree_node=False)  # rows the caller has (<= batch_bucket)


class Turn(NamedTuple):
    """Each row's turn in progress; `decode` carries it over as many chunks of steps as it takes.

    A row draws its n-th token of a turn with `fold_in(rng, seeds[b, 0], seeds[b, 1], n)`: the
    draw depends on the row's own (episode, turn, n), not on the batch it shares or the chunk.
    """

    active: Any  # [B] bool: still sampling this turn
    count: Any  # [B] int32: tokens sampled this turn
    limit: Any  # [B] int32: per-turn token limit (<= max_new_tokens)
    forced: Any  # [B] int32: 0 free; n > 0: end-of-turn masked before the n-th token, forced at it
    seeds: Any  # [B, 2] int32: (episode, turn) the row's draws fold into the key
    stop: Any  # [B] int32 StopReason, final once `active` is False

    @classmethod
    def start(cls, live, limit, forced=None, seeds=None) -> Turn:
        """Host arrays for a new turn of the `live [B]` rows (numpy)."""
        live = np.asarray(live, bool)
        limit = np.asarray(limit, np.int32)
        batch = live.shape[0]
        return cls(
            active=live & (limit > 0),
            count=np.zeros((batch,), np.int32),
            limit=limit,
            forced=np.zeros((batch,), np.int32) if forced is None else np.asarray(forced, np.int32),
            seeds=np.zeros((batch, 2), np.int32) if seeds is None else np.asarray(seeds, np.int32),
            stop=np.where(live, StopReason.TOKEN_LIMIT, StopReason.NOT_LIVE).astype(np.int32),
        )


@dataclasses.dataclass
class SamplerWork:
    """What the sampler's calls computed, counted on the host (the benchmark's useful fraction)."""

    decode_row_steps: int = 0  # rows x steps the decode loops ran (every row of the batch bucket)
    decode_live_steps: int = 0  # of those, row-steps that sampled a token
    prompt_tokens_computed: int = 0  # rows x chunk width of prompt prefills (padding included)
    observation_tokens_computed: int = 0  # rows x chunk width of the appends after them (padding included)

    def add_decode(self, batch: int, sampled: np.ndarray) -> None:
        """One decode call over `batch` rows in which row b sampled `sampled[b]` tokens."""
        self.decode_row_steps += batch * int(sampled.max(initial=0))
        self.decode_live_steps += int(sampled.sum())

    def minus(self, before: SamplerWork) -> SamplerWork:
        return SamplerWork(**{f.name: getattr(self, f.name) - getattr(before, f.name) for f in dataclasses.fields(self)})


class TurnOutput(NamedTuple):
    """One sampled turn, on the host, for the caller's rows."""

    tokens: np.ndarray  # [rows, max_new_tokens] int32; pad_id after `count`
    count: np.ndarray  # [rows] int32: tokens sampled (an end-of-turn id included)
    logprobs: np.ndarray  # [rows, max_new_tokens] float32 under the sampling distribution; 0 after count
    raw_logprobs: np.ndarray | None  # same at the temperature, unfiltered (if asked for)
    stop: np.ndarray  # [rows] int32 StopReason
    # A mixture of experts: the experts each sampled token was routed to when it went into the
    # cache, [rows, max_new_tokens, layers, k] int32 (-1 after count) with `return_experts`; None
    # without, or for a dense model.
    experts: np.ndarray | None = None


class _DecodeCarry(NamedTuple):
    step: jax.Array  # [] int32
    cache: KVCache
    logits: jax.Array  # [batch, vocab]
    turn: Turn
    next_positions: jax.Array  # [batch] int32
    tokens: jax.Array  # [batch, steps]
    logprobs: jax.Array  # [batch, steps]
    raw_logprobs: jax.Array  # [batch, steps]
    experts: jax.Array | None  # [batch, steps, layers, k] (a mixture of experts)


def append_chunk(
    step_fn: StepFn,
    params: Params,
    cache: KVCache,
    logits: jax.Array,
    tokens: jax.Array,
    lengths: jax.Array,
) -> tuple[KVCache, jax.Array]:
    """Appends `tokens [B, T]` (row b's first `lengths[b]` are real) to the cache.

    Returns the advanced cache and `[B, V]` next-token logits: those after each row's last new
    token, or `logits` unchanged for rows that appended nothing.
    """
    offsets = jnp.arange(tokens.shape[1], dtype=jnp.int32)  # [T]
    real = offsets[None, :] < lengths[:, None]  # [B, T]
    positions = jnp.where(real, cache.next_positions()[:, None] + offsets, -1)
    last, cache, _ = step_fn(params, tokens, positions, cache, jnp.maximum(lengths - 1, 0))  # [B, V]
    return cache, jnp.where((lengths > 0)[:, None], last, logits)


def _force_turn_lengths(logits: jax.Array, turn: Turn, eot_ids: tuple[int, ...]) -> jax.Array:
    """End-of-turn ids masked before each row's forced length, and the only choice at it."""
    is_eot = jnp.zeros((logits.shape[-1],), bool).at[jnp.asarray(eot_ids)].set(True)  # [V]
    hold = (turn.count + 1 < turn.forced)[:, None]
    force = (turn.count + 1 == turn.forced)[:, None]
    drop = jnp.where(is_eot[None, :], hold, force)  # [B, V]
    return jnp.where(drop, -jnp.inf, logits)


def decode(
    step_fn: StepFn,
    config: SamplingConfig,
    loop_params_fn: LoopParamsFn | None,
    steps: int,
    forcing: bool,
    params: Params,
    cache: KVCache,
    logits: jax.Array,
    turn: Turn,
    rng: jax.Array,
) -> tuple[KVCache, jax.Array, Turn, tuple[jax.Array, ...]]:
    """Samples up to `steps` tokens for every active row of `turn` (a whole turn, or one chunk).

    Returns the cache (every sampled token written at its row's own slot), the next-token
    logits, the turn (counts and stops advanced; rows whose real tokens fill the cache stop with
    CACHE_FULL) and the chunk's (tokens, logprobs, raw_logprobs) [B, steps] and, with
    `config.return_experts`, a mixture of experts' routing of each sampled token (experts [B,
    steps, layers, k]; else, or for a dense model, None): a row that sampled n tokens in this
    call has them in columns 0..n-1. `loop_params_fn` reshapes the params once, before the loop,
    into what every step reads; `forcing` applies `turn.forced`.
    """
    if loop_params_fn is not None:
        params = loop_params_fn(params)
    batch = logits.shape[0]
    eot_ids = jnp.asarray(config.eot_ids or (-1,), jnp.int32)
    buffer = jnp.zeros((batch, steps), jnp.float32)
    row_keys = jax.vmap(lambda seed: jax.random.fold_in(jax.random.fold_in(rng, seed[0]), seed[1]))(turn.seeds)
    full = turn.active & (cache.index >= cache.max_len)  # no slot left for the next token
    turn = turn._replace(
        active=turn.active & ~full, stop=jnp.where(full, StopReason.CACHE_FULL, turn.stop).astype(jnp.int32)
    )

    def cond(c: _DecodeCarry) -> jax.Array:
        return jnp.any(c.turn.active) & (c.step < steps)

    def body(c: _DecodeCarry) -> _DecodeCarry:
        t = c.turn
        keys = jax.vmap(jax.random.fold_in)(row_keys, t.count)
        s = sample(keys, _force_turn_lengths(c.logits, t, config.eot_ids) if forcing else c.logits, config)
        tok = jnp.where(t.active, s.tokens, config.pad_id)  # [B]
        positions = jnp.where(t.active, c.next_positions, -1)
        out, cache, experts = step_fn(params, tok[:, None], positions[:, None], c.cache, jnp.zeros_like(tok))
        count = t.count + t.active
        at_eot = t.active & jnp.isin(tok, eot_ids)
        at_limit = t.active & ~at_eot & (count >= t.limit)
        at_full = t.active & ~at_eot & ~at_limit & (cache.index >= cache.max_len)
        stop = jnp.where(at_eot, StopReason.END_OF_TURN, t.stop)
        stop = jnp.where(at_limit, StopReason.TOKEN_LIMIT, stop)
        stop = jnp.where(at_full, StopReason.CACHE_FULL, stop)
        column = lambda buf, x: buf.at[:, c.step].set(jnp.where(t.active, x, 0).astype(buf.dtype))
        return _DecodeCarry(
            step=c.step + 1,
            cache=cache,
            logits=jnp.where(t.active[:, None], out, c.logits),
            turn=t._replace(active=t.active & ~at_eot & ~at_limit & ~at_full, count=count, stop=stop),
            next_positions=c.next_positions + t.active,
            tokens=c.tokens.at[:, c.step].set(tok),
            logprobs=column(c.logprobs, s.logprobs),
            raw_logprobs=(
                column(c.raw_logprobs, s.raw_logprobs) if config.return_raw_logprobs else c.raw_logprobs
            ),
            experts=None if c.experts is None else c.experts.at[:, c.step].set(
                jnp.where(t.active[:, None, None], experts, -1)),
        )

    routed = None  # [batch, layers, k]: what a step routes, where asked for and the model has experts
    if config.return_experts:
        routed = jax.eval_shape(step_fn, params, jnp.zeros((batch, 1), jnp.int32), jnp.zeros((batch, 1), jnp.int32),
                                cache, jnp.zeros((batch,), jnp.int32))[2]
    start = _DecodeCarry(
        step=jnp.zeros((), jnp.int32),
        cache=cache,
        logits=logits,
        turn=turn,
        next_positions=cache.next_positions(),
        tokens=jnp.full((batch, steps), config.pad_id, jnp.int32),
        logprobs=buffer,
        raw_logprobs=buffer,
        experts=None if routed is None else jnp.full((batch, steps, *routed.shape[1:]), -1, jnp.int32),
    )
    c = jax.lax.while_loop(cond, body, start)
    return c.cache, c.logits, c.turn, (c.tokens, c.logprobs, c.raw_logprobs, c.experts)


def cast_floating(dtype: jnp.dtype, params: Params) -> Params:
    """`params` with every floating-point leaf in `dtype` (integer leaves unchanged)."""
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, params)


def grow_cache(cache: KVCache, max_len: int) -> KVCache:
    """The same cache with `max_len` slots; the new slots are empty (position -1)."""
    extra = max_len - cache.max_len
    pad_kv = ((0, 0), (0, 0), (0, 0), (0, extra), (0, 0))
    return cache.replace(
        k=jnp.pad(cache.k, pad_kv),
        v=jnp.pad(cache.v, pad_kv),
        positions=jnp.pad(cache.positions, ((0, 0), (0, extra)), constant_values=-1),
    )


def _prefix(cache: KVCache, slots: int) -> KVCache:
    """The first `slots` slots of every row of the cache (a copy)."""
    return cache.replace(k=cache.k[:, :, :, :slots], v=cache.v[:, :, :, :slots], positions=cache.positions[:, :slots])


def _take_rows(tree: Any, rows: jax.Array) -> Any:
    """The rows `rows [K]` of a cache, logits or turn (out-of-range entries: the last row, a copy)."""
    return jax.tree.map(lambda x: jnp.take(x, rows, axis=1 if x.ndim == 5 else 0, mode="clip"), tree)


def _put_rows(tree: Any, rows: jax.Array, sub: Any) -> Any:
    """`tree` with row `rows[i]` set to `sub`'s row i (its leading slots for a cache); out-of-range
    entries of `rows` are dropped."""
    def put(x, y):
        if x.ndim == 5:  # cache keys / values [L, B, Hkv, S, D]
            return x.at[:, rows, :, : y.shape[3]].set(y, mode="drop")
        if x.ndim == 2 and y.shape[1] != x.shape[1]:  # cache positions [B, S]
            return x.at[rows, : y.shape[1]].set(y, mode="drop")
        return x.at[rows].set(y, mode="drop")

    return jax.tree.map(put, tree, sub)


def _put_window(cache: KVCache, rows: jax.Array, sub: KVCache, start: jax.Array, steps: int) -> KVCache:
    """`cache` with slots `start[i] .. start[i] + steps` of `sub`'s row i written to row `rows[i]`:
    all a decode chunk can have changed, so the rest of the gathered rows is not written back.
    Slots past the sub-cache (= past `max_cache_len`, see `decode_rows`) and out-of-range rows are
    dropped."""
    slots = start[:, None] + jnp.arange(steps, dtype=jnp.int32)  # [K, steps]
    read = jnp.minimum(slots, sub.max_len - 1)
    window = lambda x: jnp.take_along_axis(x, read[None, :, None, :, None], axis=3)  # [L, K, Hkv, steps, D]
    slots = jnp.where(slots < sub.max_len, slots, cache.max_len)  # dropped
    put_kv = lambda x, y: x.at[:, rows[:, None], :, slots].set(y.transpose(1, 3, 0, 2, 4), mode="drop")
    return KVCache(
        k=put_kv(cache.k, window(sub.k)),
        v=put_kv(cache.v, window(sub.v)),
        positions=cache.positions.at[rows[:, None], slots].set(
            jnp.take_along_axis(sub.positions, read, axis=1), mode="drop"
        ),
        index=cache.index.at[rows].set(sub.index, mode="drop"),
    )


def decode_rows(
    step_fn: StepFn,
    config: SamplingConfig,
    loop_params_fn: LoopParamsFn | None,
    steps: int,
    forcing: bool,
    slots: int,
    params: Params,
    cache: KVCache,
    logits: jax.Array,
    turn: Turn,
    rng: jax.Array,
    rows: jax.Array,
) -> tuple[KVCache, jax.Array, Turn, tuple[jax.Array, ...]]:
    """`decode` of the rows `rows [K]` only (out-of-range entries: padding, they sample nothing),
    gathered over their first `slots` slots (what the longest holds plus `steps`, bucketed, or
    `max_cache_len`): a chunk costs the rows whose turn is in progress times what they hold, not
    every slot row x `max_cache_len`. Only the slots the chunk wrote go back into the cache.
    The outputs (tokens, logprobs, raw_logprobs, experts) are [K, steps, ...], in the order of `rows`."""
    real = rows < logits.shape[0]
    sub_turn = _take_rows(turn, rows)
    sub_turn = sub_turn._replace(active=sub_turn.active & real)
    sub_cache = _take_rows(_prefix(cache, slots), rows)
    sub, sub_logits, sub_turn, arrays = decode(
        step_fn, config, loop_params_fn, steps, forcing, params, sub_cache, _take_rows(logits, rows), sub_turn, rng
    )
    cache = _put_window(cache, rows, sub, sub_cache.index, steps)
    return cache, _put_rows(logits, rows, sub_logits), _put_rows(turn, rows, sub_turn), arrays


def fill_rows(
    step_fn: StepFn,
    slots: int,
    params: Params,
    cache: KVCache,
    logits: jax.Array,
    rows: jax.Array,
    fresh: jax.Array,
    tokens: jax.Array,
    lengths: jax.Array,
) -> tuple[KVCache, jax.Array]:
    """Appends `tokens [K, T]` to the K rows `rows [K]` only (`fresh [K]`: the row starts empty).

    The rows' first `slots` slots are gathered into a K-row cache, run through the model and
    scattered back, so the other rows cost nothing. Padding entries of `rows` are out of range
    (>= batch): dropped.
    """
    batch = logits.shape[0]
    # a fresh row forgets all its old tokens, also those past the `slots` written back below
    cache = cache.replace(positions=cache.positions.at[jnp.where(fresh, rows, batch)].set(-1, mode="drop"))
    sub = _take_rows(_prefix(cache, slots), rows)
    sub = sub.replace(
        positions=jnp.where(fresh[:, None], -1, sub.positions), index=jnp.where(fresh, 0, sub.index)
    )
    sub, sub_logits = append_chunk(step_fn, params, sub, _take_rows(logits, rows), tokens, lengths)
    return _put_rows(cache, rows, sub), _put_rows(logits, rows, sub_logits)


def copy_prefix(
    cache: KVCache, logits: jax.Array, src: jax.Array, dst: jax.Array, lengths: jax.Array, dst_logits: jax.Array
) -> tuple[KVCache, jax.Array]:
    """Row `dst[i]` becomes the first `lengths[i]` tokens of row `src[i]` (its older slots: a
    shared prompt while the source row went on), with next-token logits `dst_logits [K, V]`;
    out-of-range `dst`: dropped."""
    sub = _take_rows(cache, src)
    keep = jnp.arange(cache.max_len, dtype=jnp.int32)[None, :] < lengths[:, None]  # [K, S]
    sub = sub.replace(positions=jnp.where(keep, sub.positions, -1), index=lengths)
    return _put_rows(cache, dst, sub), _put_rows(logits, dst, dst_logits)


def _jit(shardings: SamplerShardings | None, fn: Callable, ins: tuple, outs: Any, **kw) -> Callable:
    """`jax.jit(fn)`, with in/out shardings named by role ("params", "cache", "batch", ...) if sharded."""
    if shardings is None:
        return jax.jit(fn, **kw)
    place = lambda role: jax.tree.map(
        lambda r: shardings.replicated if r == "replicated" else getattr(shardings, r), role
    )
    in_shardings = tuple(place(r) for r in ins if r != "static")
    jitted = jax.jit(fn, in_shardings=in_shardings, out_shardings=place(outs), **kw)
    return jitted if jax.process_count() == 1 else _HostInputsPlaced(jitted, ins, in_shardings)


class _HostInputsPlaced:
    """A jitted function that first puts its host (numpy) arguments in their shardings: with
    several processes, jit refuses numpy inputs with non-replicated in_shardings, even over this
    process's own devices (each process's sampler runs on its local mesh)."""

    def __init__(self, jitted: Callable, ins: tuple, in_shardings: tuple):
        self.jitted, self.ins, self.in_shardings = jitted, ins, in_shardings

    def __call__(self, *args):
        shardings = iter(self.in_shardings)
        put = lambda s, arg: jax.tree.map(lambda x: jax.device_put(x, s) if isinstance(x, np.ndarray) else x, arg)  # noqa: E731
        is_sharding = lambda x: isinstance(x, jax.sharding.Sharding)  # noqa: E731
        placed = [a if role == "static" else jax.tree.map(put, next(shardings), a, is_leaf=is_sharding)
                  for role, a in zip(self.ins, args)]
        return self.jitted(*placed)

    def lower(self, *args):
        return self.jitted.lower(*args)


@dataclasses.dataclass(frozen=True)
class SamplerShardings:
    """Where the jitted sampler functions keep their arrays (`for_mesh` builds the usual layout).

    Rows (tokens, logits, live flags, outputs) are split by `batch`; `cache` is a `KVCache` of
    shardings (rows over the batch axes, key/value heads over `tensor`: independent of the cache
    length, so every cache bucket uses it). Every batch bucket must divide evenly over `batch`.
    """

    params: Any  # a pytree of shardings matching the params, or one sharding for all
    batch: jax.sharding.NamedSharding  # leading (row) dim, e.g. P(("data", "fsdp"))
    cache: KVCache  # of shardings

    @classmethod
    def for_mesh(cls, mesh: jax.sharding.Mesh, params: Params, model_config: ModelConfig) -> SamplerShardings:
        """The project's layout (`parallel.partition`): params by the partition rules, rows over
        ("data", "fsdp"), key/value heads over "tensor" where they divide."""
        rows = math.prod(mesh.shape[axis] for axis in BATCH_AXES)
        cache = jax.eval_shape(functools.partial(decoder.init_cache, model_config, rows, 1))
        return cls(
            params=partition.param_shardings(params, mesh),
            batch=partition.batch_sharding(mesh),
            cache=partition.cache_shardings(cache, mesh),
        )

    @property
    def row_shards(self) -> int:
        """How many ways `batch` splits the rows."""
        size = self.batch.mesh.size
        return size // self.batch.shard_shape((size,))[0]

    @property
    def replicated(self) -> jax.sharding.NamedSharding:
        return jax.sharding.NamedSharding(self.batch.mesh, jax.sharding.PartitionSpec())


def _policy_weights_fn(dtype: jnp.dtype, shardings: SamplerShardings | None) -> SamplingParamsFn:
    """params -> the decoder's weights without the value head, floating leaves in `dtype`
    (placed in `shardings.params`): a jitted cast when a leaf has another dtype, else no copy."""
    cast = jax.jit(functools.partial(cast_floating, dtype), out_shardings=shardings.params if shardings else None)

    def policy_weights(params: Params) -> Params:
        policy = {name: p for name, p in params.items() if name != "value_head"}  # the sampler never reads the critic
        floating = [x for x in jax.tree.leaves(policy) if jnp.issubdtype(x.dtype, jnp.floating)]
        if any(x.dtype != dtype for x in floating):
            return cast(policy)
        return policy if shardings is None else jax.device_put(policy, shardings.params)  # no-op when in place

    return policy_weights


class Sampler:
    """Prefill, sample a turn, append environment tokens, sample the next turn, ...

    Usage (one RL rollout):
        state = sampler.prefill(params, prompts)               # list of token-id lists
        state, turn = sampler.generate(params, state, rng)     # turn.tokens[b, :turn.count[b]]
        state, overflow = sampler.append(params, state, observations, live)
        state, turn = sampler.generate(params, state, rng2)    # history is not recomputed

    `step_fn` runs the model on new tokens and returns one position's logits per row (see
    `sampling.step`: `decoder_step` or `from_forward(forward_fn)` for any model with the
    decoder's `forward` signature); `init_cache_fn(batch, max_len)` makes an empty cache;
    `loop_params_fn` (optional) maps the params, once per turn, to the form the decode loop's
    steps read (`for_decoder`: `decoder.unstack_layers`). Batch sizes, chunk lengths
    and cache lengths are rounded up to buckets (default: 2^k and 3 * 2^k; calls over some rows
    only, `fill_buckets` and `decode_buckets`: powers of two), so only a new bucket
    compiles. The cache grows through `cache_buckets` up to `max_cache_len`; what does not fit
    is reported (append: `overflow` rows; generate: StopReason.CACHE_FULL), never wrapped.
    Growing frees the smaller cache at once (XLA cannot alias buffers of different shapes, so the
    old one is deleted explicitly): old and new are only both live during the copy.
    With `shardings`, every jitted function gets explicit in/out shardings over its mesh.
    `sampling_params_fn` (optional) maps the caller's params to the copy the sampler reads;
    `sampling_params(params)` applies it, once per rollout (`RolloutEngine.run` does).
    """

    def __init__(
        self,
        step_fn: StepFn,
        init_cache_fn: InitCacheFn,
        config: SamplingConfig,
        *,
        max_cache_len: int,
        batch_buckets: Sequence[int] | None = None,
        chunk_buckets: Sequence[int] | None = None,
        cache_buckets: Sequence[int] | None = None,
        shardings: SamplerShardings | None = None,
        loop_params_fn: LoopParamsFn | None = None,
        sampling_params_fn: SamplingParamsFn | None = None,
        fill_buckets: Sequence[int] | None = None,
        decode_buckets: Sequence[int] | None = None,
        fill_tokens: int = 8192,
    ):
        if fill_tokens < 1:
            raise ValueError(f"fill_tokens must be >= 1, got {fill_tokens}")
        self.config = config
        self.fill_tokens = fill_tokens
        self.shardings = shardings
        self._sampling_params_fn = sampling_params_fn
        self.max_cache_len = max_cache_len
        row_shards = shardings.row_shards if shardings else 1
        self.batch_buckets = buckets.check_buckets(
            "batch_buckets", batch_buckets or tuple(row_shards * b for b in buckets.powers_of_two(1, 1024, threes=True))
        )
        # Calls over some rows only (fills, decodes of the rows in a turn) take fewer sizes: each is a compilation.
        some_rows = tuple(row_shards * b for b in buckets.powers_of_two(1, 1024))
        if any(b % row_shards for b in self.batch_buckets):
            raise ValueError(f"batch_buckets {self.batch_buckets} must be multiples of the {row_shards} row shards")
        self.chunk_buckets = buckets.check_buckets(
            "chunk_buckets", chunk_buckets or buckets.powers_of_two(16, max_cache_len, threes=True)
        )
        self.cache_buckets = buckets.check_buckets(
            "cache_buckets", cache_buckets or buckets.powers_of_two(min(128, max_cache_len), max_cache_len, threes=True)
        )
        self.fill_buckets = buckets.check_buckets("fill_buckets", fill_buckets or some_rows)
        if any(b % row_shards for b in self.fill_buckets):
            raise ValueError(f"fill_buckets {self.fill_buckets} must be multiples of the {row_shards} row shards")
        self.decode_buckets = buckets.check_buckets("decode_buckets", decode_buckets or some_rows)
        if any(b % row_shards for b in self.decode_buckets):
            raise ValueError(f"decode_buckets {self.decode_buckets} must be multiples of the {row_shards} row shards")
        if self.cache_buckets[-1] != max_cache_len:
            raise ValueError(f"the last cache bucket must be max_cache_len={max_cache_len}, got {self.cache_buckets}")
        self._step = step_fn
        self._vocab_size: int | None = None
        self.work = SamplerWork()
        jit = functools.partial(_jit, shardings)
        self._init_cache = jit(init_cache_fn, ("static", "static"), "cache", static_argnums=(0, 1))
        # The cache and logits are donated: each call updates them in place. With `loop_params_fn`
        # an append runs on the per-layer params too: each layer then writes its keys into the
        # cache in place, where the scan over stacked layers copies every layer's slice of it.
        append = functools.partial(append_chunk, step_fn)
        if loop_params_fn is not None:
            append = lambda params, *rest: append_chunk(step_fn, loop_params_fn(params), *rest)  # noqa: E731
        self._append = jit(
            append,
            ("params", "cache", "batch", "batch", "batch"),
            ("cache", "batch"),
            donate_argnums=(1, 2),
        )
        turn = Turn(*["batch"] * 6)
        self._decode = jit(
            functools.partial(decode, step_fn, config, loop_params_fn),
            ("static", "static", "params", "cache", "batch", turn, "replicated"),
            ("cache", "batch", turn, ("batch",) * 4),
            static_argnums=(0, 1),
            donate_argnums=(3, 4),
        )
        rows = "replicated"  # a few row indices and their chunks: not split over the batch axes
        self._decode_rows = jit(
            functools.partial(decode_rows, step_fn, config, loop_params_fn),
            ("static",) * 3 + ("params", "cache", "batch", turn, "replicated", rows),
            ("cache", "batch", turn, ("replicated",) * 4),
            static_argnums=(0, 1, 2),
            donate_argnums=(4, 5),
        )
        fill = functools.partial(fill_rows, step_fn)
        if loop_params_fn is not None:  # per-layer params, like the append
            fill = lambda slots, params, *rest: fill_rows(step_fn, slots, loop_params_fn(params), *rest)  # noqa: E731
        self._fill = jit(
            fill,
            ("static", "params", "cache", "batch", rows, rows, rows, rows),
            ("cache", "batch"),
            static_argnums=0,
            donate_argnums=(2, 3),
        )
        self._take_logits = jit(lambda logits, rows: _take_rows(logits, rows), ("batch", rows), "replicated")
        self._copy_prefix = jit(
            copy_prefix, ("cache", "batch", rows, rows, rows, rows), ("cache", "batch"), donate_argnums=(0, 1)
        )
        # Growing pads into a bigger buffer: donation cannot alias it, `_ensure_capacity` frees the old one.
        self._grow = jit(grow_cache, ("cache", "static"), "cache", static_argnums=1)

    @classmethod
    def for_decoder(
        cls,
        model_config: ModelConfig,
        config: SamplingConfig,
        *,
        max_cache_len: int,
        dtype: jnp.dtype | None = None,
        cache_dtype: jnp.dtype | None = None,
        shardings: SamplerShardings | None = None,
        kernels: AttentionKernels = AttentionKernels(),
        **buckets_kw,
    ) -> Sampler:
        """A sampler over `models.decoder` (compute `dtype`: default the parameters' dtype;
        attention implementations: `kernels`).

        The KV cache is kept in `cache_dtype`, by default the compute dtype (float32 without one).
        With a compute `dtype`, `sampling_params` gives the policy's weights (no value head) in
        that dtype: a copy when they are stored in another one (float32 master weights), the same
        arrays otherwise.
        """
        if config.return_experts and not model_config.moe:
            raise ValueError(f"return_experts needs a mixture of experts; {model_config.family} routes no experts")
        step_fn = decoder_step(
            model_config, dtype=dtype, activation_sharding=shardings.batch if shardings else None, kernels=kernels
        )
        cache_dtype = cache_dtype or dtype or jnp.float32
        init_cache_fn = functools.partial(decoder.init_cache, model_config, dtype=cache_dtype)
        policy_fn = None if dtype is None else _policy_weights_fn(jnp.dtype(dtype), shardings)
        return cls(
            step_fn, init_cache_fn, config, max_cache_len=max_cache_len, shardings=shardings,
            loop_params_fn=decoder.unstack_layers, sampling_params_fn=policy_fn, **buckets_kw,
        )

    @classmethod
    def sharded_decoder(
        cls,
        model_config: ModelConfig,
        config: SamplingConfig,
        mesh: jax.sharding.Mesh,
        *,
        max_cache_len: int,
        dtype: jnp.dtype,
        cache_dtype: jnp.dtype | None = None,
        kernels: AttentionKernels = AttentionKernels(),
        **buckets_kw,
    ) -> Sampler:
        """`for_decoder` laid out on `mesh` the project's way (`SamplerShardings.for_mesh`), with
        its weights in the compute `dtype` and its KV cache in `cache_dtype` (default: the compute
        dtype): what a job samples with."""
        dtype = jnp.dtype(dtype)
        weights = jax.eval_shape(functools.partial(decoder.init_params, model_config, param_dtype=dtype), jax.random.key(0))
        return cls.for_decoder(
            model_config, config, max_cache_len=max_cache_len, dtype=dtype, cache_dtype=cache_dtype or dtype,
            shardings=SamplerShardings.for_mesh(mesh, weights, model_config), kernels=kernels, **buckets_kw,
        )

    def sampling_params(self, params: Params) -> Params:
        """The params every prefill/append/generate of one rollout reads (see `sampling_params_fn`).

        Call it once per rollout, not per turn: for a bfloat16 sampler over float32 weights it
        makes the bfloat16 copy, which then serves every turn.
        """
        return params if self._sampling_params_fn is None else self._sampling_params_fn(params)

    def _vocab(self, params: Params, cache: KVCache) -> int:
        """The model's vocabulary size, read once from the shape of its output (no compilation)."""
        if self._vocab_size is None:
            token = jax.ShapeDtypeStruct((cache.positions.shape[0], 1), jnp.int32)
            last = jax.ShapeDtypeStruct((cache.positions.shape[0],), jnp.int32)
            self._vocab_size = jax.eval_shape(self._step, params, token, token, cache, last)[0].shape[-1]
        return self._vocab_size

    def _cache_bucket(self, length: int) -> int:
        return buckets.bucket(min(length, self.max_cache_len), self.cache_buckets, "cache length")

    def _ensure_capacity(self, cache: KVCache, needed: int) -> KVCache:
        """Grows the cache to the bucket holding `needed` slots (at most max_cache_len)."""
        target = self._cache_bucket(needed)
        if target <= cache.max_len:
            return cache
        grown = self._grow(cache, target)
        for old in (cache.k, cache.v, cache.positions):  # the caller's state held them: free them now
            old.delete()
        return grown

    def _pad_chunks(self, chunks: Sequence[Sequence[int]], live: np.ndarray, batch: int):
        """Right-pads the live rows' chunks to a chunk bucket: (tokens [batch, T], lengths [batch])."""
        lengths = np.zeros((batch,), np.int32)
        lengths[: len(chunks)] = [len(c) for c in chunks]
        lengths *= live[: len(lengths)]
        width = buckets.bucket(max(int(lengths.max()), 1), self.chunk_buckets, "chunk length")
        tokens = np.full((batch, width), self.config.pad_id, np.int32)
        for row, chunk in enumerate(chunks):
            if lengths[row]:
                tokens[row, : lengths[row]] = chunk
        return tokens, lengths

    def prefill(self, params: Params, prompts: Sequence[Sequence[int]]) -> SamplerState:
        """A fresh state with every prompt in the cache; all rows live.

        Each distinct prompt is computed once, in the first row that has it (those rows filled
        in one call, padded to the longest: one shape per count of distinct prompts, not per
        split of their lengths); the rows that repeat it (a task's group) copy its slots and
        next-token logits (`copy_prefix`). The same cache as prefilling every row, for one
        computation of a group's prompt instead of one per row.
        """
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("prefill needs at least one prompt and no empty prompt")
        longest = max(len(p) for p in prompts)
        if longest > self.max_cache_len:
            raise ValueError(f"prompt length {longest} exceeds max_cache_len={self.max_cache_len}")
        num_rows = len(prompts)
        batch = buckets.bucket(num_rows, self.batch_buckets, "batch size")
        cache = self._init_cache(batch, self._cache_bucket(longest))
        logits = np.zeros((batch, self._vocab(params, cache)), np.float32)
        state = SamplerState(cache=cache, logits=logits, live=jnp.asarray(np.arange(batch) < num_rows), num_rows=num_rows)
        first: dict[tuple[int, ...], int] = {}  # prompt -> the row that computes it
        for row, prompt in enumerate(prompts):
            first.setdefault(tuple(prompt), row)
        rows = list(first.values())
        state = self._fill_together(params, state, rows, list(first), [True] * len(rows), np.zeros((batch,), np.int64))
        copies = [(first[tuple(p)], row) for row, p in enumerate(prompts) if first[tuple(p)] != row]
        if copies:
            src, dst = (list(x) for x in zip(*copies))
            lengths = [len(prompts[row]) for row in dst]
            state = self.copy_prefix(state, src, dst, lengths, self.row_logits(state, src))
        return state

    def append(
        self,
        params: Params,
        state: SamplerState,
        chunks: Sequence[Sequence[int]],
        live: Sequence[bool] | None = None,
    ) -> tuple[SamplerState, np.ndarray]:
        """Appends each live row's new tokens (e.g. an environment observation) to its history.

        `live [rows]` marks the episodes that go on (default: those still live in `state`);
        the others append nothing and stay out of later turns. Returns the new state and
        `overflow [rows]` bool: live rows whose real tokens would pass `max_cache_len`; those
        rows append nothing and are no longer live, the others append as usual.
        """
        if len(chunks) != state.num_rows:
            raise ValueError(f"expected {state.num_rows} chunks (one per row), got {len(chunks)}")
        batch = state.live.shape[0]
        live_rows = np.asarray(state.live).copy()
        if live is not None:
            if len(live) != state.num_rows:
                raise ValueError(f"expected {state.num_rows} live flags, got {len(live)}")
            live_rows[: state.num_rows] &= np.asarray(live, bool)
        index = np.asarray(state.cache.index)
        lengths = np.zeros((batch,), np.int64)
        lengths[: state.num_rows] = [len(c) for c in chunks]
        overflow = live_rows & (index + lengths * live_rows > self.max_cache_len)
        live_rows &= ~overflow
        tokens, lengths = self._pad_chunks(chunks, live_rows, batch)
        state = state.replace(live=jnp.asarray(live_rows))
        rows = np.flatnonzero(lengths)
        if len(rows) == 0:
            return state, overflow[: state.num_rows]
        state = state.replace(cache=self._ensure_capacity(state.cache, int((index + lengths).max())))
        fewer_rows = len(rows) <= self.fill_buckets[-1] and buckets.bucket(len(rows), self.fill_buckets) < batch
        if fewer_rows:
            state = self._fill_together(params, state, rows.tolist(), [chunks[r] for r in rows], [False] * len(rows), index)
        else:
            state = self._append_in_pieces(params, state, tokens, lengths)
        return state, overflow[: state.num_rows]

    def append_width(self, rows: int) -> int:
        """Tokens of each row one append of `rows` rows computes at most: the widest chunk bucket
        whose rows x width fit in `fill_tokens` (at least the smallest)."""
        return self._within_fill_tokens(self.chunk_buckets, rows)

    def _append_in_pieces(self, params: Params, state: SamplerState, tokens: np.ndarray, lengths: np.ndarray) -> SamplerState:
        """Every row's chunk appended `append_width` columns at a time: a chunk past `fill_tokens`
        is bounded along its tokens, not its rows, so each piece writes every row in place in its
        own shard of the cache (a fill of some rows gathers them: on a sharded mesh, a copy of
        those rows' whole cache on every device)."""
        batch, width = tokens.shape
        piece = min(self.append_width(batch), width)
        pieces = -(-width // piece)
        tokens = np.pad(tokens, ((0, 0), (0, pieces * piece - width)), constant_values=self.config.pad_id)
        cache, logits = state.cache, state.logits
        for start in range(0, pieces * piece, piece):
            part = np.clip(lengths - start, 0, piece).astype(np.int32)
            if part.any():
                cache, logits = self._append(params, cache, logits, tokens[:, start : start + piece], part)
                self.work.observation_tokens_computed += batch * piece
        return state.replace(cache=cache, logits=logits)

    def generate(
        self,
        params: Params,
        state: SamplerState,
        rng: jax.Array,
        limit: Sequence[int] | None = None,
        *,
        seeds: np.ndarray | None = None,
        forced: Sequence[int] | None = None,
        chunk: int | None = None,
    ) -> tuple[SamplerState, TurnOutput]:
        """Samples one turn for every live row; `limit [rows]` optionally lowers max_new_tokens per row.

        `seeds [rows, 2]` (default: (row, 0)) name each row's draws (see `Turn`); `forced [rows]`
        (benchmarks) sets each row's turn length: end-of-turn masked before it, forced at it.
        The turn runs in calls of at most `chunk` decode steps (default: the whole turn), each over
        the rows still sampling (`decode_chunk`): rows that are not live, and rows whose turn
        ended in an earlier call, drop out of the batch where that makes it a smaller bucket.
        """
        width = self.config.max_new_tokens
        batch, rows = state.live.shape[0], state.num_rows
        row_limit = np.full((batch,), width, np.int32)
        if limit is not None:
            if len(limit) != rows:
                raise ValueError(f"expected {rows} token limits, got {len(limit)}")
            row_limit[:rows] = np.minimum(np.asarray(limit, np.int32), width)
        row_seeds = np.stack([np.arange(batch), np.zeros(batch)], axis=1).astype(np.int32)
        if seeds is not None:
            row_seeds[:rows] = np.asarray(seeds, np.int32).reshape(rows, 2)
        row_forced = np.zeros((batch,), np.int32)
        if forced is not None:
            row_forced[:rows] = forced
        turn = Turn.start(np.asarray(state.live), row_limit, row_forced, row_seeds)
        index = np.asarray(state.cache.index)
        state = state.replace(cache=self._ensure_capacity(state.cache, int(index.max()) + width))
        steps = min(chunk or width, width)
        tokens = np.full((batch, width), self.config.pad_id, np.int32)
        logprobs, raw_logprobs = np.zeros((batch, width), np.float32), np.zeros((batch, width), np.float32)
        experts = None
        while turn.active.any():
            before = turn.count
            state, turn, (*arrays, chunk_experts, index) = self.decode_chunk(params, state, turn, rng, steps, index)
            if chunk_experts is not None and experts is None:
                experts = np.full((batch, width, *chunk_experts.shape[2:]), -1, np.int32)
            took = np.arange(steps)[None, :] < (turn.count - before)[:, None]  # [batch, steps]
            row, column = np.nonzero(took)
            for out, a in zip((tokens, logprobs, raw_logprobs, experts), (*arrays, chunk_experts)):
                if out is not None:
                    out[row, before[row] + column] = a[row, column]
        stop, count = turn.stop, turn.count
        out = TurnOutput(
            tokens=tokens[:rows],
            count=count[:rows],
            logprobs=logprobs[:rows],
            raw_logprobs=raw_logprobs[:rows] if self.config.return_raw_logprobs else None,
            stop=stop[:rows],
            experts=None if experts is None else experts[:rows],
        )
        live = jnp.asarray(np.asarray(state.live) & (stop != StopReason.CACHE_FULL))
        return state.replace(live=live), out

    # Slots (continuous batching, `RolloutConfig.num_slots`): a fixed batch of rows, allocated
    # once at max_cache_len, that episodes take turns in. Rows are filled and copied
    # individually, and decoded in chunks of steps over the prefix of rows and slots in use.

    def init_slots(self, params: Params, num_slots: int) -> SamplerState:
        """`num_slots` empty rows (none live) of `max_cache_len` slots each."""
        batch = buckets.bucket(num_slots, self.batch_buckets, "number of slots")
        cache = self._init_cache(batch, self.max_cache_len)
        logits = np.zeros((batch, self._vocab(params, cache)), np.float32)
        return SamplerState(cache=cache, logits=logits, live=jnp.zeros((batch,), bool), num_rows=num_slots)

    def fill(
        self, params: Params, state: SamplerState, rows: Sequence[int], chunks: Sequence[Sequence[int]],
        fresh: Sequence[bool], index: np.ndarray,
    ) -> SamplerState:
        """Appends `chunks[i]` to row `rows[i]` (`fresh[i]`: the row's old tokens are dropped first).

        `index [batch]`: each row's tokens now (host copy of `cache.index`); the caller checks
        that every row fits in `max_cache_len`. A fill costs its rows bucket x chunk bucket x
        slot bucket, so rows are grouped by the chunk bucket of their chunk and the slot bucket
        their tokens need (a short observation is not padded to a long one's width, nor attends
        over a long row's slots), and go at most `fill_rows(width)` at a time.
        """
        kept = np.where(np.asarray(fresh, bool), 0, index[np.asarray(rows, np.int64)])
        groups: dict[tuple[int, int], list[int]] = {}
        for i, chunk in enumerate(chunks):
            width = buckets.bucket(max(len(chunk), 1), self.chunk_buckets, "chunk length")
            groups.setdefault((width, self._cache_bucket(int(kept[i]) + len(chunk))), []).append(i)
        for members in groups.values():
            state = self._fill_together(
                params, state, [rows[i] for i in members], [chunks[i] for i in members], [fresh[i] for i in members], index
            )
        return state

    def _fill_together(self, params, state, rows, chunks, fresh, index) -> SamplerState:
        """`fill` without grouping: the rows in calls of at most `fill_rows(width)` rows, each
        padded to its longest chunk and slots (one shape per count of rows, where grouping by
        length would compile one per split of the lengths)."""
        step = self.fill_rows(buckets.bucket(max(max(len(c) for c in chunks), 1), self.chunk_buckets, "chunk length"))
        for start in range(0, len(rows), step):
            part = slice(start, start + step)
            state = self._fill_part(params, state, rows[part], chunks[part], fresh[part], index)
        return state

    def fill_rows(self, width: int) -> int:
        """Rows one fill of `width`-token chunks computes at most: the largest fill bucket whose
        rows x width fit in `fill_tokens` (at least the smallest). What a fill holds beside the
        cache grows with rows x width x slots (attention over the chunk), so this bounds it the
        way a serving engine bounds the tokens of one prefill batch."""
        return self._within_fill_tokens(self.fill_buckets, width)

    def _within_fill_tokens(self, sizes: Sequence[int], times: int) -> int:
        """The largest of `sizes` (ascending buckets) whose product with `times` fits in
        `fill_tokens`, else the smallest."""
        fitting = [size for size in sizes if size * times <= self.fill_tokens]
        return fitting[-1] if fitting else sizes[0]

    def _fill_part(self, params, state, rows, chunks, fresh, index) -> SamplerState:
        batch = state.live.shape[0]
        k = min(buckets.bucket(len(rows), self.fill_buckets, "rows to fill"), batch)  # (never more rows than the cache)
        row_ids = np.full((k,), batch, np.int32)  # out of range: dropped
        row_ids[: len(rows)] = rows
        row_fresh = np.zeros((k,), bool)
        row_fresh[: len(rows)] = fresh
        tokens, lengths = self._pad_chunks(chunks, np.ones((k,), bool), k)
        kept = np.where(np.asarray(fresh, bool), 0, index[np.asarray(rows)])
        slots = self._cache_bucket(int((kept + lengths[: len(rows)]).max()))
        cache, logits = self._fill(slots, params, state.cache, state.logits, row_ids, row_fresh, tokens, lengths)
        if all(fresh):
            self.work.prompt_tokens_computed += tokens.size
        else:
            self.work.observation_tokens_computed += tokens.size
        return state.replace(cache=cache, logits=logits)

    def row_logits(self, state: SamplerState, rows: Sequence[int]) -> np.ndarray:
        """[len(rows), V] the rows' next-token logits on the host (rows padded to a fill bucket)."""
        k = buckets.bucket(len(rows), self.fill_buckets, "rows")
        row_ids = np.zeros((k,), np.int32)
        row_ids[: len(rows)] = rows
        return np.asarray(self._take_logits(state.logits, row_ids))[: len(rows)]

    def copy_prefix(
        self, state: SamplerState, src: Sequence[int], dst: Sequence[int], lengths: Sequence[int], logits: np.ndarray
    ) -> SamplerState:
        """Row `dst[i]` becomes the first `lengths[i]` tokens of row `src[i]`, with next-token
        logits `logits[i]` (a group's prompt, copied out of a row whose episode went on)."""
        batch = state.live.shape[0]
        k = buckets.bucket(len(dst), self.batch_buckets, "rows to copy")
        row_src, row_dst, row_len = np.zeros((k,), np.int32), np.full((k,), batch, np.int32), np.zeros((k,), np.int32)
        row_src[: len(src)], row_dst[: len(dst)], row_len[: len(dst)] = src, dst, lengths
        row_logits = np.zeros((k, state.logits.shape[1]), np.float32)
        row_logits[: len(dst)] = logits
        cache, logits = self._copy_prefix(state.cache, state.logits, row_src, row_dst, row_len, row_logits)
        return state.replace(cache=cache, logits=logits)

    def decode_chunk(
        self, params: Params, state: SamplerState, turn: Turn, rng: jax.Array, steps: int, index: np.ndarray
    ) -> tuple[SamplerState, Turn, tuple[np.ndarray, ...]]:
        """Up to `steps` decode steps of every active row of `turn` (host arrays [batch]).

        Runs over the active rows only, gathered into a batch of `decode_buckets` rows, and over
        their first slots up to the longest one's tokens (`index [batch]`: each row's tokens) plus
        `steps`, bucketed: rows between turns (waiting on their environment) or free cost
        nothing, and the steps attend over what the rows hold, not over `max_cache_len`. Where
        that is every row and every slot of the cache, the batch decodes in place (nothing to
        gather). Returns the state, the turn (host) and the chunk's (tokens, logprobs, raw_logprobs)
        [batch, steps] (inactive rows: pad_id / 0), with `return_experts` a mixture of experts'
        routing of each sampled token (experts [batch, steps, layers, k], -1 where none; else, or
        for a dense model, None) and every row's index.
        """
        batch = state.live.shape[0]
        active = np.flatnonzero(turn.active)
        k = min(buckets.bucket(len(active), self.decode_buckets), batch) if len(active) <= self.decode_buckets[-1] else batch
        slots = self._cache_bucket(int(index[active].max()) + steps)
        count = turn.count
        forcing = bool(np.any(turn.forced[active]))
        if k >= batch and slots >= state.cache.max_len:
            k, active = batch, np.arange(batch)
            cache, logits, turn, arrays = self._decode(steps, forcing, params, state.cache, state.logits, turn, rng)
        else:
            rows = np.full((k,), batch, np.int32)  # out of range: padding
            rows[: len(active)] = active
            cache, logits, turn, arrays = self._decode_rows(
                steps, forcing, slots, params, state.cache, state.logits, turn, rng, rows
            )
        turn = Turn(*(np.array(x) for x in turn))  # writable: the caller starts turns in it
        self.work.add_decode(k, turn.count - count)
        out = []
        for a, fill in zip(arrays, (self.config.pad_id, 0, 0, -1)):
            if a is None:  # a dense model's routing
                out.append(None)
                continue
            a = np.asarray(a)
            full = np.full((batch, *a.shape[1:]), fill, a.dtype)
            full[active] = a[: len(active)]
            out.append(full)
        return state.replace(cache=cache, logits=logits), turn, (*out, np.asarray(cache.index))
