"""Trains a small byte-level BPE tokenizer on environment text and writes a Hugging Face folder.

    python -m agentgym_jax.models.build_tokenizer --out=/tmp/tok [--vocab_size=1024]
        [--template=chatml|llama3|gemma] [--text_file=transcripts.txt ...] [--env_url=http://127.0.0.1:8000 ...]

The CPU quickstart trains its tiny model with this tokenizer: a vocabulary of ~1k tokens learned
from the action grammar, the environments' instructions and (when given) oracle transcripts keeps
the embedding table small. A job passes its environment's instruction and oracle transcripts
itself (`job/setup.py`); the command line reads instructions from running servers (`--env_url`,
their `GET /tasks`), since the library never imports a server (architecture rule on servers). The folder (`tokenizer.json`, `tokenizer_config.json` with the chat
template, `special_tokens_map.json`) loads with `AutoTokenizer.from_pretrained`. The same texts
give the same files byte for byte.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import urllib.request
from collections.abc import Iterable, Sequence

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

# The GPT-4 / Llama-3 pre-tokenizer split (Qwen2 uses the same with single digits): words with one
# leading non-letter, digit groups, punctuation runs, newline runs, other whitespace.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Plain ChatML (Qwen2 family markup) without a default system prompt.
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Meta's Llama-3.1-Instruct chat template, as published with the model (tool branches included so
# that the text is the real one; the framing never passes tools).
LLAMA31_TEMPLATE = """{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message + builtin tools #}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if builtin_tools is defined or tools is not none %}
    {{- "Environment: ipython\\n" }}
{%- endif %}
{%- if builtin_tools is defined %}
    {{- "Tools: " + builtin_tools | reject('equalto', 'code_interpreter') | join(", ") + "\\n\\n"}}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
{%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\\n\\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {%- if builtin_tools is defined and tool_call.name in builtin_tools %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
            {{- "<|python_tag|>" + tool_call.name + ".call(" }}
            {%- for arg_name, arg_val in tool_call.arguments | items %}
                {{- arg_name + '="' + arg_val + '"' }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- endif %}
                {%- endfor %}
            {{- ")" }}
        {%- else  %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
            {{- '{"name": "' + tool_call.name + '", ' }}
            {{- '"parameters": ' }}
            {{- tool_call.arguments | tojson }}
            {{- "}" }}
        {%- endif %}
        {%- if builtin_tools is defined %}
            {#- This means we're in ipython mode #}
            {{- "<|eom_id|>" }}
        {%- else %}
            {{- "<|eot_id|>" }}
        {%- endif %}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""


# Gemma's turn markup (Gemma 2 and 3 instruction-tuned models): `<start_of_turn>user` / `model`
# headers, `<end_of_turn>` after every turn, contents trimmed, no system role (a system message is
# prepended to the first user turn, separated by a blank line), strict user/model alternation.
GEMMA_TEMPLATE = """{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set first_user_prefix = messages[0]['content'] + '\n\n' %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set first_user_prefix = '' %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- for message in loop_messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {%- set role = 'model' if message['role'] == 'assistant' else message['role'] %}
    {{- '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}
    {{- message['content'] | trim }}
    {{- '<end_of_turn>\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<start_of_turn>model\n' }}
{%- endif %}
"""


@dataclasses.dataclass(frozen=True)
class TemplateSpec:
    """The special tokens and chat template of one markup family."""

    special_tokens: tuple[str, ...]  # get ids 0..n-1, in this order
    eos_token: str  # what ends an assistant turn
    pad_token: str
    chat_template: str
    bos_token: str | None = None  # prepended by the template (and by `add_special_tokens=True`)


TEMPLATES: dict[str, TemplateSpec] = {
    "chatml": TemplateSpec(
        special_tokens=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHATML_TEMPLATE,
    ),
    "llama3": TemplateSpec(
        special_tokens=(
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eot_id|>",
        ),
        eos_token="<|eot_id|>",
        pad_token="<|end_of_text|>",
        chat_template=LLAMA31_TEMPLATE,
        bos_token="<|begin_of_text|>",
    ),
    "gemma": TemplateSpec(
        special_tokens=("<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"),
        eos_token="<end_of_turn>",
        pad_token="<pad>",
        chat_template=GEMMA_TEMPLATE,
        bos_token="<bos>",
    ),
}

# The words of the environments' action grammars (AgentGym's BabyAI, TextCraft, Maze, Wordle) and
# the ReAct framing, so that actions are few tokens even before transcripts are added.
ACTION_GRAMMAR: tuple[str, ...] = (
    "Thought: I should look at what is around me.\nAction: check available actions",
    "Action: turn left", "Action: turn right", "Action: move forward",
    "Action: go to red ball 1", "Action: go to green key 2", "Action: go to blue box 1",
    "Action: go to yellow door 1", "Action: go to purple ball 2", "Action: go to grey key 1",
    "Action: pick up red ball 1", "Action: drop blue box 1", "Action: toggle yellow door 1",
    "Action: go through grey door 1", "Action: toggle and go through green door 1",
    "Action: get 1 oak log", "Action: get 2 iron ingot", "Action: inventory",
    "Action: craft 4 oak planks using 1 oak log", "Action: craft 1 stick using 2 oak planks",
    "Action: craft 1 crafting table using 4 oak planks",
    "Action: move up", "Action: move down", "Action: move left", "Action: move right",
    "Action: guess crane", "Action: guess slate", "Action: guess fight",
    "Observation: You see a wall to the north, a door to the east and a key in front of you.",
    "Observation: Got 1 oak log. Crafted 4 minecraft:oak_planks. Could not find enough items.",
    "Observation: Your position is (3, 4). The goal is at (0, 7). You hit a wall.",
    "Observation: g r y g b. The letters in the right place are green, yellow means elsewhere.",
    "Inventory: [oak planks] (4) [stick] (2). Crafting commands: craft 1 wooden pickaxe using "
    "3 oak planks, 2 stick. Goal: craft wooden pickaxe.",
    "Task completed! You won. The task failed. Invalid action, please try again.",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 north south east west up down left right",
)


def server_instructions(urls: Sequence[str], timeout_s: float = 30.0) -> list[str]:
    """The instruction text of the environment behind each server URL (`GET /tasks`, the protocol's
    task info), read over HTTP like any client."""
    texts = []
    for url in urls:
        try:
            with urllib.request.urlopen(url.rstrip("/") + "/tasks", timeout=timeout_s) as answer:
                texts.append(str(json.load(answer)["instruction"]))
        except (OSError, ValueError, KeyError) as e:
            raise SystemExit(f"build_tokenizer: no task info from {url}/tasks ({e})") from e
    return texts


def train_tokenizer(
    texts: Iterable[str], vocab_size: int = 1024, template: str = "chatml"
) -> PreTrainedTokenizerFast:
    """Byte-level BPE over `texts` (any text encodes; unseen bytes fall back to byte tokens)."""
    if template not in TEMPLATES:
        raise ValueError(f"unknown template {template!r}; valid: {', '.join(sorted(TEMPLATES))}")
    spec = TEMPLATES[template]
    min_size = len(spec.special_tokens) + 256  # every byte must stay encodable
    if vocab_size < min_size:
        raise ValueError(f"vocab_size={vocab_size} is below {min_size} (special tokens + 256 bytes)")

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(spec.special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(list(texts), trainer)
    byte_level = processors.ByteLevel(trim_offsets=False)
    if spec.bos_token is None:
        tokenizer.post_processor = byte_level
    else:  # like Llama-3: `add_special_tokens=True` prepends BOS (the chat path never asks for it)
        bos = (spec.bos_token, tokenizer.token_to_id(spec.bos_token))
        tokenizer.post_processor = processors.Sequence(
            [byte_level, processors.TemplateProcessing(single=f"{bos[0]} $A", pair=f"{bos[0]} $A $B", special_tokens=[bos])]
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=spec.bos_token,
        eos_token=spec.eos_token,
        pad_token=spec.pad_token,
        chat_template=spec.chat_template,
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 20,
    )


def build_tokenizer(
    out_dir: str | pathlib.Path,
    texts: Iterable[str],
    vocab_size: int = 1024,
    template: str = "chatml",
) -> pathlib.Path:
    """Trains on `texts` plus the action grammar and writes the tokenizer folder to `out_dir`."""
    tokenizer = train_tokenizer([*ACTION_GRAMMAR, *texts], vocab_size, template)
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # save_jinja_files=False keeps the template inside tokenizer_config.json, where every loader looks.
    tokenizer.save_pretrained(out, save_jinja_files=False)
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"  # loads with transformers 4.x as well
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True, ensure_ascii=False) + "\n")
    special = {k: v for k, v in tokenizer.special_tokens_map.items() if isinstance(v, str)}
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2, sort_keys=True) + "\n")
    return out


def _read_text_files(paths: Sequence[str]) -> list[str]:
    texts = []
    for path in paths:
        try:
            texts.append(pathlib.Path(path).read_text(encoding="utf-8"))
        except FileNotFoundError as e:
            raise SystemExit(f"build_tokenizer: text file not found: {path}") from e
    return texts


def main(argv: Sequence[str] | None = None) -> pathlib.Path:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder to write the tokenizer to")
    parser.add_argument("--vocab_size", type=int, default=1024)
    parser.add_argument("--template", default="chatml", choices=sorted(TEMPLATES))
    parser.add_argument("--text_file", action="append", default=[], help="extra training text (repeatable)")
    parser.add_argument("--env_url", action="append", default=[], help="a running environment server whose "
                        "instruction to train on (repeatable)")
    args = parser.parse_args(argv)
    texts = server_instructions(args.env_url) + _read_text_files(args.text_file)
    out = build_tokenizer(args.out, texts, args.vocab_size, args.template)
    print(f"wrote {args.template} tokenizer (vocab {args.vocab_size}) to {out}")
    return out


if __name__ == "__main__":
    main()
