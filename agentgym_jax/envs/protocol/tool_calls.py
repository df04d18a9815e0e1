"""Tool calls as models write them, and tool schemas in the OpenAI function format.

Shared by the tool-environment servers (`environments/tools/`) and the clients here, so a call
means the same on both sides. `parse_tool_calls` reads, in this order:

- Qwen / Hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (one block per call);
- AgentGym: `Action: <tool> with Action Input: {...}` (after the last `Action:`; the input is JSON
  or a Python literal dict, as AgentGym's own demonstrations write it with single quotes);
- Llama 3: a reply that is one JSON object `{"name": ..., "parameters": {...}}` (or a list of
  them), optionally after `<|python_tag|>`;
- plain text: `tool(key=value, ...)`, `tool {json}` or a bare `tool`, on the last line (or after
  `Action:`).

Every step is a scan or a JSON decode over the text, so a reply is read in time linear in its
length. A reply that tries and fails raises `ToolCallError`, whose message says what was wrong
and how to write a call; servers return it as an invalid-action observation.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import math
from typing import Any, Iterable

from agentgym_jax.envs.protocol import python_source

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
ACTION_MARKER, INPUT_MARKER = "Action:", "with Action Input:"
PYTHON_TAG = "<|python_tag|>"
FORMAT_HELP = ('Write one tool call as "Action: <tool> with Action Input: {<JSON arguments>}" or '
               '<tool_call>{"name": "<tool>", "arguments": {...}}</tool_call>.')
_JSON = json.JSONDecoder()


class ToolCallError(ValueError):
    """A reply that cannot be read as a tool call; the message is shown to the policy."""


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One call: the tool's name and its arguments (a JSON object)."""

    name: str
    arguments: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "arguments": self.arguments}


def function_schema(name: str, description: str, properties: dict[str, Any] | None = None,
                    required: Iterable[str] = ()) -> dict[str, Any]:
    """A tool in the OpenAI function format: `{"type": "function", "function": {...}}`."""
    parameters = {"type": "object", "properties": dict(properties or {}), "required": list(required)}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}


# ---- formatting (oracles write both formats; the client-side templates read them back) ----

def format_agentgym(call: ToolCall) -> str:
    return f"{ACTION_MARKER} {call.name} {INPUT_MARKER} {json.dumps(call.arguments, ensure_ascii=False)}"


def format_hermes(call: ToolCall) -> str:
    return f"{TOOL_CALL_OPEN}\n{json.dumps(call.to_json(), ensure_ascii=False)}\n{TOOL_CALL_CLOSE}"


def format_llama3(call: ToolCall) -> str:
    return json.dumps({"name": call.name, "parameters": call.arguments}, ensure_ascii=False)


# ---- parsing ----

