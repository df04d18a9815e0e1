"""Episodes every mode plays, below `train/` and `eval/`: the tasks of a step, the environment's
oracle (demonstrations), a policy's evaluation, and the metrics of a batch of episodes.

With several processes, each plays its share of the tasks (`distributed.process_share`) on its
own servers, and what comes back is every process's episodes, in process order.
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Callable, Sequence
from typing import Any

import ml_collections
import numpy as np

from agentgym_jax.aio import run_sync
from agentgym_jax.config import ConfigError
from agentgym_jax.envs.pool import EnvPool, PlayedEpisode
from agentgym_jax.envs.protocol import EpisodeStatus, TaskInfo
from agentgym_jax.job import settings
from agentgym_jax.job.setup import Job, gather_trajectories, make_sampler, process_file
from agentgym_jax.models.chat import ChatFraming
from agentgym_jax.models.config import ModelConfig
from agentgym_jax.parallel.distributed import gather_objects, is_writer, process_share
from agentgym_jax.progress import Progress
from agentgym_jax.rollout.collect import ModelPolicy, Policy, collect
from agentgym_jax.rollout.demonstrations import demonstration_trajectory, play_oracle_episodes
from agentgym_jax.rollout.engine import RolloutConfig
from agentgym_jax.rollout.trajectory import Trajectory
from agentgym_jax.sampling.sampler import Sampler


def task_batch(train_ids: Sequence[int], step: int, batch_tasks: int, seed: int) -> list[int]:
    """The tasks of step `step`: consecutive slices of per-epoch seeded permutations."""
    ids = np.asarray(sorted(train_ids))
    start = step * batch_tasks
    out = []
    for cursor in range(start, start + batch_tasks):
        epoch, offset = divmod(cursor, len(ids))
        out.append(int(ids[np.random.default_rng([seed, epoch]).permutation(len(ids))[offset]]))
    return out


def _episode_summary(t: Trajectory) -> list:
    """What `rollout_metrics` reads of an episode (small enough to gather from every process)."""
    return [t.success, t.reward, t.num_turns, t.invalid_actions, sum(t.loss_mask), t.status.value]


def rollout_metrics(trajectories: Sequence[Trajectory], all_processes: bool = False) -> dict[str, float]:
    """Success, reward, turns, invalid actions and status counts of a batch of episodes
    (`all_processes`: of every process's episodes; every process must call it)."""
    rows = [_episode_summary(t) for t in trajectories]
    if all_processes:
        rows = [row for share in gather_objects(rows) for row in share]
    n = max(len(rows), 1)
    success, reward, turns, invalid, response, status = (list(col) for col in zip(*rows)) if rows else ([],) * 6
    metrics = {
        "success_rate": sum(success) / n,
        "mean_reward": sum(reward) / n,
        "turns": sum(turns) / n,
        "invalid_action_rate": sum(invalid) / max(sum(turns), 1),
        "response_tokens": sum(response) / n,
    }
    metrics.update({f"status/{s.value}": status.count(s.value) for s in EpisodeStatus})
    return metrics


def evaluate(
    policy: Policy,
    pool: EnvPool,
    info: TaskInfo,
    task_ids: Sequence[int],
    path: pathlib.Path,
    *,
    horizon: int,
    seed: int,
    group_size: int = 1,
    max_attempts: int = 1,
    batch_episodes: int | None = None,
    fresh: bool = False,
    desc: str | None = None,
) -> list[Trajectory]:
    """`policy` on `task_ids` x `group_size`: this process plays its share on `pool` (unopened),
    each batch of `batch_episodes` (None: all of its share at once) appended to its own file
    (`process_file(path)`), an infrastructure error retried up to `max_attempts` in all; returns
    every process's records. A restart plays only what the file lacks (`rollout/collect.py`);
    `fresh` starts the file over (a training job's evaluation of its current policy). Process 0
    shows the episodes' progress as `desc` (None: the environment's name)."""
    share, _ = process_share(task_ids, f"{info.env} tasks", even=False)
    own = process_file(path.parent, path.name)
    if fresh and own.exists():
        own.unlink()

    async def play() -> list[Trajectory]:
        async with pool:
            return await collect(policy, pool, info, share, group_size=group_size, horizon=horizon, seed=seed, path=own,
                                 batch_episodes=batch_episodes or len(share) * group_size, max_attempts=max_attempts,
                                 progress=is_writer(), desc=desc)

    records = run_sync(play()) if share else []
    scheduled = set(map(int, task_ids))
    return [t for t in gather_trajectories(records) if t.task_id in scheduled]


def evaluation_metrics(records: Sequence[Trajectory]) -> dict:
    """`rollout_metrics` of an evaluation's records (the last attempt of each), and `task_success`:
    `[task_id, 0 or 1]` per episode, sorted, so two runs on the same tasks compare task by task
    (`eval/compare.py`)."""
    last: dict[tuple[str, int, int], Trajectory] = {}  # in the order played
    for t in records:
        key = (t.env, t.task_id, t.sample_idx)
        if key not in last or t.attempt > last[key].attempt:
            last[key] = t
    episodes = list(last.values())
    return {**rollout_metrics(episodes), "task_success": sorted([t.task_id, int(t.success)] for t in episodes)}


def oracle_train_ids(info: TaskInfo) -> list[int]:
    """The training tasks an oracle can demonstrate: all of them, or those the environment lists."""
    if "oracle_task_ids" not in info.metadata:
        return list(info.splits["train"])
    with_oracle = set(info.metadata["oracle_task_ids"])
    ids = [i for i in info.splits["train"] if i in with_oracle]
    if not ids:
        raise ConfigError(f"{info.env} lists no training task with an oracle: SFT demonstrations need one (sft.num_tasks=0 skips SFT)")
    return ids


def oracle_episodes(config: ml_collections.ConfigDict, pool: EnvPool, info: TaskInfo) -> list[PlayedEpisode]:
    """This process's share of the oracle episodes of `sft.num_tasks` training tasks (SFT data
    and tokenizer text): tasks with an oracle only, where an environment lists them
    (`metadata["oracle_task_ids"]`: MiniWoB++, TextArena). An episode stops at `sft.horizon`,
    so a demonstration longer than that ends `max_turns`, unsuccessful, and SFT leaves it out.
    `sft.oracle` names another of the environment's oracles (Maze's `local`); a name it lacks, or
    servers that fail every episode, stop the job here with the server's answer. `pool`: unopened,
    over this process's servers (`Job.pool()`)."""
    task_ids, _ = process_share(task_batch(oracle_train_ids(info), 0, config.sft.num_tasks, config.seed + 1),
                                "sft.num_tasks", even=False)
    if not task_ids:
        return []

    async def play() -> list[PlayedEpisode]:
        async with pool:
            with Progress("demonstrations", len(task_ids), "episode") as progress:
                return await play_oracle_episodes(pool, task_ids, horizon=config.sft.horizon, oracle=config.sft.oracle,
                                                  action_format=config.rollout.action_format, on_finished=progress.update)

    episodes = run_sync(play())
    failed = [ep for ep in episodes if ep.status is EpisodeStatus.INFRA_ERROR]
    if len(failed) == len(episodes):
        raise RuntimeError(f"every oracle episode failed (sft.oracle={config.sft.oracle!r}); the first: {failed[0].error}")
    return episodes


def demonstrations(config: ml_collections.ConfigDict, framing: ChatFraming, info: TaskInfo,
                   episodes: Sequence[PlayedEpisode]) -> list[Trajectory]:
    """Every process's oracle `episodes` (`oracle_episodes`) as token-exact trajectories, group id
    the task's place among the `sft.num_tasks` (the same list on every process). A function-calling
    job's (`rollout.tool_calls`) are framed as its rollouts: the environment's tools in the prompt,
    its answers as tool messages."""
    _, first = process_share(range(config.sft.num_tasks), "sft.num_tasks", even=False)
    tools = info.metadata.get("tools", []) if config.rollout.get("tool_calls", False) else None
    played = [demonstration_trajectory(framing, info, ep, group_id=first + i, tools=tools) for i, ep in enumerate(episodes)]
    return gather_trajectories(played)


@dataclasses.dataclass
class HeldOut:
    """A training job's evaluation: its policy on the first `eval.num_tasks` test tasks, up to
    `eval.horizon` turns at `eval.temperature` (greedy: 0), one sample each, with a sampler of
    its own on this process's devices (compiled once, used for every evaluation of the job).
    `play_with(sampler, framing, params, rollout)`: the policy that plays (an agent program's
    job: `gateway/episodes.agent_policy`). `sampled_of`: the same tasks `eval.sampled` times each
    at the rollout's temperature, on the training engine's sampler."""

    config: ml_collections.ConfigDict
    job: Job
    framing: ChatFraming
    sampler: Sampler
    rollout: RolloutConfig
    play_with: Callable[[Sampler, ChatFraming, Any, RolloutConfig], Policy] = ModelPolicy
    samples: int = 1  # episodes a task
    batch_episodes: int | None = None  # episodes played together; None: every one at once

    @classmethod
    def of(cls, config: ml_collections.ConfigDict, job: Job, model: ModelConfig, framing: ChatFraming,
           play_with: Callable[[Sampler, ChatFraming, Any, RolloutConfig], Policy] = ModelPolicy) -> HeldOut:
        if config.eval.num_tasks < 1:
            raise ConfigError(f"eval.num_tasks must be >= 1 (the report compares held-out success), got {config.eval.num_tasks}")
        rollout = settings.rollout(config, temperature=config.eval.temperature, group_size=1)
        return cls(config, job, framing, make_sampler(config, model, framing, rollout), rollout, play_with)

    @classmethod
    def sampled_of(cls, config: ml_collections.ConfigDict, job: Job, framing: ChatFraming, sampler: Sampler,
                   rollout: RolloutConfig) -> HeldOut | None:
        """The evaluation `eval.sampled` asks for (None for 0): each held-out task that many times
        at the training `rollout`'s temperature, on its `sampler` (no second cache or compile), a
        training batch's episodes at a time."""
        if config.eval.sampled < 0:
            raise ConfigError(f"eval.sampled must be >= 0 (samples a held-out task at the rollout temperature), "
                              f"got {config.eval.sampled}")
        if not config.eval.sampled:
            return None
        return cls(config, job, framing, sampler, rollout, samples=config.eval.sampled,
                   batch_episodes=config.rollout.batch_tasks * config.rollout.group_size)

    @property
    def task_ids(self) -> list[int]:
        return sorted(self.job.info.splits["test"])[: self.config.eval.num_tasks]

    def __call__(self, params, path: pathlib.Path, desc: str) -> dict:
        """`evaluation_metrics` of the policy `params` (on this process's devices: `setup.local_policy`);
        its episodes go to `path` (one file per process), written afresh."""
        policy = self.play_with(self.sampler, self.framing, params, self.rollout)
        records = evaluate(policy, self.job.pool(), self.job.info, self.task_ids, path, horizon=self.config.eval.horizon,
                           seed=self.config.seed, group_size=self.samples, batch_episodes=self.batch_episodes,
                           fresh=True, desc=desc)
        return evaluation_metrics(records)


def episode_texts(info: TaskInfo, episodes: Sequence[PlayedEpisode]) -> list[str]:
    """The instruction and every observation and action of every process's `episodes`: what a
    job-built tokenizer learns from (the same text on every process)."""
    local = [text for ep in episodes for text in (ep.first_observation, *(x for t in ep.turns for x in (t.action, t.observation)))]
    return [info.instruction] + [text for share in gather_objects(local) for text in share]
