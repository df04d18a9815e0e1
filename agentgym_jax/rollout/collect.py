"""Resumable collection of episodes: a policy over (task ids x samples), one JSONL record each.

The shared core of `mode=collect` (datasets) and `mode=eval` (evaluation runs):

    policy = OraclePolicy(framing)                        # or ModelPolicy(sampler, framing, params, rollout)
    async with EnvPool(urls) as pool:
        records = await collect(policy, pool, info, task_ids, group_size=4, horizon=20,
                                seed=0, path="out/trajectories.jsonl")

Episodes are played in batches of `batch_episodes`; each finished batch is appended to the JSONL
file and fsynced before the next starts, so a killed collection loses at most the batch in
flight. A restart reads the file (cutting a torn last line), keeps what is there and plays only
the (task, sample) pairs without a record: never a duplicate. An episode that ended `infra_error`
is played again, up to `max_attempts` in all, as `attempt=k` of the same (task, sample) (the
accounting counts the last attempt and reports the retries); retries go to the end of the queue.

Sampling keys: each batch samples with `key(seed)` folded with its first episode's
(task, sample, attempt), so a run is reproducible for the same batching (and exactly so when
greedy).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import jax

from agentgym_jax.envs.pool import EnvPool
from agentgym_jax.envs.protocol import EpisodeStatus, TaskInfo
from agentgym_jax.models.chat import ChatFraming
from agentgym_jax.progress import Progress
from agentgym_jax.rollout.demonstrations import ACTION_ONLY, demonstration_trajectory, play_oracle_episodes
from agentgym_jax.rollout.engine import RolloutConfig, RolloutEngine, RolloutProgress
from agentgym_jax.rollout.trajectory import Trajectory, read_jsonl, write_jsonl
from agentgym_jax.sampling.sampler import Sampler

Slot = tuple[int, int, int]  # (task_id, sample_idx, attempt)


ProgressHook = Callable[[RolloutProgress], None]


class Policy(Protocol):
    """Plays one batch of episodes on an open pool; one trajectory per task id, in order
    (`on_progress(RolloutProgress)`, where the policy can tell, as the batch goes on)."""

    async def play(
        self, pool: EnvPool, info: TaskInfo, task_ids: Sequence[int], horizon: int, rng: jax.Array,
        on_progress: ProgressHook | None = None,
    ) -> list[Trajectory]: ...


def show_rollout(bar: Progress, done: int = 0, turns: int = 0, tokens: int = 0) -> ProgressHook:
    """An engine's `on_progress` that shows its run on `bar`, after `done` episodes (`turns`
    played and `tokens` decoded) of the phase: episodes finished, turns, tokens, and the share of
    the phase's work done for the ETA (a batch's episodes finish together; its turns do not)."""

    def show(p: RolloutProgress) -> None:
        bar.set(done + p.finished, work=(done + p.episodes * p.fraction) / max(bar.total, 1),
                turns=turns + p.turns, tokens=tokens + p.tokens)

    return show


@dataclasses.dataclass
class OraclePolicy:
    """The environment's oracle (`/oracle_action`), each action phrased by `action_format`;
    `tool_calls`: framed as function-calling episodes, the environment's tools in the prompt."""

    framing: ChatFraming
    action_format: str = ACTION_ONLY
    tool_calls: bool = False

    async def play(self, pool, info, task_ids, horizon, rng, on_progress=None):
        del rng, on_progress  # the oracle is deterministic, and fast
        episodes = await play_oracle_episodes(pool, task_ids, horizon=horizon, action_format=self.action_format)
        tools = info.metadata.get("tools", []) if self.tool_calls else None
        return [demonstration_trajectory(self.framing, info, ep, group_id=i, tools=tools) for i, ep in enumerate(episodes)]


