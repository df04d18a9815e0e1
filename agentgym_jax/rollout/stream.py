"""A stream of episode groups played with the newest weights: the sampler of asynchronous RL.

    weights = PolicyWeights(params, version=0)          # the trainer publishes each update here
    stream = GroupStream(engine, weights, rng)
    future = engine.submit(stream.play(feed, emit))     # in the background; or engine.run-style, to the end
    ...
    weights.publish(new_params, version=1); stream.wake()

`feed()` (called on the engine's loop) returns the groups to start now (`GroupSpec`: a task, its
horizon, its number in the run), `[]` for none yet, or None when no more will come; `emit(group)`
hears each group once all of its episodes ended (`PlayedGroup`). The continuous-batching engine
(`rollout.num_slots` rows, `engine._SlotRollout`) plays them: a group's episodes are reset as soon
as it is fed and take sampler rows as rows free up, so groups of several RL steps are in flight at
once and no row waits for another step's slowest episode.

Partial rollouts: before each sampler call the stream takes the newest published weights, so an
episode in flight when an update lands continues with them. Every sampled token records the
version that drew it (`Trajectory.token_versions`) and its log-prob under the weights that drew
it, which is the behaviour policy the decoupled-PPO / TIS correction needs; the key/value cache
of its earlier tokens is kept (AReaL recomputes it), so behaviour is what the sampler computed,
exactly. A trajectory's `policy_version` is the version of its oldest token.

Draws: episode j of group g (attempt a) folds `(rng, g * group_size + j + a * RESAMPLE_STRIDE,
turn, n)` for its n-th token of a turn, as `RolloutEngine.run(..., group_offset=g)` numbers its
episodes: a stream fed with fixed weights plays the tokens a run of the same groups plays.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import threading
import time
from collections.abc import Callable
from typing import Any

import jax

from agentgym_jax.rollout.engine import RolloutEngine, _LiveEpisode, _SlotRollout
from agentgym_jax.rollout.trajectory import Trajectory

RESAMPLE_STRIDE = 1 << 24  # episode numbers of a resampled group's attempts: above every first attempt's


@dataclasses.dataclass(frozen=True)
class GroupSpec:
    """One group to play: `group_size` episodes of one task."""

    index: int  # the group's number in the run, over every process: its draws, its place in the data
    task_id: int
    horizon: int
    attempt: int = 0  # > 0: played again after being dropped as too stale (new draws)


@dataclasses.dataclass(frozen=True)
class PlayedGroup:
    spec: GroupSpec
    trajectories: list[Trajectory]

    @property
    def oldest_version(self) -> int:
        """The policy version of the group's oldest sampled token (its staleness is measured from it)."""
        return min(t.policy_version for t in self.trajectories)


class PolicyWeights:
    """The newest weights the sampler may read and their version (updates applied), handed from
    the trainer's thread to the sampler's. Publish weights that no update will donate (a copy)."""

    def __init__(self, params: Any, version: int = 0):
        self._lock = threading.Lock()
        self._params, self._version = params, version

    def publish(self, params: Any, version: int) -> None:
        with self._lock:
            self._params, self._version = params, version

    def newest(self) -> tuple[int, Any]:
        with self._lock:
            return self._version, self._params


@dataclasses.dataclass
class StreamTimes:
    """Where the sampler's wall time went, accumulated (seconds); read from any thread."""

    busy_s: float = 0.0  # sampler calls
    env_wait_s: float = 0.0  # nothing to sample: every live episode waits on its environment
    starved_s: float = 0.0  # nothing to sample: no episode live (the staleness bound holds new groups back)


