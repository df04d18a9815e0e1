"""Helpers shared by the training jobs (RL, SFT, DPO, AgentEvol): task order, oracle data,
greedy evaluation and its metrics, optimizer settings. With several processes, each plays its
share of the tasks and the metrics count every process's episodes."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from agentgym_jax.aio import run_sync
from agentgym_jax.config import ConfigError
from agentgym_jax.envs.pool import EnvPool, Episode
from agentgym_jax.envs.protocol import EpisodeStatus, TaskInfo
from agentgym_jax.job import settings as job_settings
from agentgym_jax.job import setup
from agentgym_jax.models import decoder
from agentgym_jax.parallel.distributed import gather_objects, process_share
from agentgym_jax.progress import Progress
from agentgym_jax.rollout.demonstrations import play_oracle_episodes
from agentgym_jax.rollout.engine import RolloutEngine
from agentgym_jax.rollout.trajectory import Trajectory
from agentgym_jax.train import settings
from agentgym_jax.train.state import TrainState, make_optimizer
from agentgym_jax.train.steps import UpdateConfig, train_state_shardings

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


def evaluate(engine: RolloutEngine, params, task_ids: Sequence[int], horizon: int, seed: int, desc: str = "eval") -> dict:
    """Greedy (or configured) episodes on `task_ids`, each process its share (`params` on its
    sampler's devices); success counts every scheduled episode of every process. Process 0 shows
    its episodes' progress as `desc`.

    Besides the rates, `task_success` lists `[task_id, 0 or 1]` per task, so two runs on the same
    tasks can be compared task by task (`eval/compare.py`).
    """
    share, _ = process_share(task_ids, "eval tasks", even=False)
    with Progress(desc, len(share) * engine.config.group_size, "episode") as progress:
        trajectories = engine.run(params, share, horizon, jax.random.PRNGKey(seed), policy_version=-1,
                                  on_progress=progress.set) if share else []
    outcomes = gather_objects([[t.task_id, int(t.success)] for t in trajectories])
    return {**rollout_metrics(trajectories, all_processes=True), "task_success": sorted(x for o in outcomes for x in o)}


def oracle_train_ids(info: TaskInfo) -> list[int]:
    """The training tasks an oracle can demonstrate: all of them, or those the environment lists."""
    if "oracle_task_ids" not in info.metadata:
        return list(info.splits["train"])
    with_oracle = set(info.metadata["oracle_task_ids"])
    ids = [i for i in info.splits["train"] if i in with_oracle]
    if not ids:
        raise ConfigError(f"{info.env} lists no training task with an oracle: SFT demonstrations need one (sft.num_tasks=0 skips SFT)")
    return ids


def play_oracle(config: ml_collections.ConfigDict, urls: Sequence[str], info: TaskInfo) -> list[Episode]:
    """This process's share of the oracle episodes of `sft.num_tasks` training tasks (SFT data
    and tokenizer text): tasks with an oracle only, where an environment lists them
    (`metadata["oracle_task_ids"]`: MiniWoB++, TextArena). An episode stops at `sft.max_turns`,
    so a demonstration longer than that ends `max_turns`, unsuccessful, and SFT leaves it out.
    `sft.oracle` names another of the environment's oracles (Maze's `local`); a name it lacks, or
    servers that fail every episode, stop the job here with the server's answer."""
    train_ids = oracle_train_ids(info)
    task_ids, _ = process_share(task_batch(train_ids, 0, config.sft.num_tasks, config.seed + 1),
                                "sft.num_tasks", even=False)
    if not task_ids:
        return []

    async def play_one(pool: EnvPool, task_id: int, progress: Progress) -> Episode:
        [episode] = await play_oracle_episodes(pool, [task_id], horizon=config.sft.max_turns,
                                               action_format=config.rollout.action_format, oracle=config.sft.oracle)
        progress.update()
        return episode

    async def play() -> list[Episode]:
        async with setup.make_pool(config.env, urls) as pool:
            with Progress("demonstrations", len(task_ids), "episode") as progress:
                return list(await asyncio.gather(*(play_one(pool, t, progress) for t in task_ids)))

    episodes = run_sync(play())
    failed = [ep for ep in episodes if ep.status is EpisodeStatus.INFRA_ERROR]
    if len(failed) == len(episodes):
        raise RuntimeError(f"every oracle episode failed (sft.oracle={config.sft.oracle!r}); the first: {failed[0].error}")
    return episodes


def episode_texts(info: TaskInfo, episodes: Sequence[Episode]) -> list[str]:
    """The instruction and every observation and action of every process's `episodes`: what a
    job-built tokenizer learns from (the same text on every process)."""
    local = [text for ep in episodes for text in (ep.first_observation, *(x for t in ep.turns for x in (t.action, t.observation)))]
    return [info.instruction] + [text for share in gather_objects(local) for text in share]


def critic_states(
    config: ml_collections.ConfigDict, update: UpdateConfig, mesh: jax.sharding.Mesh, policy_params, tx=None
) -> list[TrainState]:
    """`[critic_state]` with a separate critic (`update.rl.separate_critic`), else `[]`.

    `tx`: the optimizer of an earlier critic state, to keep (a new one is a new compilation).
    PPO's separate critic, placed on `mesh`: the backbone of `algo.critic_dir` (a Hugging Face
    folder) or a copy of `policy_params`, a new value head, and its own optimizer (`algo.critic_lr`,
    0: `optim.lr`; its schedule spans the RL phase's optimizer updates, like the policy's).
    """
    if not update.rl.separate_critic:
        return []
    if not job_settings.tuning(config).full:
        raise ConfigError("algo.critic=separate copies the whole policy: it does not combine with model.lora_rank or "
                          "model.trainable_layers (use algo.critic=shared)")
    dtype = jnp.dtype(config.model.param_dtype)
    model = update.rl.critic_model or update.forward.model
    if config.algo.critic_dir:
        backbone = setup.pretrained_params(config.algo.critic_dir, model, dtype, mesh)
    else:
        backbone = {name: jax.tree.map(jnp.copy, p) for name, p in policy_params.items() if name != "value_head"}
    head = decoder.init_value_head(model, jax.random.PRNGKey(config.seed + 4), param_dtype=dtype)
    tx = tx or make_optimizer(settings.rl_optim(config, update.batching.updates_per_step, lr=config.algo.critic_lr or config.optim.lr))
    state = TrainState.create({**backbone, "value_head": head}, tx, jax.random.PRNGKey(config.seed + 5))
    return [jax.device_put(state, train_state_shardings(state, mesh))]
