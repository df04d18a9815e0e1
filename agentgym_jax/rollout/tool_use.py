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

Where the chat template writes no tool list (SmolLM2's ChatML), the tools would never reach the
model: `tool_prompt` then writes them itself, as `tool_list_block` in the system turn (appended
to the system message, or as one of its own), for the rollout engine, the demonstrations and the
gateway alike, so a policy trained on one is served the same prompt by the other.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from typing import Any

from agentgym_jax.envs.protocol.tool_calls import ToolCall, ToolCallError, format_agentgym, parse_tool_call
from agentgym_jax.models.chat import ChatFraming, Framed

THINK_END = "</think>"
_PROBE_TOOL = {"type": "function", "function": {"name": "probe", "description": "A probe.",
                                                "parameters": {"type": "object", "properties": {}}}}


def tool_list_block(tools: Sequence[Mapping[str, Any]]) -> str:
    """The tool list written into the system turn where the template writes none (Hermes-style
    `<tools>` and `<tool_call>` markup, which the protocol's parser reads back)."""
    lines = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return ("# Tools\n\nYou may call the functions below. Their signatures, one JSON object a line:\n"
            f"<tools>\n{lines}\n</tools>\n\n"
            "To call one, reply with its name and arguments as a JSON object inside <tool_call></tool_call> tags:\n"
            '<tool_call>\n{"name": "<function name>", "arguments": {<its arguments>}}\n</tool_call>')


@functools.cache
def writes_tool_list(framing: ChatFraming) -> bool:
    """Whether the framing's chat template writes `tools=` into a prompt at all."""
    probe = [{"role": "user", "content": "Hello."}]
    return framing.prompt_ids(probe, tools=[_PROBE_TOOL]).ids != framing.prompt_ids(probe).ids


def tool_prompt(framing: ChatFraming, messages: Sequence[Mapping[str, str]],
                tools: Sequence[Mapping[str, Any]] | None) -> Framed:
    """The first prompt of `messages` with `tools` (OpenAI function schemas) where the template
    writes them, else with `tool_list_block` in the system turn. No tools: the plain prompt."""
    if not tools or writes_tool_list(framing):
        return framing.prompt_ids(messages, tools=tools)
    block = tool_list_block(tools)
    messages = [dict(m) for m in messages]
    if messages and messages[0]["role"] == "system":
        messages[0]["content"] = f"{messages[0]['content']}\n\n{block}" if messages[0]["content"] else block
    else:
        messages.insert(0, {"role": "system", "content": block})
    return framing.prompt_ids(messages)


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
