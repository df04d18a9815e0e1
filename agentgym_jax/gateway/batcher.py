"""Continuous batching of conversation turns over the sampler's rows, with KV continuation.

The sampler holds `num_rows` rows of KV cache (`Sampler.init_slots`). A conversation keeps its
row between requests, so a turn appends only the new ids (the tool results, a user message) to
what the row holds and samples; the history is never computed again. A conversation without a
row (new, or one whose row went to another) gets a free row, else the row of the conversation
idle longest, and its whole token sequence is filled in again: the ids are kept token-exact in
its transcript, so the rebuilt cache is the one it had. Turns of different conversations decode
together in chunks of `decode_chunk` steps (`Sampler.decode_chunk`); a request that finds every
row busy waits for one.

A turn's n-th token is drawn with the key folded from (`rng`, conversation number, turn, n), so
a conversation's samples do not depend on which others share its chunks.

Weights are swapped in place (`publish`, an RL job's update): before each fill or decode chunk
the loop takes the newest published weights, so a turn in flight goes on with them, and every
sampled token carries the version that drew it (`SampledTurn.versions`). Rows keep the keys and
values computed so far (as the episode stream does, `rollout/stream.py`): a token's log-prob is
what the sampler computed when it drew it, the behaviour policy a decoupled correction needs.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import jax
import numpy as np

from agentgym_jax.rollout.stream import PolicyWeights, StreamTimes
from agentgym_jax.sampling.sampler import Sampler, StopReason, Turn


_RUNNING = threading.local()  # (batcher, label) of the sampler call a worker thread is making


class ContextTooLong(ValueError):
    """The conversation's ids do not fit in a row (`max_cache_len`)."""


class RowHolder(Protocol):
    """What the batcher needs of a conversation."""

    number: int  # seeds its draws
    row: int | None  # the row holding its cache, None when none does
    token_ids: list[int]  # every id of the conversation so far (what a rebuilt row is filled with)
    last_used: float


@dataclasses.dataclass(frozen=True)
class SampledTurn:
    ids: np.ndarray  # [n] int32, the end-of-turn id included if one was sampled
    logprobs: np.ndarray  # [n] float32: unfiltered, at the sampling temperature (what the trainer recomputes)
    stop: StopReason
    versions: np.ndarray  # [n] int32: the policy version that drew each id


@dataclasses.dataclass(eq=False)
class _Request:
    holder: RowHolder
    chunk: tuple[int, ...]  # ids to append before sampling (the history too, for a row rebuilt)
    limit: int
    turn: int
    done: asyncio.Future
    ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)


