"""The OpenAI chat-completions wire format: requests read and checked, replies written.

A request's messages are normalized (`developer` is `system`, text parts joined, a tool call's
arguments decoded from their JSON text) so that a conversation can be recognised when a client
sends it back. A sampled reply becomes an assistant message: its reasoning (`<think>...</think>`)
in `reasoning_content`, its tool calls (read by the protocol's parser, and only calls of the
request's tools) in `tool_calls` with arguments as JSON text, the rest in `content`. The
sampled ids and log-probs travel in the extension field `agentgym` of the answer.

Errors are OpenAI's shape, `{"error": {"message", "type", "code"}}`, with a 4xx status.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
from collections.abc import Mapping, Sequence
from typing import Any

from agentgym_jax.envs.protocol.tool_calls import ToolCall, ToolCallError, format_hermes, parse_tool_calls
from agentgym_jax.models.chat import ChatFraming, FramingError
from agentgym_jax.rollout.tool_use import THINK_END, visible_reply
from agentgym_jax.sampling.sampler import StopReason

ROLES = ("system", "user", "assistant", "tool")
_TOOL_CALL_BLOCK = re.compile(r"<tool_call>.*?(?:</tool_call>|$)", re.DOTALL)


class GatewayError(Exception):
    """A request the gateway refuses: HTTP `status` and OpenAI's error body."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.code = status, message, kind, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "code": self.code}}


@dataclasses.dataclass(frozen=True)
class ChatRequest:
    messages: list[dict[str, Any]]  # normalized (`normalize_message`)
    tools: list[dict[str, Any]]  # OpenAI function tools, as given
    max_tokens: int | None
    stream: bool
    conversation_id: str | None  # extension: the conversation this request continues
    logprobs: bool
    call_tools: bool = True  # False for tool_choice "none": the tools stay in the prompt, no call is read

    @property
    def tools_key(self) -> str:
        return json.dumps(self.tools, sort_keys=True)

    @property
    def tool_names(self) -> set[str]:
        """The tools a reply may call (none with tool_choice "none")."""
        return {tool["function"]["name"] for tool in self.tools} if self.call_tools else set()


def read_request(body: Any, model: str, sampling: Mapping[str, float]) -> ChatRequest:
    """A checked request. `sampling`: the gateway's own temperature / top_p, which a request may
    repeat but not change (the trainer scores the policy at the temperature it sampled at)."""
    if not isinstance(body, dict):
        raise GatewayError(400, "the body must be a JSON object")
    if not isinstance(body.get("model"), str):
        raise GatewayError(400, f"model is required (a string): this gateway serves {model!r}", code="missing_model")
    if body["model"] != model:
        raise GatewayError(404, f"model {body.get('model')!r} is not served here; this gateway serves {model!r}",
                           "invalid_request_error", "model_not_found")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise GatewayError(400, "messages must be a non-empty list")
    for key, value in sampling.items():
        if body.get(key) is not None and body[key] != value:
            raise GatewayError(400, f"{key}={body[key]!r}: this gateway samples with {key}={value} (the policy being "
                                    f"trained); leave {key} out or pass {value}")
    if body.get("n", 1) != 1:
        raise GatewayError(400, f"n={body.get('n')!r}: one choice per request (send n requests for n samples)")
    if body.get("stop") not in (None, [], ""):
        raise GatewayError(400, "stop sequences are not supported: a turn ends at the model's end-of-turn token")
    if body.get("top_logprobs") not in (None, 0):
        raise GatewayError(400, f"top_logprobs={body['top_logprobs']!r} is not supported: the sampler keeps the sampled "
                                "token's log-prob only (logprobs=true gives it); leave top_logprobs out or 0")
    if body.get("response_format") not in (None, {"type": "text"}):
        raise GatewayError(400, f"response_format={body['response_format']!r} is not supported: replies are sampled "
                                "unconstrained from the policy being trained; leave it out or {'type': 'text'}")
    if body.get("tool_choice") not in (None, "auto", "none"):
        raise GatewayError(400, f"tool_choice={body.get('tool_choice')!r} is not supported (only 'auto' and 'none')")
    tools = body.get("tools") or []
    if not isinstance(tools, list) or not all(_is_function_tool(t) for t in tools):
        raise GatewayError(400, 'tools must be a list of {"type": "function", "function": {"name": ..., "parameters": ...}}')
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1):
        raise GatewayError(400, f"max_tokens must be a positive integer, got {max_tokens!r}")
    conversation_id = body.get("conversation_id")
    if conversation_id is not None and not isinstance(conversation_id, str):
        raise GatewayError(400, "conversation_id must be a string (the agentgym.conversation_id of an earlier answer)")
    return ChatRequest([normalize_message(m, i) for i, m in enumerate(messages)], tools, max_tokens,
                       bool(body.get("stream")), conversation_id, bool(body.get("logprobs")),
                       call_tools=body.get("tool_choice") != "none")


def _is_function_tool(tool: Any) -> bool:
    return (isinstance(tool, dict) and tool.get("type") == "function" and isinstance(tool.get("function"), dict)
            and isinstance(tool["function"].get("name"), str))


