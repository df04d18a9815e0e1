"""One episode's token sequence as it grows: the single place prompts and continuations are framed.

Both the rollout engine (sampled turns) and the oracle demonstrations (rendered turns) build a
`Transcript`, so a demonstration and a rollout of the same task start from the same prompt ids
and append environment answers with the same ids:

    transcript = Transcript.start(framing, instruction, first_observation, PromptStyle.SHORT)
    transcript.add_policy_turn(sampled_ids, sampled_logprobs)    # loss_mask 1
    transcript.add_observation(observation)                      # loss_mask 0
    ...
    Transcript.start(..., tools=schemas)                         # a function-calling episode
    ...
    trajectory = transcript.to_trajectory(task_id=..., env=..., ...)
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from typing import Any

from agentgym_jax.envs.protocol import EpisodeStatus
from agentgym_jax.models.chat import ChatFraming, Framed
from agentgym_jax.rollout.tool_use import tool_prompt
from agentgym_jax.rollout.trajectory import Trajectory

ACKNOWLEDGEMENT = "Ok."  # AgentGym's assistant reply to the instruction turn


class PromptStyle(str, enum.Enum):
    """How the first prompt is built from the task instruction and the first observation.

    SHORT: one user turn, `instruction + "\\n\\n" + observation`.
    AGENTGYM: AgentGym's layout: the instruction as a user turn, an assistant acknowledgement
      (`ACKNOWLEDGEMENT`, prompt tokens: loss_mask 0, never trained on), then the observation as
      a user turn.
    """

    SHORT = "short"
    AGENTGYM = "agentgym"


def prompt_messages(instruction: str, observation: str, style: PromptStyle | str) -> list[dict[str, str]]:
    """The conversation before the policy's first turn."""
    style = PromptStyle(style)
    if style is PromptStyle.SHORT:
        return [{"role": "user", "content": f"{instruction}\n\n{observation}"}]
    return [
        {"role": "user", "content": instruction},
        {"role": "assistant", "content": ACKNOWLEDGEMENT},
        {"role": "environment", "content": observation},
    ]


class Transcript:
    """Token ids, loss mask and log-probs of one episode, appended turn by turn (never re-rendered).

    `answer_role`: how environment answers are appended: "environment" (a user turn, AgentGym's
    way) or "tool" (a function-calling episode: each answer is the result of the turn's call).
    """

    def __init__(self, framing: ChatFraming, prompt: Framed, answer_role: str = "environment"):
        if answer_role == "tool" and framing.tool_error:
            raise ValueError(framing.tool_error)
        self.framing = framing
        self.answer_role = answer_role
        self.prompt_len = len(prompt)
        self.token_ids: list[int] = list(prompt.ids)
        self.loss_mask: list[int] = [0] * len(prompt)
        self.logprobs: list[float] = [0.0] * len(prompt)
        self.turn_spans: list[tuple[int, int]] = []

    @classmethod
    def start(
        cls, framing: ChatFraming, instruction: str, observation: str, style: PromptStyle | str,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> Transcript:
        """A transcript holding the first prompt (ending with the generation header). With `tools`
        (OpenAI function schemas, even none) it is a function-calling episode: the tools are in the
        prompt (`tool_use.tool_prompt`) and environment answers are tool messages."""
        prompt = tool_prompt(framing, prompt_messages(instruction, observation, style), tools)
        return cls(framing, prompt, "environment" if tools is None else "tool")

    @property
    def response_len(self) -> int:
        """Policy and environment tokens after the prompt (what `max_response_length` bounds)."""
        return len(self.token_ids) - self.prompt_len

    @property
    def num_turns(self) -> int:
        return len(self.turn_spans)

    def add_policy_turn(self, ids: Sequence[int], logprobs: Sequence[float] | None = None) -> None:
        """Appends ids the policy produced (its end-of-turn id included if it sampled one)."""
        if len(ids) == 0:
            raise ValueError("a policy turn needs at least one token")
        logprobs = [0.0] * len(ids) if logprobs is None else [float(x) for x in logprobs]
        if len(logprobs) != len(ids):
            raise ValueError(f"{len(ids)} policy ids but {len(logprobs)} log-probs")
        start = len(self.token_ids)
        self.token_ids += [int(i) for i in ids]
        self.loss_mask += [1] * len(ids)
        self.logprobs += logprobs
        self.turn_spans.append((start, len(self.token_ids)))

    def add_assistant_text(self, content: str) -> None:
        """Appends `content` as the policy would have sampled it (content ids + end-of-turn id)."""
        self.add_policy_turn(self.framing.assistant_ids(content).ids)

    def observation_ids(self, observation: str) -> tuple[int, ...]:
        """The exact ids `add_observation` would append (to check a budget before appending)."""
        return self.answer_ids([{"role": self.answer_role, "content": observation}])

    def answer_ids(self, messages: Sequence[Mapping[str, str]]) -> tuple[int, ...]:
        """The exact ids of `messages` answering the last turn: one user or environment message,
        or the results of its tool calls (`ChatFraming.continuation_of`).

        After a turn cut by a token limit (no end-of-turn id sampled) the end-of-turn ids come
        first, as template ids with loss_mask 0, so the conversation stays well-formed.
        """
        ids = self.framing.continuation_of(messages).ids
        closed = not self.turn_spans or self.token_ids[-1] in self.framing.end_of_turn_ids
        return ids if closed else self.framing.end_of_turn_ids + ids

    def add_observation(self, observation: str | None = None, ids: Sequence[int] | None = None) -> tuple[int, ...]:
        """Appends an environment answer (a user or tool turn) plus the next generation header (mask 0).

        Pass `ids` when they were computed already by `observation_ids`. Returns the ids appended.
        """
        if ids is None:
            if observation is None:
                raise ValueError("add_observation needs the observation text or its ids")
            ids = self.observation_ids(observation)
        ids = tuple(int(i) for i in ids)
        self.token_ids += ids
        self.loss_mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        return ids

    def to_trajectory(
        self,
        *,
        task_id: int,
        env: str,
        group_id: int,
        turn_rewards: Sequence[float],
        status: EpisodeStatus,
        **fields: Any,
    ) -> Trajectory:
        """The finished record; its reward is the sum of the environment's step rewards."""
        return Trajectory(
            task_id=task_id,
            env=env,
            group_id=group_id,
            token_ids=list(self.token_ids),
            loss_mask=list(self.loss_mask),
            logprobs=list(self.logprobs),
            turn_spans=list(self.turn_spans),
            turn_rewards=[float(r) for r in turn_rewards],
            reward=float(sum(turn_rewards)),
            status=status,
            text=self.framing.tokenizer.decode(self.token_ids, skip_special_tokens=False),
            **fields,
        )


def empty_trajectory(task_id: int, env: str, group_id: int, status: EpisodeStatus, **fields: Any) -> Trajectory:
    """The record of an episode that never got a prompt (its reset failed): no tokens, reward 0.

    Kept so that infrastructure errors stay in the end-to-end denominator (architecture rule 5).
    """
    return Trajectory(task_id, env, group_id, [], [], [], [], [], 0.0, status, **fields)
