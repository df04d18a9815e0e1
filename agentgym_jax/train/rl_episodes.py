"""Where each RL step's episodes come from: played for the step, or taken from a stream.

    episodes = rl_episodes.of(plan, engine, settings.async_rollout(config, ...), position)  # Synchronous or Asynchronous
    for step in ...:
        trajectories, metrics = episodes.take(step, policy)     # policy(): the sampler's weights
        ... update ...
        episodes.updated(step + 1, policy)
        position = episodes.position()                         # saved with the checkpoint

`Synchronous` (`rollout.max_staleness=0`): step s plays its tasks with the weights of update s,
then the update runs; the sampler and the environments wait while it does.

`Asynchronous` (`max_staleness=k > 0`, docs/algorithms.md "Asynchronous RL"): a stream
(`GroupStream` over the rollout engine, or an agent program's episodes through the in-process
gateway: `gateway/episodes.AgentStreams`, which takes this path at every k, 0 included) plays the groups of batch b (the tasks, horizon and number step b would play) as soon as the
trainer's version v (updates applied) has b <= v + k, with the newest weights published, while
the trainer updates. Step s takes the `rollout.batch_tasks` lowest-numbered groups that have
finished (waiting while fewer have) and are at most k versions stale (oldest token); staler ones
are dropped or played again (`rollout.stale_groups`), counted. With `rollout.lock_step` nothing
overlaps: step s plays every admitted group to its end with version s, then takes batch s (the
groups of batch s + k were sampled k updates earlier): the same tokens every run. A checkpoint
keeps the next batch to admit and the groups admitted but not yet trained on (`position`); a
resumed run plays those again with its restored weights, so no episode is trained on twice.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import queue
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

import jax

from agentgym_jax.envs.protocol import TaskInfo
from agentgym_jax.job import play
from agentgym_jax.parallel.distributed import process_share
from agentgym_jax.progress import INTERVAL_S, Progress
from agentgym_jax.rl.curriculum import Curriculum
from agentgym_jax.rl.horizon import HorizonSchedule
from agentgym_jax.rollout.collect import show_rollout
from agentgym_jax.rollout.engine import RolloutEngine
from agentgym_jax.rollout.stream import GroupSpec, GroupStream, PlayedGroup, PolicyWeights, StreamTimes
from agentgym_jax.rollout.trajectory import Trajectory

Policy = Callable[[], Any]  # the weights the sampler reads now (`setup.local_policy` of the train state;
# new buffers, `own=True`, for a source that `needs_own_weights`: the next update donates the state)
STALE_GROUPS = ("drop", "resample")  # what becomes of a group staler than max_staleness
_STREAM_KEY = 0x53545245  # the stream's draws: apart from every synchronous step's fold_in(seed, step)


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """What batch b holds: a function of b alone (`job/play.task_batch` over the curriculum's pool,
    the horizon schedule's horizon), this process's share of it."""

    schedule: HorizonSchedule
    curriculum: Curriculum
    info: TaskInfo
    batch_tasks: int
    seed: int
    steps: int  # the run's RL steps (batches 0 .. steps - 1)

    def tasks(self, step: int) -> tuple[list[int], int, int]:
        """(this process's tasks, the number of its first group in the batch, the task pool's size)."""
        pool = self.curriculum.pool(self.info.splits["train"], self.info.metadata, step)
        tasks, first = process_share(play.task_batch(pool, step, self.batch_tasks, self.seed), "rollout.batch_tasks")
        return tasks, first, len(pool)

    def groups(self, batch: int) -> list[GroupSpec]:
        """This process's groups of batch `batch`, numbered over every process's."""
        tasks, first, _ = self.tasks(batch)
        horizon = self.schedule.horizon(batch)
        return [GroupSpec(batch * self.batch_tasks + first + i, task, horizon) for i, task in enumerate(tasks)]


class Stream(Protocol):
    """Plays fed groups: `play(feed, emit)` on its streams' event loop; `wake`, `stop` from any thread."""

    async def play(self, feed: Callable[[], list[GroupSpec] | None], emit: Callable[[PlayedGroup], None]) -> None: ...

    def wake(self) -> None: ...

    def stop(self) -> None: ...


class Streams(Protocol):
    """Where an asynchronous source's streams come from and run."""

    def stream(self, weights: PolicyWeights, rng: jax.Array, times: StreamTimes) -> Stream: ...

    def submit(self, coro: Coroutine[Any, Any, Any]) -> concurrent.futures.Future: ...


@dataclasses.dataclass(frozen=True)
class EngineStreams:
    """`GroupStream`s over the rollout engine, on its event loop."""

    engine: RolloutEngine

    def stream(self, weights: PolicyWeights, rng: jax.Array, times: StreamTimes) -> GroupStream:
        return GroupStream(self.engine, weights, rng, times)

    def submit(self, coro: Coroutine[Any, Any, Any]) -> concurrent.futures.Future:
        return self.engine.submit(coro)


@dataclasses.dataclass(frozen=True)
class AsyncSettings:
    max_staleness: int = 0
    stale_groups: str = "drop"
    lock_step: bool = False


class Synchronous:
    """Step s plays its own tasks with the current weights (today's loop)."""

    needs_own_weights = False  # done with them before the update

    def __init__(self, plan: StepPlan, engine: RolloutEngine):
        self.plan, self.engine = plan, engine

    def take(self, step: int, policy: Policy) -> tuple[list[Trajectory], dict[str, float]]:
        tasks, first, pool = self.plan.tasks(step)
        horizon = self.plan.schedule.horizon(step)
        start = time.time()
        episodes = len(tasks) * self.engine.config.group_size
        with Progress(f"step {step + 1} rollout", episodes, "episode", show_after_s=INTERVAL_S) as bar:  # a long one
            trajectories = self.engine.run(
                policy(), tasks, horizon, jax.random.fold_in(jax.random.PRNGKey(self.plan.seed), step),
                policy_version=step, group_offset=first, on_progress=show_rollout(bar),
            )
        stats = self.engine.last_stats
        return trajectories, {
            "horizon": horizon, "task_pool": pool, "rollout_s": time.time() - start,
            "sampler_busy_s": stats.sampler_busy_s, "sampler_wait_s": stats.sampler_wait_s,
        }

    def updated(self, version: int, policy: Policy) -> None:
        del version, policy  # the next step reads the weights itself

    def position(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        pass


class Asynchronous:
    """Episodes from a `GroupStream` at most `max_staleness` updates behind. See the module docstring."""

    needs_own_weights = True  # the stream reads them while the trainer's next update runs

    def __init__(self, plan: StepPlan, streams: Streams, settings: AsyncSettings, position: dict[str, Any]):
        self.plan, self.streams, self.settings = plan, streams, settings
        self.rng = jax.random.fold_in(jax.random.PRNGKey(plan.seed), _STREAM_KEY)
        self._lock = threading.Lock()
        self._next_batch = position.get("next_batch", 0)
        self._to_feed = [GroupSpec(**g) for g in position.get("pending", [])]  # played again after a resume
        self._outstanding: dict[tuple[int, int], GroupSpec] = {}  # fed, not trained on or dropped
        self._finished: queue.SimpleQueue[PlayedGroup] = queue.SimpleQueue()
        self._done: list[PlayedGroup] = []  # finished, not yet taken
        self._version = 0
        self._weights: PolicyWeights | None = None
        self._stream: Stream | None = None
        self._future = None
        self._times = StreamTimes()
        self._times_at_last_take = StreamTimes()
        self.dropped = self.resampled = 0

    # -- the trainer's side ----------------------------------------------------------------------

    def take(self, step: int, policy: Policy) -> tuple[list[Trajectory], dict[str, float]]:
        start = time.time()
        if self._weights is None:  # the first step of this process: the stream starts
            self._version = step
            self._weights = PolicyWeights(policy(), step)
            if not self.settings.lock_step:
                self._stream = self.streams.stream(self._weights, self.rng, self._times)
                self._future = self.streams.submit(self._stream.play(self._feed, self._finished.put))
        if self.settings.lock_step and (fed := [self._feed()]) != [[]]:  # admitted groups played to their end now
            stream = self.streams.stream(self._weights, self.rng, self._times)
            self.streams.submit(stream.play(lambda: fed.pop() if fed else None, self._finished.put)).result()
        tasks, _, pool = self.plan.tasks(step)
        groups = self._take_groups(len(tasks))
        trajectories = [t for g in groups for t in g.trajectories]
        staleness = [step - g.oldest_version for g in groups]
        times, self._times_at_last_take = _minus(self._times, self._times_at_last_take), dataclasses.replace(self._times)
        k = self.settings.max_staleness
        return trajectories, {
            "horizon": max(g.spec.horizon for g in groups), "task_pool": pool,
            "rollout_s": time.time() - start, "sampler_busy_s": times.busy_s, "sampler_wait_s": times.env_wait_s,
            "staleness_mean": sum(staleness) / len(staleness), "staleness_max": max(staleness),
            **{f"staleness_{v}": sum(s == v for s in staleness) / len(staleness) for v in range(k + 1)},
            "stale_dropped": self.dropped, "stale_resampled": self.resampled,
        }

    def updated(self, version: int, policy: Policy) -> None:
        weights = policy()
        with self._lock:
            self._version = version
        self._weights.publish(weights, version)
        if self._stream is not None:
            self._stream.wake()

    def position(self) -> dict[str, Any]:
        """What a resumed run needs: the next batch to admit, the groups admitted and not trained on."""
        with self._lock:
            pending = sorted({**self._outstanding, **{(g.index, g.attempt): g for g in self._to_feed}}.values(),
                             key=lambda g: (g.index, g.attempt))
            return {"next_batch": self._next_batch, "pending": [dataclasses.asdict(g) for g in pending]}

    def close(self) -> None:
        if self._stream is not None:
            self._stream.stop()
            self._future.result()
            self._stream = None

    # -- the stream's side (its event loop's thread) -----------------------------------------------

    def _feed(self) -> list[GroupSpec]:
        """The groups the staleness bound admits now: batch b once b <= version + max_staleness, and
        b < steps (past the last step only to stand in for groups dropped as stale)."""
        with self._lock:
            specs, self._to_feed = self._to_feed, []
            last = self.plan.steps + -(-self.dropped // self.plan.batch_tasks)
            while self._next_batch <= min(self._version + self.settings.max_staleness, last - 1):
                specs += self.plan.groups(self._next_batch)
                self._next_batch += 1
            self._outstanding.update(((g.index, g.attempt), g) for g in specs)
            return specs

    def _take_groups(self, count: int) -> list[PlayedGroup]:
        """The `count` lowest-numbered finished groups within the staleness bound (waiting for them)."""
        while True:
            while not self._finished.empty():
                self._done.append(self._finished.get())
            self._drop_stale()
            if len(self._done) >= count:
                break
            if self._future is not None and self._future.done():
                self._future.result()  # the stream failed: its error, here
                raise RuntimeError("the episode stream ended before the step had its groups")
            try:
                self._done.append(self._finished.get(timeout=1.0))
            except queue.Empty:
                pass
        self._done.sort(key=lambda g: (g.spec.index, g.spec.attempt))
        taken, self._done = self._done[:count], self._done[count:]
        with self._lock:
            for g in taken:
                del self._outstanding[(g.spec.index, g.spec.attempt)]
        return taken

    def _drop_stale(self) -> None:
        with self._lock:
            version = self._version
        keep, resampled = [], False
        for g in self._done:
            if version - g.oldest_version <= self.settings.max_staleness:
                keep.append(g)
                continue
            with self._lock:
                del self._outstanding[(g.spec.index, g.spec.attempt)]
                if self.settings.stale_groups == "resample":
                    self._to_feed.append(dataclasses.replace(g.spec, attempt=g.spec.attempt + 1))
            resampled = self.settings.stale_groups == "resample"
            self.resampled += resampled
            self.dropped += not resampled
        self._done = keep
        if resampled and self._stream is not None:
            self._stream.wake()


def of(plan: StepPlan, engine: RolloutEngine, settings: AsyncSettings, position: dict[str, Any]) -> Synchronous | Asynchronous:
    """The episodes' source the settings ask for (`position`: a checkpoint's, {} on a fresh start)."""
    return Asynchronous(plan, EngineStreams(engine), settings, position) if settings.max_staleness else Synchronous(plan, engine)


def _minus(a: StreamTimes, b: StreamTimes) -> StreamTimes:
    return StreamTimes(*(x - y for x, y in zip(dataclasses.astuple(a), dataclasses.astuple(b))))