def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every tool call in a reply (at least one), or `ToolCallError` saying why there is none."""
    if TOOL_CALL_OPEN in text:
        return _hermes_calls(text)
    marker = text.rfind(ACTION_MARKER)
    if marker >= 0:
        return [_agentgym_call(text[marker + len(ACTION_MARKER):])]
    stripped = text.strip()
    if stripped.startswith(PYTHON_TAG):
        stripped = stripped[len(PYTHON_TAG):].lstrip()
    if stripped.startswith(("{", "[")):
        return _json_calls(stripped)
    lines = [line.strip() for line in stripped.splitlines() if line.strip()]
    if not lines:
        raise ToolCallError(f"Empty reply: no tool call. {FORMAT_HELP}")
    return [_plain_call(lines[-1])]


def parse_tool_call(text: str) -> ToolCall:
    """The one tool call of a reply; several calls in one turn are refused."""
    calls = parse_tool_calls(text)
    if len(calls) != 1:
        raise ToolCallError(f"Call one tool per turn; this reply calls {len(calls)} "
                            f"({', '.join(c.name for c in calls)}).")
    return calls[0]


def _hermes_calls(text: str) -> list[ToolCall]:
    calls, start = [], text.find(TOOL_CALL_OPEN)
    while start >= 0:
        body_start = start + len(TOOL_CALL_OPEN)
        end = text.find(TOOL_CALL_CLOSE, body_start)
        body = text[body_start:] if end < 0 else text[body_start:end]
        calls.append(_call_object(_decode_json(body.strip(), "the <tool_call> block"), "<tool_call>"))
        start = -1 if end < 0 else text.find(TOOL_CALL_OPEN, end)
    return calls


def _agentgym_call(rest: str) -> ToolCall:
    split = rest.find(INPUT_MARKER)
    if split < 0:
        line = rest.strip().splitlines()[0] if rest.strip() else ""
        if not line:
            raise ToolCallError(f"Nothing follows 'Action:'. {FORMAT_HELP}")
        return _plain_call(line.strip())
    name = rest[:split].strip()
    _check_name(name)
    raw = rest[split + len(INPUT_MARKER):].strip()
    return ToolCall(name, _arguments(raw, f"the Action Input of {name}"))


def _json_calls(text: str) -> list[ToolCall]:
    value = _decode_json(text, "the JSON tool call")
    items = value if isinstance(value, list) else [value]
    if not items:
        raise ToolCallError(f"The JSON tool call list is empty. {FORMAT_HELP}")
    return [_call_object(item, "JSON tool call") for item in items]


def _plain_call(line: str) -> ToolCall:
    """`tool(key=value, ...)`, `tool {json}` or `tool` alone."""
    end = 0
    while end < len(line) and (line[end].isalnum() or line[end] in "_.-"):
        end += 1
    name, rest = line[:end], line[end:].strip()
    if not name:
        raise ToolCallError(f"No tool call found in {_quote(line)}. {FORMAT_HELP}")
    _check_name(name)
    if not rest:
        return ToolCall(name, {})
    if rest.startswith("{"):
        return ToolCall(name, _arguments(rest, f"the arguments of {name}"))
    if rest.startswith("("):
        return ToolCall(name, _keyword_arguments(name, rest))
    raise ToolCallError(f"No tool call found in {_quote(line)}. {FORMAT_HELP}")


def _keyword_arguments(name: str, rest: str) -> dict[str, Any]:
    """`(key=value, ...)` with literal values, read by Python's parser (linear in the text)."""
    close = _matching_close(rest, 0)
    if close < 0:
        raise ToolCallError(f"Unclosed parenthesis in the call of {name}. {FORMAT_HELP}")
    try:
        node = python_source.parse(f"f{rest[:close + 1]}", mode="eval").body
        if not isinstance(node, ast.Call) or node.args:
            raise ToolCallError(f"Pass the arguments of {name} by name: {name}(key=value, ...).")
        arguments = {}
        for keyword in node.keywords:
            if keyword.arg is None:
                raise ToolCallError(f"Pass the arguments of {name} by name: {name}(key=value, ...).")
            arguments[keyword.arg] = ast.literal_eval(keyword.value)
        return arguments
    except ToolCallError:
        raise
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError) as e:
        raise ToolCallError(f"The arguments of {name} are not literal values ({type(e).__name__}). "
                            f"{FORMAT_HELP}") from None


def _arguments(raw: str, what: str) -> dict[str, Any]:
    """A JSON object, or a Python literal dict (single quotes), at the start of `raw`."""
    if not raw.startswith("{"):
        raise ToolCallError(f"{what[0].upper()}{what[1:]} must be a JSON object such as {{\"key\": \"value\"}} "
                            f"(or {{}} for none), got {_quote(raw)}.")
    try:
        value, _ = _JSON.raw_decode(raw)
    except (ValueError, RecursionError):
        close = _matching_close(raw, 0)
        if close < 0:
            raise ToolCallError(f"{what[0].upper()}{what[1:]} has an unclosed '{{'. {FORMAT_HELP}") from None
        try:
            value = ast.literal_eval(raw[:close + 1])
        except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
            raise ToolCallError(f"{what[0].upper()}{what[1:]} is not valid JSON: {_quote(raw)}.") from None
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise ToolCallError(f"{what[0].upper()}{what[1:]} must be a JSON object with string keys.")
    return value


def _decode_json(text: str, what: str) -> Any:
    try:
        value, _ = _JSON.raw_decode(text)
    except (ValueError, RecursionError) as e:
        raise ToolCallError(f"{what[0].upper()}{what[1:]} is not valid JSON ({str(e)[:80]}). {FORMAT_HELP}") from None
    return value


