"""Jitted KV-cache generation with multi-turn continuation.

Two pure functions do the work, both over the `KVCache` contract (`models/cache.py`):
- `append_chunk`: writes a right-padded chunk of new tokens (a prompt, or each episode's new
  environment tokens) into the cache in one forward pass. Each row's positions continue from
  `cache.next_positions()`; padding gets position -1, so it is never attended to.
- `decode`: samples one turn in a `lax.while_loop`. Every step feeds the token it sampled back
  through the model; rows that are done write padding (position -1). The loop stops as soon as
  every row is done, so a batch costs as many steps as its longest turn.

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
    CACHE_FULL = 3  # the cache reached `max_cache_len` mid-turn; the row is no longer live


@flax.struct.dataclass
class SamplerState:
    """What the sampler carries between turns for a batch of episodes."""

    cache: KVCache  # [.., batch_bucket, cache_bucket, ..]
    logits: jax.Array  # [batch_bucket, vocab] float32: next-token logits of each row
    live: jax.Array  # [batch_bucket] bool: rows whose episode goes on
    num_rows: int = flax.struct.field(pytree_node=False)  # rows the caller has (<= batch_bucket)


class TurnOutput(NamedTuple):
    """One sampled turn, on the host, for the caller's rows."""

    tokens: np.ndarray  # [rows, max_new_tokens] int32; pad_id after `count`
    count: np.ndarray  # [rows] int32: tokens sampled (an end-of-turn id included)
    logprobs: np.ndarray  # [rows, max_new_tokens] float32 under the sampling distribution; 0 after count
    raw_logprobs: np.ndarray | None  # same at the temperature, unfiltered (if asked for)
    stop: np.ndarray  # [rows] int32 StopReason


class _DecodeCarry(NamedTuple):
    step: jax.Array  # [] int32
    cache: KVCache
    logits: jax.Array  # [batch, vocab]
    active: jax.Array  # [batch] bool: still sampling this turn
    next_positions: jax.Array  # [batch] int32
    count: jax.Array  # [batch] int32
    stop: jax.Array  # [batch] int32
    tokens: jax.Array  # [batch, max_new]
    logprobs: jax.Array  # [batch, max_new]
    raw_logprobs: jax.Array  # [batch, max_new]


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
    last, cache = step_fn(params, tokens, positions, cache, jnp.maximum(lengths - 1, 0))  # [B, V]
    return cache, jnp.where((lengths > 0)[:, None], last, logits)


def decode(
    step_fn: StepFn,
    config: SamplingConfig,
    loop_params_fn: LoopParamsFn | None,
    params: Params,
    cache: KVCache,
    logits: jax.Array,
    live: jax.Array,
    limit: jax.Array,
    rng: jax.Array,
) -> tuple[KVCache, jax.Array, jax.Array, tuple[jax.Array, ...]]:
    """Samples one turn for the `live [B]` rows, each up to `limit [B]` (<= max_new_tokens) tokens.

    Returns the cache (every sampled token written), the next-token logits, the updated live mask
    (rows that hit CACHE_FULL drop out) and (tokens, count, logprobs, raw_logprobs, stop).
    `loop_params_fn` reshapes the params once, before the loop, into what every step reads.
    """
    if loop_params_fn is not None:
        params = loop_params_fn(params)
    batch, width = logits.shape[0], config.max_new_tokens
    eot_ids = jnp.asarray(config.eot_ids or (-1,), jnp.int32)
    limit = jnp.minimum(limit, width)
    buffer = jnp.zeros((batch, width), jnp.float32)

    def cond(c: _DecodeCarry) -> jax.Array:
        return jnp.any(c.active) & (c.step < width) & (c.cache.index < c.cache.max_len)

    def body(c: _DecodeCarry) -> _DecodeCarry:
        s = sample(jax.random.fold_in(rng, c.step), c.logits, config)
        tok = jnp.where(c.active, s.tokens, config.pad_id)  # [B]
        positions = jnp.where(c.active, c.next_positions, -1)
        out, cache = step_fn(params, tok[:, None], positions[:, None], c.cache, jnp.zeros_like(tok))
        count = c.count + c.active
        at_eot = c.active & jnp.isin(tok, eot_ids)
        at_limit = c.active & (count >= limit)
        stop = jnp.where(at_eot, StopReason.END_OF_TURN, c.stop)
        stop = jnp.where(at_limit & ~at_eot, StopReason.TOKEN_LIMIT, stop)
        column = lambda buf, x: buf.at[:, c.step].set(jnp.where(c.active, x, 0).astype(buf.dtype))
        return _DecodeCarry(
            step=c.step + 1,
            cache=cache,
            logits=jnp.where(c.active[:, None], out, c.logits),
            active=c.active & ~at_eot & ~at_limit,
            next_positions=c.next_positions + c.active,
            count=count,
            stop=stop,
            tokens=c.tokens.at[:, c.step].set(tok),
            logprobs=column(c.logprobs, s.logprobs),
            raw_logprobs=(
                column(c.raw_logprobs, s.raw_logprobs) if config.return_raw_logprobs else c.raw_logprobs
            ),
        )

    start = _DecodeCarry(
        step=jnp.zeros((), jnp.int32),
        cache=cache,
        logits=logits,
        active=live & (limit > 0),
        next_positions=cache.next_positions(),
        count=jnp.zeros((batch,), jnp.int32),
        stop=jnp.where(live, StopReason.TOKEN_LIMIT, StopReason.NOT_LIVE).astype(jnp.int32),
        tokens=jnp.full((batch, width), config.pad_id, jnp.int32),
        logprobs=buffer,
        raw_logprobs=buffer,
    )
    c = jax.lax.while_loop(cond, body, start)
    stop = jnp.where(c.active, StopReason.CACHE_FULL, c.stop)
    live = live & (stop != StopReason.CACHE_FULL)
    return c.cache, c.logits, live, (c.tokens, c.count, c.logprobs, c.raw_logprobs, stop)


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


