"""Function calling as an action format: a sampled reply read as one tool call.

With `RolloutConfig.tool_calls` an episode's prompt carries its session's tools (`GET /tools?id=`,
OpenAI function schemas) where the chat template writes them (`ChatFraming.prompt_ids(tools=)`),
every environment answer is appended as a `tool` message (`Transcript`), and each reply is read
here with the protocol's parser (`envs/protocol/tool_calls.py`, shared with the servers: Qwen's
`<tool_call>` JSON, Llama 3's JSON call, AgentGym's `Action: <tool> with Action Input: {...}`
and the plain `tool(key=value)`), after the reply's reasoning (`<think>...</think>`) is set aside
so that a call the policy only thought about is not made.

A reply that holds one call is sent as that call in AgentGym's format, which every tool server
reads (ours and AgentGym's own). Any other reply (no call, a malformed one, several calls) is
sent as its visible text: the server answers it as an invalid action (reward 0, counted in
`info.invalid_actions`) whose observation says what was wrong, and that observation is the
tool message the policy reads next.
"""

from __future__ import annotations

from agentgym_jax.envs.protocol.tool_calls import ToolCall, ToolCallError, format_agentgym, parse_tool_call

THINK_END = "</think>"


def visible_reply(text: str) -> str:
    """The reply after its reasoning: the text after the last `</think>` (all of it without one)."""
    return text.rsplit(THINK_END, 1)[-1]


def read_call(text: str) -> ToolCall:
    """The one tool call of a reply's visible part, or `ToolCallError` saying why there is none."""
    return parse_tool_call(visible_reply(text))


def action_of(text: str) -> str:
    """What the server receives for a reply: its call in AgentGym's format, else its visible text."""
    try:
        return format_agentgym(read_call(text))
    except ToolCallError:
        return visible_reply(text)