def normalize_message(message: Any, index: int) -> dict[str, Any]:
    """`{"role", "content": str, "tool_calls": [ToolCall, ...]}` of one request message."""
    if not isinstance(message, dict):
        raise GatewayError(400, f"message {index} must be an object")
    role = "system" if message.get("role") == "developer" else message.get("role")
    if role not in ROLES:
        raise GatewayError(400, f"message {index} has role {message.get('role')!r}; valid: {', '.join(ROLES)}, developer")
    content = message.get("content")
    if isinstance(content, list):  # content parts: text only
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise GatewayError(400, f"message {index}: only text content parts are supported")
        content = "".join(p["text"] for p in content)
    if content is not None and not isinstance(content, str):
        raise GatewayError(400, f"message {index}: content must be a string, text parts or null")
    normalized = {"role": role, "content": content or ""}
    if role == "assistant":
        normalized["tool_calls"] = [_read_call(call, index) for call in message.get("tool_calls") or []]
        if isinstance(message.get("reasoning_content"), str):
            normalized["reasoning_content"] = message["reasoning_content"]
    return normalized


def _read_call(call: Any, index: int) -> ToolCall:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise GatewayError(400, f"message {index}: a tool call needs function.name and function.arguments")
    arguments = function.get("arguments") or {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            raise GatewayError(400, f"message {index}: the arguments of {function['name']} are not JSON") from None
    if not isinstance(arguments, dict):
        raise GatewayError(400, f"message {index}: the arguments of {function['name']} must be a JSON object")
    return ToolCall(function["name"], arguments)


def message_key(message: Mapping[str, Any]) -> tuple:
    """What must be equal for a sent-back message to be the one the gateway answered."""
    calls = tuple((c.name, json.dumps(c.arguments, sort_keys=True)) for c in message.get("tool_calls", ()))
    return message["role"], message["content"], calls


def framing_message(framing: ChatFraming, message: Mapping[str, Any]) -> dict[str, str]:
    """A normalized message as the framing takes it. An assistant message the gateway did not
    sample (history from elsewhere) is written as the chat template writes it, its tool calls
    as `<tool_call>` blocks where the template drops them."""
    if message["role"] != "assistant":
        return {"role": message["role"], "content": message["content"]}
    calls = message.get("tool_calls", [])
    openai = {"role": "assistant", "content": message["content"],
              "tool_calls": [{"type": "function", "function": c.to_json()} for c in calls]}
    if "reasoning_content" in message:
        openai["reasoning_content"] = message["reasoning_content"]
    try:
        text = framing.render_assistant(openai)
    except FramingError:  # a template that fails on this message: its content, its calls as blocks
        text = None
    if text is None or (calls and not all(c.name in text for c in calls)):
        text = "\n".join([message["content"]] * bool(message["content"]) + [format_hermes(c) for c in calls])
    return {"role": "assistant", "content": text}


def reply_message(text: str, tool_names: set[str], number: int, turn: int) -> dict[str, Any]:
    """A sampled reply (decoded, end-of-turn dropped) as an OpenAI assistant message."""
    reasoning = None
    if THINK_END in text:
        reasoning = text.rsplit(THINK_END, 1)[0].split("<think>", 1)[-1].strip("\n")
    visible = visible_reply(text)
    calls: list[ToolCall] = []
    if tool_names:
        try:
            calls = parse_tool_calls(visible)
        except ToolCallError:
            calls = []
        if not all(call.name in tool_names for call in calls):  # a word on the last line is not a call
            calls = []
    content = _TOOL_CALL_BLOCK.sub("", visible).strip() if calls else visible
    message: dict[str, Any] = {"role": "assistant", "content": content or None}
    if calls:
        message["tool_calls"] = [
            {"id": f"call_{number}_{turn}_{i}", "type": "function",
             "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)}}
            for i, c in enumerate(calls)]
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    return message


def finish_reason(message: Mapping[str, Any], stop: StopReason) -> str:
    if message.get("tool_calls"):
        return "tool_calls"
    return "stop" if stop is StopReason.END_OF_TURN else "length"


def completion(
    model: str, message: dict[str, Any], reason: str, *, conversation_id: str, turn: int, prompt_ids: Sequence[int],
    completion_ids: Sequence[int], completion_logprobs: Sequence[float], context_tokens: int,
    token_logprobs: list[dict[str, Any]] | None,
) -> dict[str, Any]:
    """A `chat.completion` object with the `agentgym` extension (conversation, ids, log-probs)."""
    return {
        "id": f"chatcmpl-{conversation_id}-{turn}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": reason,
                     "logprobs": None if token_logprobs is None else {"content": token_logprobs}}],
        "usage": {"prompt_tokens": context_tokens, "completion_tokens": len(completion_ids),
                  "total_tokens": context_tokens + len(completion_ids)},
        "agentgym": {
            "conversation_id": conversation_id,
            "turn": turn,
            "prompt_token_ids": list(map(int, prompt_ids)),  # the ids appended before this turn
            "completion_token_ids": list(map(int, completion_ids)),
            "completion_logprobs": [float(x) for x in completion_logprobs],
        },
    }


def stream_events(body: dict[str, Any]) -> list[bytes]:
    """A `chat.completion` as server-sent `chat.completion.chunk` events: the message in one
    delta (the turn is sampled whole), then the finish reason, then `[DONE]`."""
    choice = body["choices"][0]
    delta = {k: v for k, v in choice["message"].items() if v is not None}
    if "tool_calls" in delta:
        delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(delta["tool_calls"])]
    base = {"id": body["id"], "object": "chat.completion.chunk", "created": body["created"], "model": body["model"]}
    chunks = [
        {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": None, "logprobs": choice["logprobs"]}]},
        {**base, "choices": [{"index": 0, "delta": {}, "finish_reason": choice["finish_reason"]}],
         "usage": body["usage"], "agentgym": body["agentgym"]},
    ]
    return [f"data: {json.dumps(c, ensure_ascii=False)}\n\n".encode() for c in chunks] + [b"data: [DONE]\n\n"]