class GroupStream(_SlotRollout):
    """Plays fed groups until `feed` says no more and every group has ended, or until `stop()`."""

    def __init__(self, engine: RolloutEngine, weights: PolicyWeights, rng: jax.Array, times: StreamTimes | None = None):
        if not engine.config.num_slots:
            raise ValueError("a stream of groups needs continuous batching: rollout.num_slots > 0")
        version, params = weights.newest()
        super().__init__(engine, engine.sampler.sampling_params(params), rng, version)
        self.weights = weights
        self.times = times or StreamTimes()  # several streams of one run may add to the same
        self.episodes: dict[int, _LiveEpisode] = {}  # pool slot -> live episode
        self._groups: dict[tuple[int, int], tuple[GroupSpec, list[_LiveEpisode], int]] = {}  # ..., version at start
        self._slots = itertools.count()
        self._resets: set[asyncio.Task] = set()
        self._stopped = False
        self._loop: asyncio.AbstractEventLoop | None = None

    def wake(self) -> None:
        """(any thread) Look again at `feed` and the weights now, not at the next arrival."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self.arrived.set)

    def stop(self) -> None:
        """(any thread) Ends `play` at its next turn of the loop; episodes in flight are abandoned."""
        self._stopped = True
        self.wake()

    async def play(self, feed: Callable[[], list[GroupSpec] | None], emit: Callable[[PlayedGroup], None]) -> None:
        self._loop = asyncio.get_running_loop()
        if self.engine.task_info is None:
            self.engine.task_info = await self.engine.pool.tasks()
        closed = False
        try:
            await self._start_slots()
            while not self._stopped:
                await self._take_newest_weights()
                if not closed:
                    specs = feed()
                    closed = specs is None
                    for spec in specs or ():
                        self._start_group(spec)
                await self._emit_ended(emit)
                if closed and not self._groups:
                    break
                busy = time.monotonic()
                if await self._tick():
                    self.times.busy_s += time.monotonic() - busy
                else:
                    start, waiting_on_env = time.monotonic(), bool(self.in_flight or self._resets)
                    await self._next_arrival(None)
                    elapsed = time.monotonic() - start
                    if waiting_on_env:
                        self.times.env_wait_s += elapsed
                    else:
                        self.times.starved_s += elapsed
                if self.failure is not None:
                    raise self.failure
        finally:
            for task in self.steps | self._resets:  # left over when stopped or something raised
                task.cancel()
            await self.engine.pool.close_sessions()

    async def _take_newest_weights(self) -> None:
        version, params = self.weights.newest()
        if version != self.version:
            self.params = await asyncio.to_thread(self.sampler.sampling_params, params)
            self.version = version

    def _start_group(self, spec: GroupSpec) -> None:
        n = self.config.group_size
        episodes = [
            _LiveEpisode(slot=next(self._slots), task_id=spec.task_id, group_id=spec.index, sample_idx=j,
                         seed=spec.index * n + j + spec.attempt * RESAMPLE_STRIDE, horizon=spec.horizon)
            for j in range(n)
        ]
        self.episodes.update((ep.slot, ep) for ep in episodes)
        self._groups[(spec.index, spec.attempt)] = (spec, episodes, self.version)
        task = asyncio.create_task(self._reset_group(episodes))
        self._resets.add(task)
        task.add_done_callback(self._resets.discard)

    async def _reset_group(self, episodes: list[_LiveEpisode]) -> None:
        """Resets a group's episodes; those whose reset answered wait for sampler rows."""
        try:
            pool, tools = self.engine.pool, self.config.tool_calls
            results = await asyncio.gather(*(self._timed(ep, pool.reset(ep.slot, ep.task_id, tools=tools)) for ep in episodes))
            for ep, result in zip(episodes, results):
                self._start_transcript(ep, result)
            self._check_prompts(episodes)
            self._queue([ep for ep in episodes if ep.transcript is not None])
        except Exception as e:  # surfaced by the loop, not lost in a task
            self.failure = e
        finally:
            self.arrived.set()

    async def _emit_ended(self, emit: Callable[[PlayedGroup], None]) -> None:
        """Gives the session of every episode that ended back to the pool (a reset may wait for
        it, with a server's cap), and emits every group whose episodes all ended."""
        for slot, ep in list(self.episodes.items()):
            if ep.status is not None:
                await self.engine.pool.release(slot)
                del self.episodes[slot]
        for key, (spec, episodes, start) in list(self._groups.items()):
            if all(ep.status is not None for ep in episodes):
                del self._groups[key]
                emit(PlayedGroup(spec, [self._trajectory(ep, spec, start) for ep in episodes]))

    def _trajectory(self, ep: _LiveEpisode, spec: GroupSpec, version_at_start: int) -> Trajectory:
        """The episode's record; versions per token (the group's start version if it sampled none)."""
        t = dataclasses.replace(self.engine._trajectory(ep, min(ep.versions, default=version_at_start)), attempt=spec.attempt)
        if not ep.versions:
            return t
        versions = iter(ep.versions)
        return dataclasses.replace(t, token_versions=[next(versions) if m else -1 for m in t.loss_mask])