def _jit(shardings: SamplerShardings | None, fn: Callable, ins: tuple, outs: Any, **kw) -> Callable:
    """`jax.jit(fn)`, with in/out shardings named by role ("params", "cache", "batch", ...) if sharded."""
    if shardings is None:
        return jax.jit(fn, **kw)
    place = lambda role: jax.tree.map(
        lambda r: shardings.replicated if r == "replicated" else getattr(shardings, r), role
    )
    return jax.jit(
        fn, in_shardings=tuple(place(r) for r in ins if r != "static"), out_shardings=place(outs), **kw
    )


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
    and cache lengths are rounded up to buckets (default: powers of two), so only a new bucket
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
    ):
        self.config = config
        self.shardings = shardings
        self._sampling_params_fn = sampling_params_fn
        self.max_cache_len = max_cache_len
        row_shards = shardings.row_shards if shardings else 1
        self.batch_buckets = buckets.check_buckets(
            "batch_buckets", batch_buckets or tuple(row_shards * 2**i for i in range(11))
        )
        if any(b % row_shards for b in self.batch_buckets):
            raise ValueError(f"batch_buckets {self.batch_buckets} must be multiples of the {row_shards} row shards")
        self.chunk_buckets = buckets.check_buckets(
            "chunk_buckets", chunk_buckets or buckets.powers_of_two(16, max_cache_len)
        )
        self.cache_buckets = buckets.check_buckets(
            "cache_buckets", cache_buckets or buckets.powers_of_two(min(128, max_cache_len), max_cache_len)
        )
        if self.cache_buckets[-1] != max_cache_len:
            raise ValueError(f"the last cache bucket must be max_cache_len={max_cache_len}, got {self.cache_buckets}")
        self._step = step_fn
        self._vocab_size: int | None = None
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
        self._decode = jit(
            functools.partial(decode, step_fn, config, loop_params_fn),
            ("params", "cache", "batch", "batch", "batch", "replicated"),
            ("cache", "batch", "batch", ("batch",) * 5),
            donate_argnums=(1, 2),
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
        **buckets_kw,
    ) -> Sampler:
        """A sampler over `models.decoder` (compute `dtype`: default the parameters' dtype).

        The KV cache is kept in `cache_dtype`, by default the compute dtype (float32 without one).
        With a compute `dtype`, `sampling_params` gives the policy's weights (no value head) in
        that dtype: a copy when they are stored in another one (float32 master weights), the same
        arrays otherwise.
        """
        step_fn = decoder_step(model_config, dtype=dtype, activation_sharding=shardings.batch if shardings else None)
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
        **buckets_kw,
    ) -> Sampler:
        """`for_decoder` laid out on `mesh` the project's way (`SamplerShardings.for_mesh`), with
        its weights and KV cache in the compute `dtype`: what a job samples with."""
        dtype = jnp.dtype(dtype)
        weights = jax.eval_shape(functools.partial(decoder.init_params, model_config, param_dtype=dtype), jax.random.key(0))
        return cls.for_decoder(
            model_config, config, max_cache_len=max_cache_len, dtype=dtype, cache_dtype=dtype,
            shardings=SamplerShardings.for_mesh(mesh, weights, model_config), **buckets_kw,
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
        lengths *= live
        width = buckets.bucket(max(int(lengths.max()), 1), self.chunk_buckets, "chunk length")
        tokens = np.full((batch, width), self.config.pad_id, np.int32)
        for row, chunk in enumerate(chunks):
            if lengths[row]:
                tokens[row, : lengths[row]] = chunk
        return tokens, lengths

    def prefill(self, params: Params, prompts: Sequence[Sequence[int]]) -> SamplerState:
        """A fresh state with every prompt in the cache; all rows live."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("prefill needs at least one prompt and no empty prompt")
        num_rows = len(prompts)
        batch = buckets.bucket(num_rows, self.batch_buckets, "batch size")
        live = np.arange(batch) < num_rows
        tokens, lengths = self._pad_chunks(prompts, live, batch)
        if tokens.shape[1] > self.max_cache_len:
            raise ValueError(f"prompt bucket {tokens.shape[1]} exceeds max_cache_len={self.max_cache_len}")
        cache = self._init_cache(batch, self._cache_bucket(tokens.shape[1]))
        logits = np.zeros((batch, self._vocab(params, cache)), np.float32)
        cache, logits = self._append(params, cache, logits, tokens, lengths)
        return SamplerState(cache=cache, logits=logits, live=jnp.asarray(live), num_rows=num_rows)

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
        `overflow [rows]` bool: live rows whose tokens did not fit in `max_cache_len` (all rows
        share the write pointer, and the chunk takes its padded bucket width). On overflow the
        cache is left as it was and those rows are no longer live.
        """
        if len(chunks) != state.num_rows:
            raise ValueError(f"expected {state.num_rows} chunks (one per row), got {len(chunks)}")
        batch = state.live.shape[0]
        live_rows = np.asarray(state.live).copy()
        if live is not None:
            if len(live) != state.num_rows:
                raise ValueError(f"expected {state.num_rows} live flags, got {len(live)}")
            live_rows[: state.num_rows] &= np.asarray(live, bool)
        tokens, lengths = self._pad_chunks(chunks, live_rows, batch)
        needed = int(state.cache.index) + tokens.shape[1]
        if needed > self.max_cache_len:
            overflow = live_rows[: state.num_rows].copy()
            return state.replace(live=jnp.zeros_like(state.live)), overflow
        cache = self._ensure_capacity(state.cache, needed)
        cache, logits = self._append(params, cache, state.logits, tokens, lengths)
        no_overflow = np.zeros((state.num_rows,), bool)
        return state.replace(cache=cache, logits=logits, live=jnp.asarray(live_rows)), no_overflow

    def generate(
        self,
        params: Params,
        state: SamplerState,
        rng: jax.Array,
        limit: Sequence[int] | None = None,
    ) -> tuple[SamplerState, TurnOutput]:
        """Samples one turn for every live row; `limit [rows]` optionally lowers max_new_tokens per row."""
        width = self.config.max_new_tokens
        batch = state.live.shape[0]
        row_limit = np.full((batch,), width, np.int32)
        if limit is not None:
            if len(limit) != state.num_rows:
                raise ValueError(f"expected {state.num_rows} token limits, got {len(limit)}")
            row_limit[: state.num_rows] = np.minimum(np.asarray(limit, np.int32), width)
        cache = self._ensure_capacity(state.cache, int(state.cache.index) + width)
        cache, logits, live, arrays = self._decode(params, cache, state.logits, state.live, row_limit, rng)
        tokens, count, logprobs, raw_logprobs, stop = (np.asarray(a)[: state.num_rows] for a in arrays)
        turn = TurnOutput(
            tokens=tokens,
            count=count,
            logprobs=logprobs,
            raw_logprobs=raw_logprobs if self.config.return_raw_logprobs else None,
            stop=stop,
        )
        return state.replace(cache=cache, logits=logits, live=live), turn
