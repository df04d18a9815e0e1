"""The gateway's open conversations, and which one a request continues.

A conversation is a `Transcript` (token ids, loss mask on the sampled ids, sampler log-probs,
turn spans) plus the messages a client must send back to continue it: the request's messages
and each assistant message the gateway answered (`openai_format.message_key`). A request
continues the conversation it names (`conversation_id`), else the open one whose messages it
extends (the longest such, the latest used among equals: conversations identical so far are
interchangeable so far); its new messages must answer the last turn (tool results or a user
message). Anything else starts a new conversation whose prompt is the whole request, earlier
assistant turns included as prompt (loss_mask 0): token-exact, but not trained on.

Conversations of an agent episode (an RL or evaluation job's, `gateway/episodes.py`) carry the
episode's key; a request made with that key matches only them, so episodes never share one.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Any

from agentgym_jax.gateway.openai_format import ChatRequest, GatewayError, message_key
from agentgym_jax.rollout.transcript import Transcript


@dataclasses.dataclass(eq=False)
class Conversation:
    number: int  # seeds its draws; its default task and group id
    id: str
    transcript: Transcript
    tools_key: str
    keys: list[tuple] = dataclasses.field(default_factory=list)  # `message_key` of every message so far
    row: int | None = None  # the sampler row holding its cache (`Batcher`)
    last_used: float = dataclasses.field(default_factory=time.monotonic)
    busy: bool = False  # a request of it is in flight
    episode: str | None = None  # the agent episode it belongs to (its key), None outside one
    versions: list[int] = dataclasses.field(default_factory=list)  # the policy version of each sampled id

    @property
    def token_ids(self) -> list[int]:
        return self.transcript.token_ids

    def token_versions(self) -> list[int]:
        """Per token id, the version that sampled it (-1 off the loss mask): `Trajectory.token_versions`."""
        versions = iter(self.versions)
        return [next(versions) if m else -1 for m in self.transcript.loss_mask]


class ConversationTable:
    """Open conversations by id, and the matching of requests to them."""

    def __init__(self) -> None:
        self.open: dict[str, Conversation] = {}
        self._numbers = itertools.count()
        self.expired = 0

    def new(self, transcript: Transcript, tools_key: str, episode: str | None = None) -> Conversation:
        number = next(self._numbers)
        conversation = Conversation(number, f"conv-{number}", transcript, tools_key, episode=episode)
        self.open[conversation.id] = conversation
        return conversation

    def match(self, request: ChatRequest, episode: str | None = None) -> tuple[Conversation | None, list[dict[str, Any]]]:
        """(the conversation of `episode` the request continues and its new messages), or (None, all of them)."""
        keys = [message_key(m) for m in request.messages]
        if request.conversation_id is not None:
            conversation = self.open.get(request.conversation_id)
            if conversation is None or conversation.episode != episode:
                raise GatewayError(404, f"conversation {request.conversation_id!r} is closed (rewarded or expired) "
                                        "or unknown", code="conversation_not_found")
            if conversation.busy:
                raise GatewayError(409, f"conversation {conversation.id!r} has a request in flight", code="conversation_busy")
            if conversation.tools_key != request.tools_key:
                return None, request.messages  # other tools: the prompt is framed anew
            known = len(conversation.keys)
            if keys[:known] != conversation.keys:
                at = next((i for i, (a, b) in enumerate(zip(keys, conversation.keys)) if a != b), len(keys))
                raise GatewayError(409, f"message {at} differs from conversation {conversation.id!r}: send its messages "
                                        "and the assistant messages it answered unchanged, or leave conversation_id out",
                                   code="conversation_mismatch")
            if not _answers(request.messages[known:]):
                raise GatewayError(400, f"the messages after the {known} of conversation {conversation.id!r} must answer "
                                        "its last turn: tool results or one user message")
            return conversation, request.messages[known:]
        candidates = [c for c in self.open.values()
                      if c.episode == episode and not c.busy and c.tools_key == request.tools_key and len(c.keys) < len(keys)
                      and keys[: len(c.keys)] == c.keys and _answers(request.messages[len(c.keys):])]
        if not candidates:
            return None, request.messages
        best = max(candidates, key=lambda c: (len(c.keys), c.last_used))
        return best, request.messages[len(best.keys):]

    def close(self, conversation_id: str) -> Conversation:
        conversation = self.open.get(conversation_id)
        if conversation is None:
            raise GatewayError(404, f"conversation {conversation_id!r} is closed (rewarded or expired) or unknown",
                               code="conversation_not_found")
        if conversation.busy:
            raise GatewayError(409, f"conversation {conversation_id!r} has a request in flight", code="conversation_busy")
        return self.open.pop(conversation_id)

    def of_episode(self, episode: str) -> list[Conversation]:
        """The episode's open conversations, taken out of the table, in the order they began."""
        mine = [c for c in self.open.values() if c.episode == episode]
        for conversation in mine:
            del self.open[conversation.id]
        return mine

    def idle_since(self, deadline: float) -> list[Conversation]:
        """Conversations unused since `deadline` (monotonic), taken out of the table."""
        stale = [c for c in self.open.values() if not c.busy and c.last_used < deadline]
        for conversation in stale:
            del self.open[conversation.id]
        self.expired += len(stale)
        return stale


def _answers(messages: list[dict[str, Any]]) -> bool:
    """One user message, or one or more tool results."""
    roles = [m["role"] for m in messages]
    return roles == ["user"] or (bool(roles) and set(roles) == {"tool"})
