"""Oracle demonstrations as token-exact trajectories (the SFT warm start, AgentTraj-style data).

`play_oracle_episodes` is the one way the library plays an environment's oracle: each task
through `EnvPool.run_episode` with the oracle's actions (`/oracle_action`, or the one named
`oracle`, e.g. Maze's `local`), every action rendered as assistant text (`action_format`, default
`"Action: <action>"`), and that very text is what the server receives and parses. SFT
demonstrations (`job/play.py`) and `mode=eval`/`collect`'s oracle policy (`rollout/collect.py`)
both play through it. `demonstration_trajectory` builds a played episode's trajectory with the
same `Transcript` as the rollout engine: the same first prompt, each assistant turn as
`framing.assistant_ids` (content + end-of-turn ids, loss_mask 1, log-probs 0: no policy sampled
them), each environment answer as `framing.continuation_ids` (loss_mask 0), the final
observation left out. The reward is the sum of the step rewards.

    async with EnvPool(urls) as pool:
        episodes = await play_oracle_episodes(pool, task_ids, horizon=30)
    demos = [demonstration_trajectory(framing, info, ep, group_id=i) for i, ep in enumerate(episodes)]
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from agentgym_jax.envs.pool import EnvPool, PlayedEpisode
from agentgym_jax.envs.protocol import TaskInfo
from agentgym_jax.models.chat import ChatFraming
from agentgym_jax.rollout.trajectory import Trajectory
from agentgym_jax.rollout.transcript import PromptStyle, Transcript, empty_trajectory

ACTION_ONLY = "Action: {action}"
THOUGHT_ACTION = "Thought:\nI will {action}.\n\nAction:\n{action}"  # AgentGym's `Thought: ... Action: ...` layout


def demonstration_trajectory(
    framing: ChatFraming,
    task_info: TaskInfo,
    episode: PlayedEpisode,
    *,
    group_id: int,
    prompt_style: PromptStyle | str = PromptStyle.SHORT,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> Trajectory:
    """A played episode (its actions already rendered as assistant text) -> a trajectory; with
    `tools`, framed as a function-calling episode (`rollout.tool_calls`: the tools in the prompt,
    the answers as tool messages), as the rollout engine frames one."""
    if not episode.turns and not episode.status.is_scored:  # the reset or first oracle call failed
        return empty_trajectory(episode.data_idx, task_info.env, group_id, episode.status)
    transcript = Transcript.start(framing, task_info.instruction, episode.first_observation, prompt_style, tools)
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
    on_finished: Callable[[], None] | None = None,
) -> list[PlayedEpisode]:
    """Plays every task with the oracle, concurrently, on an open pool; the raw transcripts, in
    the order of `task_ids` (`on_finished()`, if given, hears each episode end).

    `action_format` is a `str.format` pattern with an `{action}` field; its rendering is the
    text the server receives and parses, and the assistant text of the demonstration. `oracle`:
    one the environment names (`Environment.oracles`), "" its default.
    """
    if "{action}" not in action_format:
        raise ValueError(f"action_format must contain '{{action}}', got {action_format!r}")

    async def policy(slot: int, observation: str) -> str:
        del observation
        return action_format.format(action=await pool.oracle_action(slot, oracle))

    async def play(task_id: int) -> PlayedEpisode:
        episode = await pool.run_episode(int(task_id), policy, horizon)
        if on_finished is not None:
            on_finished()
        return episode

    return list(await asyncio.gather(*(play(t) for t in task_ids)))
