"""The shared tool-call parser and argument checker (`agentgym_jax/envs/protocol/tool_calls.py`)."""

from __future__ import annotations

import ast
import concurrent.futures
import gc
import time

import pytest

from agentgym_jax.envs.protocol import python_source
from agentgym_jax.envs.protocol.tool_calls import (
    ToolCall, ToolCallError, check_arguments, format_agentgym, format_hermes, format_llama3, function_schema,
    parse_tool_call, parse_tool_calls)

CALL = ToolCall("get_distance", {"latitude1": 47.45, "longitude1": -122.31, "name": "Zürich \"Kloten\"", "tags": [1, {"a": None}]})


@pytest.mark.parametrize("text, expected", [
    ("Thought: I need the date.\n\nAction: get_user_current_date with Action Input: {}", ToolCall("get_user_current_date", {})),
    ('Action: get_latitude_longitude with Action Input: {"name": "Seattle"}\nObservation: made up',
     ToolCall("get_latitude_longitude", {"name": "Seattle"})),
    # AgentGym's own demonstrations write Python dicts with single quotes
    ("Action: sort_sheet_by_col with Action Input: {'col_num': '7', 'order': 'des'}",
     ToolCall("sort_sheet_by_col", {"col_num": "7", "order": "des"})),
    ("Action: Thought Action: finish with Action Input: {\"answer\": 3}", ToolCall("finish", {"answer": 3})),
    ('<tool_call>\n{"name": "get_projects", "arguments": {}}\n</tool_call>', ToolCall("get_projects", {})),
    ('I will look.<tool_call>{"name": "get_tasks", "arguments": "{\\"project_id\\": \\"2200\\"}"}</tool_call>',
     ToolCall("get_tasks", {"project_id": "2200"})),
    ('<|python_tag|>{"name": "loadPaperNet", "parameters": {}}', ToolCall("loadPaperNet", {})),
    ('{"name": "paperNodeCheck", "parameters": {"node": "Networks of Scientific Papers"}}',
     ToolCall("paperNodeCheck", {"node": "Networks of Scientific Papers"})),
    ("get_cell_value(position='B3')", ToolCall("get_cell_value", {"position": "B3"})),
    ("Let me think.\nfinish(answer=[1, 'two'])", ToolCall("finish", {"answer": [1, "two"]})),
    ("get_user_current_location", ToolCall("get_user_current_location", {})),
    ('get_search_movie {"movie_name": "Heat"}', ToolCall("get_search_movie", {"movie_name": "Heat"})),
    ("Action: check_valid_actions", ToolCall("check_valid_actions", {})),
])
def test_each_format_reads_to_the_same_call(text, expected):
    assert parse_tool_call(text) == expected


@pytest.mark.parametrize("write", [format_agentgym, format_hermes, format_llama3])
def test_written_calls_read_back_exactly(write):
    assert parse_tool_call(write(CALL)) == CALL
    if write is not format_llama3:  # a Llama 3 call is the whole reply
        assert parse_tool_call(f"Thought: go.\n\n{write(CALL)}") == CALL


def test_several_calls_are_listed_and_refused_as_one_turn():
    text = format_hermes(ToolCall("a", {})) + "\n" + format_hermes(ToolCall("b", {"x": 1}))
    assert parse_tool_calls(text) == [ToolCall("a", {}), ToolCall("b", {"x": 1})]
    assert parse_tool_calls('[{"name": "a", "parameters": {}}, {"name": "b", "arguments": {}}]') == [
        ToolCall("a", {}), ToolCall("b", {})]
    with pytest.raises(ToolCallError, match="one tool per turn; this reply calls 2 \\(a, b\\)"):
        parse_tool_call(text)


