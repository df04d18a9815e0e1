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
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
from typing import Any, Protocol

import jax
import numpy as np

from agentgym_jax.sampling.sampler import Sampler, StopReason, Turn


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


@dataclasses.dataclass(eq=False)
class _Request:
    holder: RowHolder
    chunk: tuple[int, ...]  # ids to append before sampling (the history too, for a row rebuilt)
    limit: int
    turn: int
    done: asyncio.Future
    ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)


class Batcher:
    """Samples turns of many conversations on one sampler; `run()` is its loop (a task)."""

    def __init__(self, sampler: Sampler, params: Any, num_rows: int, decode_chunk: int, rng: jax.Array):
        self.sampler, self.params, self.rng, self.decode_steps = sampler, sampler.sampling_params(params), rng, decode_chunk
        self.num_rows = num_rows
        self.state = None  # the rows, made by the loop (`init_slots`)
        self.index: np.ndarray | None = None  # host copy of each row's token count
        self.holders: list[RowHolder | None] = [None] * num_rows
        self.waiting: collections.deque[_Request] = collections.deque()
        self.active: dict[int, _Request] = {}  # row -> its turn in progress
        self.wake = asyncio.Event()
        self.failure: Exception | None = None
        self.rebuilds = 0  # rows filled with a conversation's whole history (it had lost its row)

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

    async def run(self) -> None:
        """The loop: admit waiting requests into rows, fill them, decode a chunk, repeat."""
        try:
            self.state = await asyncio.to_thread(self.sampler.init_slots, self.params, self.num_rows)
            batch = self.state.live.shape[0]
            self.index = np.zeros((batch,), np.int64)
            self.turn = Turn.start(np.zeros((batch,), bool), np.zeros((batch,), np.int32))
            while True:
                self.wake.clear()  # before admitting: a request queued from now on wakes the wait below
                admitted = self._admit()
                if admitted:
                    await self._start(admitted)
                if self.turn.active.any():
                    await self._decode()
                elif not admitted:
                    await self.wake.wait()
        except Exception as e:  # every caller hears of it; later ones at once
            self.failure = e
            for request in [*self.waiting, *self.active.values()]:
                _fail(request.done, RuntimeError(f"the sampler failed: {e!r}"))
            raise

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
        self.state = await asyncio.to_thread(
            self.sampler.fill, self.params, self.state, rows, [r.chunk for r in fits], fresh, self.index.copy()
        )
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
        self.state, self.turn, (tokens, _, raw_logprobs, index) = await asyncio.to_thread(
            self.sampler.decode_chunk, self.params, self.state, self.turn, self.rng, self.decode_steps, self.index.copy()
        )
        for row in rows:
            request = self.active[row]
            n = int(self.turn.count[row] - count[row])
            request.ids += tokens[row, :n].tolist()
            request.logprobs += raw_logprobs[row, :n].tolist()
            self.index[row] = index[row]
            if not self.turn.active[row]:
                del self.active[row]
                if not request.done.done():
                    request.done.set_result(SampledTurn(np.asarray(request.ids, np.int32),
                                                        np.asarray(request.logprobs, np.float32),
                                                        StopReason(int(self.turn.stop[row]))))


def _fail(future: asyncio.Future, error: Exception) -> None:
    if not future.done():
        future.set_exception(error)