def _call_object(value: Any, what: str) -> ToolCall:
    """`{"name": str, "arguments" | "parameters": object | JSON text}` -> ToolCall."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        raise ToolCallError(f'A {what} must be an object with a "name" and "arguments". {FORMAT_HELP}')
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # OpenAI's wire format carries arguments as JSON text
        arguments = _decode_json(arguments, f"the arguments of {value['name']}") if arguments.strip() else {}
    if not isinstance(arguments, dict):
        raise ToolCallError(f"The arguments of {value['name']} must be a JSON object.")
    _check_name(value["name"])
    return ToolCall(value["name"], arguments)


def _check_name(name: str) -> None:
    if not name or any(c.isspace() for c in name) or len(name) > 128:
        raise ToolCallError(f"{_quote(name)} is not a tool name. {FORMAT_HELP}")


def _matching_close(text: str, start: int) -> int:
    """Index of the bracket closing `text[start]` (quotes and escapes respected), or -1; one pass."""
    depth, quote, escaped = 0, "", False
    for i in range(start, len(text)):
        c = text[i]
        if quote:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == quote:
                quote = ""
        elif c in "\"'":
            quote = c
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 0:
                return i
    return -1


def _quote(text: str, limit: int = 60) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")


# ---- arguments against a schema ----

_TYPES = {"string": str, "number": (int, float), "integer": int, "boolean": bool, "array": list, "object": dict}


def check_arguments(parameters: dict[str, Any], arguments: dict[str, Any], tool: str) -> dict[str, Any]:
    """The arguments checked against a function's JSON-schema `parameters` and lightly coerced
    (numbers written as text, whole floats for integers, numbers for strings), or `ToolCallError`
    naming the bad argument and the expected ones."""
    properties = parameters.get("properties", {})
    expected = ", ".join(properties) or "none"
    unknown = [k for k in arguments if k not in properties]
    if unknown:
        raise ToolCallError(f"{tool} has no argument {', '.join(map(repr, unknown))}; its arguments: {expected}.")
    missing = [k for k in parameters.get("required", []) if k not in arguments]
    if missing:
        raise ToolCallError(f"{tool} needs the argument {', '.join(map(repr, missing))}; its arguments: {expected}.")
    return {key: _coerce(value, properties[key], f"{tool}'s argument {key!r}") for key, value in arguments.items()}


def _coerce(value: Any, schema: dict[str, Any], what: str) -> Any:
    kinds = schema.get("type")
    kinds = [kinds] if isinstance(kinds, str) else list(kinds or [])
    if kinds and not any(_is(value, k) for k in kinds):
        for kind in kinds:
            converted = _convert(value, kind)
            if converted is not None:
                value = converted
                break
        else:
            raise ToolCallError(f"{what} must be {' or '.join(kinds)}, got {_quote(json.dumps(value, default=str))}.")
    if isinstance(value, float) and not math.isfinite(value):
        raise ToolCallError(f"{what} must be a finite number, got {value}.")
    if "enum" in schema and value not in schema["enum"]:
        raise ToolCallError(f"{what} must be one of {', '.join(map(json.dumps, schema['enum']))}, got {_quote(str(value))}.")
    return value


def _is(value: Any, kind: str) -> bool:
    if kind in ("number", "integer") and isinstance(value, bool):
        return False
    return kind in _TYPES and isinstance(value, _TYPES[kind])


def _convert(value: Any, kind: str) -> Any:
    """One lenient conversion, or None: "7" -> 7, 7.0 -> 7 (integer), 7 -> "7" (string)."""
    if kind in ("number", "integer") and isinstance(value, str):
        try:
            number = float(value.strip()) if len(value) < 40 else None
        except ValueError:
            return None
        if number is None or number != number or number in (float("inf"), float("-inf")):
            return None
        if kind == "integer":
            return int(number) if number.is_integer() else None
        return int(number) if number.is_integer() and "." not in value else number
    if kind == "integer" and isinstance(value, float) and value.is_integer():
        return int(value)
    if kind == "string" and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    return None