class Batcher:
    """Samples turns of many conversations on one sampler; `run()` is its loop (a task).

    `weights`: where the newest weights are published (by `publish`, or by an RL job's stream
    that holds the same `PolicyWeights`); `times`: where sampler time goes (busy) and idle time
    while conversations are open (waiting on their agents)."""

    def __init__(self, sampler: Sampler, weights: PolicyWeights, num_rows: int, decode_chunk: int, rng: jax.Array,
                 times: StreamTimes | None = None):
        self.sampler, self.rng, self.decode_steps = sampler, rng, decode_chunk
        self.weights, self.times = weights, times or StreamTimes()
        self.version, self.params = None, None  # what the rows sample with now (`_take_newest`)
        self.num_rows = num_rows
        self.state = None  # the rows, made by the loop (`init_slots`)
        self.index: np.ndarray | None = None  # host copy of each row's token count
        self.holders: list[RowHolder | None] = [None] * num_rows
        self.waiting: collections.deque[_Request] = collections.deque()
        self.active: dict[int, _Request] = {}  # row -> its turn in progress
        self.wake = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self.failure: Exception | None = None
        self.rebuilds = 0  # rows filled with a conversation's whole history (it had lost its row)

    def publish(self, params: Any, version: int) -> None:
        """(any thread) New weights for every later fill and decode chunk, turns in flight included."""
        self.weights.publish(params, version)
        self.notify()

    def notify(self) -> None:
        """(any thread) Look at the published weights now."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self.wake.set)

    async def sample(self, holder: RowHolder, new_ids: tuple[int, ...], limit: int, turn: int) -> SampledTurn:
        """Samples the conversation's next turn of at most `limit` ids after `new_ids`, which the
        caller has appended to `holder.token_ids` already."""
        if self.failure is not None:
            raise RuntimeError(f"the sampler failed: {self.failure!r}")
        request = _Request(holder, tuple(new_ids), limit, turn, asyncio.get_running_loop().create_future())
        self.waiting.append(request)
        self.wake.set()
        return await request.done

    def release(self, holder: RowHolder) -> None:
        """The conversation is over (or put aside): its row is free for another."""
        if holder.row is not None and self.holders[holder.row] is holder:
            self.holders[holder.row] = None
            self.index[holder.row] = 0
        holder.row = None

    @property
    def busy_rows(self) -> int:
        return len(self.active)

    async def run(self, warmup: Callable[[Batcher], Awaitable[None]] | None = None) -> None:
        """The loop: admit waiting requests into rows, fill them, decode a chunk, repeat
        (after `warmup(self)`, which may compile the shapes to come)."""
        self._loop = asyncio.get_running_loop()
        try:
            while self.weights.newest()[1] is None:  # an RL job's gateway, before its first weights
                await self.wake.wait()
                self.wake.clear()
            await self._take_newest()
            self.state = await asyncio.to_thread(self.sampler.init_slots, self.params, self.num_rows)
            batch = self.state.live.shape[0]
            self.index = np.zeros((batch,), np.int64)
            self.turn = Turn.start(np.zeros((batch,), bool), np.zeros((batch,), np.int32))
            if warmup is not None:
                await warmup(self)
            while True:
                self.wake.clear()  # before admitting: a request queued from now on wakes the wait below
                await self._take_newest()
                admitted = self._admit()
                if admitted:
                    await self._start(admitted)
                if self.turn.active.any():
                    await self._decode()
                elif not admitted:
                    idle = time.monotonic()
                    await self.wake.wait()
                    self.times.env_wait_s += time.monotonic() - idle
        except Exception as e:  # every caller hears of it; later ones at once
            self.failure = e
            for request in [*self.waiting, *self.active.values()]:
                _fail(request.done, RuntimeError(f"the sampler failed: {e!r}"))
            raise

    def close(self) -> None:
        """(after `run` has stopped) Drops the rows and the weights' copy now: the KV cache of a
        gateway that served its episodes is freed at once, not whenever the gateway is collected."""
        self.state = self.params = self.version = None

    async def _take_newest(self) -> None:
        version, params = self.weights.newest()
        if version != self.version:
            self.params = await asyncio.to_thread(self.sampler.sampling_params, params)
            self.version = version

    async def call(self, label: str, fn: Callable, *args: Any) -> Any:
        """`fn(*args)` on a worker thread, its time counted busy; `running()` names it there."""
        start = time.monotonic()
        try:
            return await asyncio.to_thread(self._labelled, label, fn, *args)
        finally:
            self.times.busy_s += time.monotonic() - start

    def _labelled(self, label: str, fn: Callable, *args: Any) -> Any:
        _RUNNING.call = (self, label)
        try:
            return fn(*args)
        finally:
            _RUNNING.call = None

    def running(self) -> str:
        """(on any thread) What this batcher runs on the current thread ("" for anything else):
        how a compilation is named in the gateway's log."""
        call = getattr(_RUNNING, "call", None)
        return call[1] if call is not None and call[0] is self else ""

    def _admit(self) -> list[_Request]:
        """Waiting requests that get a row now: their own, a free one, or an idle conversation's."""
        admitted = []
        while self.waiting:
            request = self.waiting[0]
            row = request.holder.row
            if row is None or self.holders[row] is not request.holder:
                row = self._free_row(taken={r.holder.row for r in admitted})
                if row is None:
                    break
                self.holders[row], request.holder.row = request.holder, row
                self.rebuilds += len(request.holder.token_ids) > len(request.chunk)
                request.chunk = tuple(request.holder.token_ids)  # rebuilt whole: history and new ids
                self.index[row] = 0
            self.waiting.popleft()
            admitted.append(request)
        return admitted

    def _free_row(self, taken: set[int]) -> int | None:
        empty = [row for row, holder in enumerate(self.holders) if holder is None]
        if empty:
            return empty[0]
        waiting = {id(r.holder) for r in self.waiting}
        idle = [row for row, holder in enumerate(self.holders)
                if row not in self.active and row not in taken and id(holder) not in waiting]
        if not idle:
            return None
        row = min(idle, key=lambda r: self.holders[r].last_used)
        self.holders[row].row = None  # put aside: rebuilt from its ids when it comes back
        self.holders[row] = None
        return row

    async def _start(self, admitted: list[_Request]) -> None:
        """Appends the admitted requests' ids to their rows and starts their turns."""
        fits = []
        for request in admitted:
            held = int(self.index[request.holder.row]) + len(request.chunk)
            if held >= self.sampler.max_cache_len:
                self.release(request.holder)
                _fail(request.done, ContextTooLong(
                    f"the conversation holds {held} tokens; a row holds {self.sampler.max_cache_len} "
                    "(rollout.max_cache_len), with room for at least one more"))
            else:
                fits.append(request)
        if not fits:
            return
        rows = [r.holder.row for r in fits]
        fresh = [bool(self.index[row] == 0) for row in rows]
        longest = max(len(r.chunk) for r in fits)
        self.state = await self.call(
            f"fill of {len(rows)} rows, {longest} tokens", self.sampler.fill, self.params, self.state, rows,
            [r.chunk for r in fits], fresh, self.index.copy())
        self.index[rows] += [len(r.chunk) for r in fits]
        for request, row in zip(fits, rows):
            self.active[row] = request
            self.turn.active[row] = True
            self.turn.count[row] = 0
            self.turn.limit[row] = min(request.limit, self.sampler.max_cache_len - int(self.index[row]))
            self.turn.forced[row] = 0
            self.turn.seeds[row] = (request.holder.number, request.turn)
            self.turn.stop[row] = StopReason.TOKEN_LIMIT

    async def _decode(self) -> None:
        """One chunk of decode steps; the turns that ended answer their requests."""
        rows = np.flatnonzero(self.turn.active)
        count = self.turn.count.copy()
        self.state, self.turn, (tokens, _, raw_logprobs, _, index) = await self.call(
            f"decode of {len(rows)} rows at {int(self.index[rows].max())} tokens", self.sampler.decode_chunk,
            self.params, self.state, self.turn, self.rng, self.decode_steps, self.index.copy())
        for row in rows:
            request = self.active[row]
            n = int(self.turn.count[row] - count[row])
            request.ids += tokens[row, :n].tolist()
            request.logprobs += raw_logprobs[row, :n].tolist()
            request.versions += [self.version] * n
            self.index[row] = index[row]
            if not self.turn.active[row]:
                del self.active[row]
                if not request.done.done():
                    request.done.set_result(SampledTurn(np.asarray(request.ids, np.int32),
                                                        np.asarray(request.logprobs, np.float32),
                                                        StopReason(int(self.turn.stop[row])),
                                                        np.asarray(request.versions, np.int32)))