@pytest.mark.parametrize("text, message", [
    ("", "Empty reply"),
    ("   \n  ", "Empty reply"),
    ("I do not know what to do.", "No tool call found"),
    ("Action:   ", "Nothing follows 'Action:'"),
    ("Action: finish with Action Input: Seattle", "must be a JSON object"),
    ("Action: finish with Action Input: {\"answer\": ", "unclosed"),
    ("Action: finish with Action Input: {'answer': nonsense}", "not valid JSON"),
    ("Action: finish with Action Input: [1, 2]", "must be a JSON object"),
    ("Action: two words with Action Input: {}", "is not a tool name"),
    ("x" * 5000, "is not a tool name"),
    ("<tool_call>{\"name\": \"x\", \"arguments\": {</tool_call>", "not valid JSON"),
    ("<tool_call>{\"arguments\": {}}</tool_call>", "\"name\" and \"arguments\""),
    ("<tool_call>{\"name\": \"x\", \"arguments\": [1]}</tool_call>", "must be a JSON object"),
    ('{"name": "x", "parameters": {"a": 1}', "not valid JSON"),
    ("[]", "list is empty"),
    ("get_cell_value('B3')", "by name"),
    ("get_cell_value(position=open('x'))", "not literal values"),
    ("get_cell_value(position='B3'", "Unclosed parenthesis"),
])
def test_malformed_calls_say_what_is_wrong(text, message):
    with pytest.raises(ToolCallError, match=message) as error:
        parse_tool_call(text)
    assert len(str(error.value)) < 600


@pytest.mark.parametrize("text", [
    "Action: " * 30_000,
    "<tool_call>" * 20_000,
    "Action: x with Action Input: " + "{" * 200_000,
    "Action: x with Action Input: {'a': '" + "\\'" * 100_000,
    "f" + "(" * 200_000,
    "[" * 200_000,
    '{"name": "x", "arguments": ' + "[" * 100_000,
    "<tool_call>" + '{"name": "x", "arguments": {"a": "' + "a" * 250_000,
    "x" * 250_000,
])
def test_pathological_replies_are_read_in_linear_time(text):
    """256 KB (the servers' body limit) of adversarial text: an answer well within a second."""
    start = time.perf_counter()
    try:
        parse_tool_calls(text)
    except ToolCallError:
        pass
    assert time.perf_counter() - start < 1.0


SCHEMA = function_schema("t", "test", {
    "n": {"type": "number"}, "k": {"type": "integer"}, "s": {"type": "string"}, "flag": {"type": "boolean"},
    "order": {"type": "string", "enum": ["asc", "des"]}, "answer": {"type": ["string", "number", "array"]},
}, required=["n"])["function"]["parameters"]


def test_arguments_are_checked_and_lightly_coerced():
    assert check_arguments(SCHEMA, {"n": "7", "k": 3.0, "s": 12, "order": "asc", "answer": [1]}, "t") == {
        "n": 7, "k": 3, "s": "12", "order": "asc", "answer": [1]}
    assert check_arguments(SCHEMA, {"n": "-2.5", "k": "4"}, "t") == {"n": -2.5, "k": 4}


@pytest.mark.parametrize("arguments, message", [
    ({}, "needs the argument 'n'; its arguments: n, k, s, flag, order, answer"),
    ({"n": 1, "lat": 2}, "has no argument 'lat'"),
    ({"n": "seven"}, "argument 'n' must be number"),
    ({"n": True}, "argument 'n' must be number"),
    ({"n": 1, "k": 2.5}, "argument 'k' must be integer"),
    ({"n": 1, "flag": "yes"}, "argument 'flag' must be boolean"),
    ({"n": 1, "order": "up"}, "must be one of \"asc\", \"des\""),
    ({"n": float("inf")}, "finite"),
    ({"n": "nan"}, "must be number"),
    ({"n": 1, "answer": {"a": 1}}, "must be string or number or array"),
])
def test_bad_arguments_name_the_argument_and_the_expected_ones(arguments, message):
    with pytest.raises(ToolCallError, match=message.replace("(", "\\(")):
        check_arguments(SCHEMA, arguments, "t")


def test_python_source_parses_from_many_threads_while_jax_collects_garbage():
    """Plain `ast.parse` fails here with "AST constructor recursion depth mismatch" (CPython 3.11)."""
    import jax  # noqa: F401  registers the garbage-collection callback that releases the GIL

    from environments.code import problems
    sources = [p.test + p.prompt for p in problems.all_problems()]
    expected = [len(ast.parse(s).body) for s in sources]
    threshold = gc.get_threshold()
    gc.set_threshold(50, 1, 1)
    try:
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            parsed = list(pool.map(lambda _: [len(python_source.parse(s).body) for s in sources], range(48)))
    finally:
        gc.set_threshold(*threshold)
    assert parsed == [expected] * 48
