"""Agent programs as a job's episodes: the gateway in-process, each episode an agent call with an
API key of its own, its conversations turned into trajectories with the agent's reward.

    async with serve_local(gateway) as base_url:                # the gateway on 127.0.0.1:<free port>
        episode = await play_episode(gateway, base_url, spec, task_id, ...)
        episode.trajectories                                     # one per conversation, the reward on each

`AgentPolicy` plays evaluation batches this way (`mode=eval` with `env.agent`, and an RL job's
held-out evaluations); `AgentStreams` is an RL job's source of episode groups
(`train/rl_episodes.Asynchronous`): group g of task t is `group_size` concurrent episodes of the
agent on t, its trajectories every conversation of every episode, each with its episode's
reward (an episode's conversations beyond `env.agent_conversations` are dropped, the last kept).
The gateway serves the newest weights the trainer publishes, in place: a conversation in flight
at an update goes on with the new weights, each sampled id tagged with its version, and the
staleness bound and correction of `rollout.max_staleness` apply to it like to any partial rollout.

Conversations of an episode left with a request in flight when it ends are dropped unrecorded;
an episode with no recorded conversation is one empty record (kept in the accounting). Every
episode's summary (status, reward, conversations, restarts, dropped, error, metadata, seconds)
is appended to `agent_episodes.jsonl`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import json
import pathlib
import secrets
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from typing import Any

import jax
import ml_collections
from aiohttp import web

from agentgym_jax.aio import LoopThread
from agentgym_jax.envs.protocol import TaskInfo
from agentgym_jax.gateway.agents import AgentOutcome, AgentSpec, run_agent
from agentgym_jax.gateway.server import Gateway
from agentgym_jax.job import settings as job_settings
from agentgym_jax.job import setup
from agentgym_jax.models.chat import ChatFraming
from agentgym_jax.models.config import ModelConfig
from agentgym_jax.rollout.engine import RolloutConfig, RolloutProgress
from agentgym_jax.rollout.stream import GroupSpec, PlayedGroup, PolicyWeights, StreamTimes
from agentgym_jax.rollout.trajectory import Trajectory
from agentgym_jax.rollout.transcript import empty_trajectory
from agentgym_jax.sampling.sampler import Sampler

EPISODES_NAME = "agent_episodes.jsonl"
MODEL_NAME = "policy"  # what the agent requests as `model` (its `model` kwarg)
PROGRESS_EVERY_S = 5.0  # how often an evaluation's progress hears the gateway's replies between episodes' ends


@dataclasses.dataclass(frozen=True)
class AgentEpisode:
    """One agent episode: its conversations' trajectories and how it ended."""

    trajectories: list[Trajectory]  # one per recorded conversation, or one empty record
    outcome: AgentOutcome
    conversations: int  # recorded
    restarts: int  # conversations begun on a changed history
    dropped: int  # conversations not recorded (in flight at the end, nothing sampled, or over the cap)
    seconds: float

    @property
    def record(self) -> Trajectory:
        """What an evaluation counts: the episode's last conversation (or its empty record)."""
        return self.trajectories[-1]

    def summary(self) -> dict[str, Any]:
        t = self.record
        return {"task_id": t.task_id, "group_id": t.group_id, "sample_idx": t.sample_idx, "attempt": t.attempt,
                "status": self.outcome.status.value, "reward": self.outcome.reward, "conversations": self.conversations,
                "restarts": self.restarts, "dropped": self.dropped, "error": self.outcome.error,
                "metadata": self.outcome.metadata, "seconds": round(self.seconds, 3)}


@contextlib.asynccontextmanager
async def serve_local(gateway: Gateway) -> AsyncIterator[str]:
    """The gateway on 127.0.0.1 at a free port, in the running event loop; yields its base URL."""
    runner = web.AppRunner(gateway.app(), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}/v1"
    finally:
        await runner.cleanup()


async def play_episode(
    gateway: Gateway, base_url: str, spec: AgentSpec, task_id: int, *, env: str, env_url: str, horizon: int,
    group_id: int, sample_idx: int, success_threshold: float, attempt: int = 0, max_conversations: int | None = None,
) -> AgentEpisode:
    """The agent on `task_id` with a key of its own; its conversations as trajectories (the last
    `max_conversations` of them, None: all)."""
    start, version = time.monotonic(), gateway.batcher.weights.newest()[0]
    key = gateway.open_episode()
    kwargs = {"env_url": env_url, "horizon": horizon, "sample_idx": sample_idx, "model": gateway.model_name}
    try:
        outcome = await run_agent(spec, task_id, base_url, key, kwargs, success_threshold)
    finally:
        record = gateway.close_episode(key)
    kept = record.conversations[-max_conversations:] if max_conversations else record.conversations
    fields = dict(task_id=task_id, env=env, group_id=group_id, sample_idx=sample_idx, attempt=attempt)
    trajectories = [gateway.trajectory(c, outcome.reward, outcome.status, **fields) for c in kept]
    if not trajectories:  # counted all the same: no tokens, so never trained on
        trajectories = [empty_trajectory(status=outcome.status, policy_version=version, **fields)]
    return AgentEpisode(trajectories, outcome, len(kept), record.restarts,
                        record.dropped + len(record.conversations) - len(kept), time.monotonic() - start)