def _fail(future: asyncio.Future, error: Exception) -> None:
    if not future.done():
        future.set_exception(error)


def warmup_lengths(sampler: Sampler, tokens: int) -> list[int]:
    """The first-prompt lengths whose shapes `warm_up` compiles: one per chunk bucket up to
    `tokens` (so a prompt of up to `tokens` ids finds its fill and decode compiled)."""
    limit = min(tokens, sampler.max_cache_len - 1)
    return [b for b in sampler.chunk_buckets if b <= limit] or ([limit] if limit > 0 else [])


async def warm_up(batcher: Batcher, lengths: list[int], on_shape: Callable[[int], None]) -> None:
    """Compiles what the first turns of conversations run: for each prompt length, the fill of one
    row and a decode chunk over it, then a decode chunk over every row; the rows are left free.
    `on_shape(done)` hears the count after each."""
    row, steps = 0, batcher.decode_steps
    for done, length in enumerate(lengths, 1):
        batcher.state = await batcher.call(f"warm-up fill of 1 row, {length} tokens", batcher.sampler.fill,
                                           batcher.params, batcher.state, [row], [[0] * length], [True], batcher.index.copy())
        batcher.index[row] = length
        await _warm_decode(batcher, [row], steps)
        on_shape(done)
    rows = list(range(batcher.num_rows))
    batcher.state = await batcher.call(f"warm-up fill of {len(rows)} rows", batcher.sampler.fill, batcher.params,
                                       batcher.state, rows, [[0]] * len(rows), [True] * len(rows), batcher.index.copy())
    batcher.index[rows] = 1
    await _warm_decode(batcher, rows, steps)
    batcher.index[:] = 0
    on_shape(len(lengths) + 1)


async def _warm_decode(batcher: Batcher, rows: list[int], steps: int) -> None:
    turn = batcher.turn
    turn.active[:] = False
    turn.active[rows], turn.count[rows], turn.forced[rows], turn.limit[rows] = True, 0, 0, steps
    turn.seeds[rows] = (0, 0)
    label = f"warm-up decode of {len(rows)} rows at {int(batcher.index[rows].max())} tokens"
    batcher.state, batcher.turn, _ = await batcher.call(label, batcher.sampler.decode_chunk, batcher.params, batcher.state,
                                                        turn, batcher.rng, steps, batcher.index.copy())
    batcher.turn.active[:] = False
