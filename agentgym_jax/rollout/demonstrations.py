"""Oracle demonstrations as token-exact trajectories (the SFT warm start, AgentTraj-style data).

Each task is played through `EnvPool.run_episode` with the environment's oracle (`/oracle_action`,
or the one named `oracle`, e.g. Maze's `local`);
every oracle action is rendered as assistant text (`action_format`, default `"Action: <action>"`)
and that very text is what the server receives and parses. The trajectory is built with the same
`Transcript` as the rollout engine: the same first prompt, each assistant turn as
`framing.assistant_ids` (content + end-of-turn ids, loss_mask 1, log-probs 0: no policy sampled
them), each environment answer as `framing.continuation_ids` (loss_mask 0), the final
observation left out. The reward is the sum of the step rewards.

    demos = collect_demonstrations(url, framing, task_ids)           # opens its own EnvPool
    demos = await play_demonstrations(pool, framing, info, task_ids) # inside an event loop
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from agentgym_jax.aio import run_sync
from agentgym_jax.envs.pool import EnvPool, Episode
from agentgym_jax.envs.protocol import TaskInfo
from agentgym_jax.models.chat import ChatFraming
from agentgym_jax.rollout.trajectory import Trajectory
from agentgym_jax.rollout.transcript import PromptStyle, Transcript, empty_trajectory

ACTION_ONLY = "Action: {action}"
THOUGHT_ACTION = "Thought:\nI will {action}.\n\nAction:\n{action}"  # AgentGym's `Thought: ... Action: ...` layout


def demonstration_trajectory(
    framing: ChatFraming,
    task_info: TaskInfo,
    episode: Episode,
    *,
    group_id: int,
    prompt_style: PromptStyle | str = PromptStyle.SHORT,
) -> Trajectory:
    """A played episode (its actions already rendered as assistant text) -> a trajectory."""
    if not episode.turns and not episode.status.is_scored:  # the reset or first oracle call failed
        return empty_trajectory(episode.data_idx, task_info.env, group_id, episode.status)
    transcript = Transcript.start(framing, task_info.instruction, episode.first_observation, prompt_style)
    for k, turn in enumerate(episode.turns):
        if k:
            transcript.add_observation(episode.turns[k - 1].observation)
        transcript.add_assistant_text(turn.action)
    return transcript.to_trajectory(
        task_id=episode.data_idx,
        env=task_info.env,
        group_id=group_id,
        turn_rewards=[t.reward for t in episode.turns],
        status=episode.status,
    )


async def play_oracle_episodes(
    pool: EnvPool,
    task_ids: Sequence[int],
    *,
    horizon: int = 100,
    action_format: str = ACTION_ONLY,
    oracle: str = "",
) -> list[Episode]:
    """Plays every task with the oracle, concurrently, on an open pool; the raw transcripts.

    `action_format` is a `str.format` pattern with an `{action}` field; its rendering is the
    text the server receives and parses, and the assistant text of the demonstration. `oracle`:
    one the environment names (`Environment.oracles`), "" its default.
    """
    _check_action_format(action_format)

    async def policy(slot: int, observation: str) -> str:
        del observation
        return action_format.format(action=await pool.oracle_action(slot, oracle))

    return list(await asyncio.gather(*(pool.run_episode(int(t), policy, horizon) for t in task_ids)))


async def play_demonstrations(
    pool: EnvPool,
    framing: ChatFraming,
    task_info: TaskInfo,
    task_ids: Sequence[int],
    *,
    horizon: int = 100,
    prompt_style: PromptStyle | str = PromptStyle.SHORT,
    action_format: str = ACTION_ONLY,
    oracle: str = "",
    group_offset: int = 0,
) -> list[Trajectory]:
    """`play_oracle_episodes`, each turned into a token-exact trajectory (one per task)."""
    episodes = await play_oracle_episodes(pool, task_ids, horizon=horizon, action_format=action_format, oracle=oracle)
    return [
        demonstration_trajectory(framing, task_info, ep, group_id=group_offset + i, prompt_style=prompt_style)
        for i, ep in enumerate(episodes)
    ]


def collect_demonstrations(
    urls: str | Sequence[str],
    framing: ChatFraming,
    task_ids: Sequence[int],
    *,
    pool_kwargs: dict[str, Any] | None = None,
    **kwargs: Any,
) -> list[Trajectory]:
    """`play_demonstrations` on a fresh `EnvPool(urls, **pool_kwargs)`; task info from the server."""
    _check_action_format(kwargs.get("action_format", ACTION_ONLY))

    async def play() -> list[Trajectory]:
        async with EnvPool(urls, **(pool_kwargs or {})) as pool:
            return await play_demonstrations(pool, framing, await pool.tasks(), task_ids, **kwargs)

    return run_sync(play())


def _check_action_format(action_format: str) -> None:
    if "{action}" not in action_format:
        raise ValueError(f"action_format must contain '{{action}}', got {action_format!r}")