def episode_gateway(sampler: Sampler, framing: ChatFraming, weights: Any, out_dir: pathlib.Path, rollout: RolloutConfig,
                    rows: int, spec: AgentSpec, seed: int, times: StreamTimes | None = None) -> Gateway:
    """A gateway for a job's agent episodes: every request needs an episode's key (a key of its
    own that no one is told keeps everything else out), conversations idle twice the agent's
    time-out are dropped."""
    return Gateway(sampler, framing, weights, out_dir / "gateway", model_name=MODEL_NAME, max_conversations=rows,
                   decode_chunk=rollout.decode_chunk, max_tokens_per_turn=rollout.max_tokens_per_turn,
                   max_queue=1 << 20, auth_token=secrets.token_hex(16), idle_timeout_s=2 * spec.timeout_s, seed=seed,
                   times=times, log_requests=False)


def _append(path: pathlib.Path, episodes: Sequence[AgentEpisode]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.writelines(json.dumps(e.summary(), ensure_ascii=False) + "\n" for e in episodes)


@dataclasses.dataclass
class AgentPolicy:
    """An evaluation's policy (`rollout/collect.Policy`): each episode the agent program, playing
    through an in-process gateway over `sampler` with `params` (one gateway per batch); the
    episodes' summaries appended to `episodes_path`."""

    spec: AgentSpec
    sampler: Sampler
    framing: ChatFraming
    params: Any
    rollout: RolloutConfig
    episodes_path: pathlib.Path
    seed: int = 0

    async def play(self, pool, info: TaskInfo, task_ids: Sequence[int], horizon: int, rng: jax.Array,
                   on_progress: Callable[[RolloutProgress], None] | None = None) -> list[Trajectory]:
        del rng  # the gateway draws with its own key, folded per conversation
        gateway = episode_gateway(self.sampler, self.framing, self.params, self.episodes_path.parent, self.rollout,
                                  len(task_ids), self.spec, self.seed)
        finished = 0

        def report() -> None:  # an agent's turns left are unknown: episodes ended is the share done
            if on_progress is not None:
                on_progress(RolloutProgress(finished, len(task_ids), turns=gateway.turns_sampled,
                                            tokens=gateway.tokens_sampled, turns_left=None))

        async def one(i: int, task: int) -> AgentEpisode:
            nonlocal finished
            episode = await play_episode(gateway, base_url, self.spec, task, env=info.env,
                                         env_url=pool.urls[i % len(pool.urls)], horizon=horizon, group_id=i, sample_idx=0,
                                         success_threshold=info.success_threshold)
            finished += 1
            report()
            return episode

        async def watch() -> None:  # the replies as they come, between episodes' ends
            while True:
                await asyncio.sleep(PROGRESS_EVERY_S)
                report()

        async with serve_local(gateway) as base_url:
            watcher = asyncio.create_task(watch())
            try:
                episodes = await asyncio.gather(*(one(i, int(task)) for i, task in enumerate(task_ids)))
            finally:
                watcher.cancel()
        await asyncio.to_thread(_append, self.episodes_path, episodes)
        return [e.record for e in episodes]


class AgentStreams:
    """An RL job's agent episodes: the in-process gateway on an event loop of its own, and
    `stream`s of groups for `train/rl_episodes.Asynchronous` (which admits, takes and drops them)."""

    def __init__(self, gateway: Gateway, spec: AgentSpec, info: TaskInfo, env_urls: Sequence[str], group_size: int,
                 max_conversations: int, episodes_path: pathlib.Path):
        self.gateway, self.spec, self.info, self.env_urls = gateway, spec, info, list(env_urls)
        self.group_size, self.max_conversations, self.episodes_path = group_size, max_conversations, episodes_path
        self._loop = LoopThread("agent-gateway")
        self._serving = contextlib.AsyncExitStack()
        self.base_url = self._loop.run(self._serving.enter_async_context(serve_local(gateway)))

    def stream(self, weights: PolicyWeights, rng: jax.Array, times: StreamTimes) -> AgentGroupStream:
        """Groups played with `weights` (the trainer publishes each update there) from now on."""
        del rng  # the gateway draws with its own key
        self.gateway.batcher.weights, self.gateway.batcher.times = weights, times
        self.gateway.batcher.notify()
        return AgentGroupStream(self)

    def submit(self, coro: Coroutine[Any, Any, Any]) -> concurrent.futures.Future:
        return self._loop.submit(coro)

    def close(self) -> None:
        """Stops the gateway (its rows freed) and the loop; a second call does nothing."""
        if self._loop.closed:
            return
        self._loop.run(self._serving.aclose())
        self._loop.close()


class AgentGroupStream:
    """Plays fed groups (`GroupSpec`) as concurrent agent episodes until `feed` says no more and
    every group has ended, or until `stop()`; `emit`s each group once all its episodes ended."""

    def __init__(self, streams: AgentStreams):
        self.streams = streams
        self._groups: dict[tuple[int, int], tuple[GroupSpec, list[asyncio.Task]]] = {}
        self._arrived: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopped = False

    def wake(self) -> None:
        """(any thread) New weights (the gateway takes them at its next chunk) or groups to admit."""
        self.streams.gateway.batcher.notify()
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._arrived.set)

    def stop(self) -> None:
        """(any thread) Ends `play` at its next turn of the loop; episodes in flight are abandoned."""
        self._stopped = True
        self.wake()

    async def play(self, feed: Callable[[], list[GroupSpec] | None], emit: Callable[[PlayedGroup], None]) -> None:
        self._loop, self._arrived = asyncio.get_running_loop(), asyncio.Event()
        closed = False
        try:
            while not self._stopped:
                self._arrived.clear()
                if not closed:
                    specs = feed()
                    closed = specs is None
                    for spec in specs or ():
                        self._start_group(spec)
                await self._emit_ended(emit)
                if closed and not self._groups:
                    break
                await self._arrived.wait()
        finally:
            for _, tasks in self._groups.values():
                for task in tasks:
                    task.cancel()

    def _start_group(self, spec: GroupSpec) -> None:
        s = self.streams
        tasks = []
        for j in range(s.group_size):
            url = s.env_urls[(spec.index * s.group_size + j) % len(s.env_urls)]
            episode = play_episode(s.gateway, s.base_url, s.spec, spec.task_id, env=s.info.env, env_url=url,
                                   horizon=spec.horizon, group_id=spec.index, sample_idx=j, attempt=spec.attempt,
                                   success_threshold=s.info.success_threshold, max_conversations=s.max_conversations)
            task = asyncio.create_task(episode)
            task.add_done_callback(lambda _: self._arrived.set())
            tasks.append(task)
        self._groups[(spec.index, spec.attempt)] = (spec, tasks)

    async def _emit_ended(self, emit: Callable[[PlayedGroup], None]) -> None:
        for key, (spec, tasks) in list(self._groups.items()):
            if all(task.done() for task in tasks):
                del self._groups[key]
                episodes = [task.result() for task in tasks]
                await asyncio.to_thread(_append, self.streams.episodes_path, episodes)
                emit(PlayedGroup(spec, [t for e in episodes for t in e.trajectories]))