@dataclasses.dataclass
class ModelPolicy:
    """A decoder's params sampled by the rollout engine (one row per episode)."""

    sampler: Sampler
    framing: ChatFraming
    params: Any
    rollout: RolloutConfig
    policy_version: int = -1

    async def play(self, pool, info, task_ids, horizon, rng, on_progress=None):
        engine = RolloutEngine(self.sampler, self.framing, pool, info, dataclasses.replace(self.rollout, group_size=1))
        return await engine.run_async(self.params, task_ids, horizon, rng, policy_version=self.policy_version,
                                      on_progress=on_progress)


def resume_jsonl(path: str | os.PathLike) -> list[Trajectory]:
    """The records of an interrupted collection; a torn last line (killed writer) is cut off the
    file so that appending goes on from a clean line."""
    if not os.path.exists(path):
        return []
    with open(path, "rb+") as f:
        data = f.read()
        if data and not data.endswith(b"\n"):
            f.truncate(data.rfind(b"\n") + 1)
    return list(read_jsonl(os.fspath(path)))


def last_attempts(records: Sequence[Trajectory], env: str) -> dict[tuple[int, int], Trajectory]:
    """(task, sample) -> its record with the highest attempt, for the records of `env`."""
    out: dict[tuple[int, int], Trajectory] = {}
    for t in records:
        key = (t.task_id, t.sample_idx)
        if t.env == env and (key not in out or t.attempt > out[key].attempt):
            out[key] = t
    return out


async def collect(
    policy: Policy,
    pool: EnvPool,
    info: TaskInfo,
    task_ids: Sequence[int],
    *,
    group_size: int,
    horizon: int,
    seed: int,
    path: str | os.PathLike,
    batch_episodes: int = 64,
    max_attempts: int = 1,
    progress: bool = True,
    desc: str | None = None,
) -> list[Trajectory]:
    """Plays every (task, sample) of `info.env` without a record in `path`; returns the env's
    records (earlier and new, every attempt). `pool` must be open. `progress` shows the
    episodes' count as `desc` (None: the environment's name)."""
    if group_size < 1 or batch_episodes < 1 or max_attempts < 1 or horizon < 1:
        raise ValueError(
            f"group_size ({group_size}), batch_episodes ({batch_episodes}), "
            f"max_attempts ({max_attempts}) and horizon ({horizon}) must be >= 1"
        )
    records = [t for t in resume_jsonl(path) if t.env == info.env]
    done = last_attempts(records, info.env)
    todo: list[Slot] = [
        (int(task), s, 0) for task in task_ids for s in range(group_size) if (task, s) not in done
    ]
    todo += [
        (t.task_id, t.sample_idx, t.attempt + 1)
        for t in done.values()
        if t.status is EpisodeStatus.INFRA_ERROR and t.attempt + 1 < max_attempts
    ]
    turns = tokens = 0  # the phase's so far
    with Progress(desc or info.env, len(todo), "episode", enabled=progress) as bar:
        while todo:
            batch, todo = todo[:batch_episodes], todo[batch_episodes:]
            task, sample, attempt = batch[0]
            rng = jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), task), sample), attempt)
            done = bar.n
            played = await policy.play(pool, info, [task for task, _, _ in batch], horizon, rng,
                                       on_progress=show_rollout(bar, done, turns, tokens))
            new = [
                dataclasses.replace(t, group_id=task, sample_idx=sample, attempt=attempt)
                for t, (task, sample, attempt) in zip(played, batch, strict=True)
            ]
            write_jsonl(os.fspath(path), new)
            records += new
            retries = [(t.task_id, t.sample_idx, t.attempt + 1) for t in new
                       if t.status is EpisodeStatus.INFRA_ERROR and t.attempt + 1 < max_attempts]
            todo += retries
            bar.add_total(len(retries))
            turns += sum(t.num_turns for t in new)
            tokens += sum(sum(t.loss_mask) for t in new)  # the sampled ones
            bar.set(done + len(batch), turns=turns, tokens=tokens)
    return records
