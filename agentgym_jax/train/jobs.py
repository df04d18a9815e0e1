"""Helpers shared by the training jobs (RL, SFT, DPO, AgentEvol): task order, oracle data,
greedy evaluation and its metrics, optimizer settings."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import jax
import ml_collections
import numpy as np

from agentgym_jax.aio import run_sync
from agentgym_jax.config import ConfigError
from agentgym_jax.envs.pool import Episode
from agentgym_jax.envs.protocol import EpisodeStatus, TaskInfo
from agentgym_jax.rollout.demonstrations import play_oracle_episodes
from agentgym_jax.rollout.engine import RolloutEngine
from agentgym_jax.rollout.trajectory import Trajectory
from agentgym_jax.train import build


def task_batch(train_ids: Sequence[int], step: int, batch_tasks: int, seed: int) -> list[int]:
    """The tasks of step `step`: consecutive slices of per-epoch seeded permutations."""
    ids = np.asarray(sorted(train_ids))
    start = step * batch_tasks
    out = []
    for cursor in range(start, start + batch_tasks):
        epoch, offset = divmod(cursor, len(ids))
        out.append(int(ids[np.random.default_rng([seed, epoch]).permutation(len(ids))[offset]]))
    return out


def check_token_ids(trajectories: Iterable[Trajectory], vocab_size: int) -> None:
    """Refuses token ids outside the model's vocabulary (files from another tokenizer): their
    embedding lookup is NaN, and attention spreads it to the whole batch."""
    top = max((max(t.token_ids, default=0) for t in trajectories), default=0)
    if top >= vocab_size:
        raise ConfigError(f"a trajectory holds token id {top} >= the model's vocab_size {vocab_size}: "
                          "trajectory files must come from the configured tokenizer")


def rollout_metrics(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """Success, reward, turns, invalid actions and status counts of a batch of episodes."""
    n = max(len(trajectories), 1)
    metrics = {
        "success_rate": sum(t.success for t in trajectories) / n,
        "mean_reward": sum(t.reward for t in trajectories) / n,
        "turns": sum(t.num_turns for t in trajectories) / n,
        "invalid_action_rate": sum(t.invalid_actions for t in trajectories) / max(sum(t.num_turns for t in trajectories), 1),
        "response_tokens": sum(sum(t.loss_mask) for t in trajectories) / n,
    }
    metrics.update({f"status/{s.value}": sum(t.status == s for t in trajectories) for s in EpisodeStatus})
    return metrics


def evaluate(engine: RolloutEngine, params, task_ids: Sequence[int], horizon: int, seed: int) -> dict[str, float]:
    """Greedy (or configured) episodes on `task_ids`; success counts every scheduled episode."""
    trajectories = engine.run(params, task_ids, horizon, jax.random.PRNGKey(seed), policy_version=-1)
    return rollout_metrics(trajectories)


def play_oracle(config: ml_collections.ConfigDict, urls: Sequence[str], info: TaskInfo) -> list[Episode]:
    """Oracle episodes of `sft.num_tasks` training tasks (SFT data and tokenizer text)."""
    task_ids = task_batch(info.splits["train"], 0, config.sft.num_tasks, config.seed + 1)

    async def play() -> list[Episode]:
        async with build.make_pool(config.env, urls) as pool:
            return await play_oracle_episodes(pool, task_ids, action_format=config.rollout.action_format)

    return run_sync(play())


def episode_texts(info: TaskInfo, episodes: Sequence[Episode]) -> list[str]:
    """The instruction and every observation and action: what a job-built tokenizer learns from."""
    return [info.instruction] + [
        text for ep in episodes for text in (ep.first_observation, *(x for t in ep.turns for x in (t.action, t.observation)))
    ]


def optim_config(optim: ml_collections.ConfigDict, total_updates: int, lr: float | None = None) -> ml_collections.ConfigDict:
    """`optim` with the schedule length (and optionally the learning rate) of one training phase."""
    out = ml_collections.ConfigDict(optim.to_dict())
    out.total_updates = total_updates
    if lr is not None:
        out.lr = lr
    return out


def rl_optim_config(config: ml_collections.ConfigDict, updates_per_step: int) -> ml_collections.ConfigDict:
    """The RL phase's optimizer settings: its schedule (warm-up and decay) counts optimizer updates,
    `updates_per_step` (ppo_epochs x num_minibatches) per RL step, over `train.steps` steps."""
    return optim_config(config.optim, config.train.steps * updates_per_step)