def agent_streams(config: ml_collections.ConfigDict, job: setup.Job, model: ModelConfig, framing: ChatFraming,
                  spec: AgentSpec) -> AgentStreams:
    """An RL job's agent episodes on this process's sampler devices and servers: the gateway's rows
    `rollout.num_slots` (0: every episode of a step at once), its turns `config.rollout`'s."""
    rollout = job_settings.rollout(config)
    rows = config.rollout.num_slots or config.rollout.batch_tasks * config.rollout.group_size
    sampler = setup.make_sampler(config, model, framing, rollout)
    gateway = episode_gateway(sampler, framing, PolicyWeights(None, -1), job.workdir, rollout, rows, spec, config.seed)
    return AgentStreams(gateway, spec, job.info, job.urls[job.env_name], config.rollout.group_size,
                        config.env.agent_conversations, setup.process_file(job.workdir, EPISODES_NAME))


def agent_policy(config: ml_collections.ConfigDict, spec: AgentSpec, out_dir: pathlib.Path) -> Callable[..., AgentPolicy]:
    """`AgentPolicy` of (sampler, framing, params, rollout): what `job/play.HeldOut` plays with."""
    return functools.partial(AgentPolicy, spec, episodes_path=setup.process_file(out_dir, EPISODES_NAME), seed=config.seed)
