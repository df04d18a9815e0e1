"""Chat framing at the token level: exact ids for a conversation, and the role of every token.

DESIGN rule 3 (token in, token out): a trajectory is the prompt ids, then for every turn the ids
the policy sampled and the ids appended for the environment's answer. The rollout never renders
the conversation again; it asks this module once per turn for the ids to append:

    framing = ChatFraming(tokenizer)
    prompt = framing.prompt_ids(messages, tools=tools)    # system? + user ... + generation header
    ...policy samples `sampled` (ending with one of framing.end_of_turn_ids)...
    nxt = framing.continuation_ids(observation)           # after-end-of-turn + user turn + header
    nxt = framing.continuation_ids(result, role="tool")   # or the answer to a tool call
    sequence = prompt.ids + sampled + nxt.ids + ...

The template text around message contents is read off the chat template itself (conversations
with sentinel contents, rendered and split), so Llama-3's system block with its dates, Qwen2.5's
default system prompt, the tool list a template writes for `tools=` (JSON schemas in the OpenAI
function format), its `tool` messages (Qwen3: `<tool_response>` blocks in a user turn) or any
other markup come from the template, not from code here.

Where the template is prefix-stable (rendering a longer conversation only appends to the
rendering of a shorter one), the framed ids equal `apply_chat_template(..., tokenize=True)`.
This is checked at construction on probe conversations; a template whose prompts or turn markup
cannot be framed exactly is refused with the reason. Some templates render history differently
from what the policy saw while it played: Qwen3 drops the `<think>` block of an earlier
assistant turn once a user message follows it (and an empty block even before tool results),
renders a conversation's last assistant turn with an empty think block, and with
`enable_thinking=False` writes into every generation prompt an empty think block that earlier
turns lack. The framed ids are then the ones the sampler saw at each turn (what the trainer
trains on), not the template's rendering of the finished conversation; `deviations` names each
such difference, found by probing (docs/tools.md, "Where a template re-renders history").

Conventions:
- `environment` messages are rendered as the template's `user` role (AgentGym sends
  observations as user turns); their tokens carry `Role.ENVIRONMENT`.
- `tool` messages (a tool call's result) are rendered as the template renders its `tool` role;
  one or more of them answer an assistant turn. A template that cannot render them, or changes
  their contents, leaves `tool_error` set, and framing a tool message raises it.
- An assistant turn is its content tokenized on its own followed by the end-of-turn token: what
  the policy samples after the generation header. This equals `apply_chat_template` except when
  the content starts with whitespace that BPE would merge with the header's last characters
  (ChatML `assistant\\n` + `\\nfoo`); then the ids here are the ones the sampler would have seen.
- Control-token text inside a message (an observation containing `<|im_end|>`) is encoded as
  plain text, on its own, as `apply_chat_template(..., sanitize_control_tokens=True)` does, so
  that no message can end a turn or forge a header. In assistant contents only special tokens
  are; other added tokens (Qwen3's `<tool_call>`, `<think>`) are the single ids a policy samples.
- Conversations are `[system], user|environment, (assistant, user|environment|tool+)*,
  [assistant]`. Without a system message the template's own default (if any) is used and its
  tokens are `Role.TEMPLATE`.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jinja2
from transformers import PreTrainedTokenizerBase


class Role(str, enum.Enum):
    """Who a token belongs to. Only `ASSISTANT` tokens were (or would be) sampled by the policy."""

    SYSTEM = "system"
    USER = "user"
    ASSISTANT = "assistant"
    ENVIRONMENT = "environment"
    TOOL = "tool"  # a tool call's result
    TEMPLATE = "template"  # markup: headers, end-of-turn after non-assistant turns, BOS, defaults


MESSAGE_ROLES = (Role.SYSTEM, Role.USER, Role.ASSISTANT, Role.ENVIRONMENT, Role.TOOL)
_USER_LIKE = (Role.USER, Role.ENVIRONMENT)
_ANSWERS = (*_USER_LIKE, Role.TOOL)  # what may follow an assistant turn


class FramingError(ValueError):
    """A template or conversation that cannot be framed exactly."""


@dataclasses.dataclass(frozen=True)
class Framed:
    """Token ids `[seq]` and the role of each token `[seq]`."""

    ids: tuple[int, ...] = ()
    roles: tuple[Role, ...] = ()

    def __post_init__(self):
        if len(self.ids) != len(self.roles):
            raise ValueError(f"{len(self.ids)} ids but {len(self.roles)} roles")

    def __len__(self) -> int:
        return len(self.ids)

    def __add__(self, other: Framed) -> Framed:
        return Framed(self.ids + other.ids, self.roles + other.roles)


@dataclasses.dataclass(frozen=True)
class TemplateParts:
    """The template's text between message contents, read off sentinel renderings.

    A conversation renders as
    `head [system content system_to_user] user content (user_suffix assistant_header
    assistant content end_of_turn after_end_of_turn user_header user content)* user_suffix`,
    and `add_generation_prompt` appends `generation_header` (the same as `assistant_header`
    where the template is prefix-stable).
    """

    head_with_system: str | None  # before the system content; None: template refuses system
    system_to_user: str | None  # after the system content, up to the first user content
    head_without_system: str | None  # before the first user content (may hold a default system)
    user_suffix: str  # after a user content
    generation_header: str  # what `add_generation_prompt` appends: the header the policy samples after
    end_of_turn: str  # the control token that ends an assistant turn (the policy samples it)
    after_end_of_turn: str  # template text after it (ChatML: "\n")
    user_header: str  # before a later user content
    stripped_roles: frozenset[Role]  # roles whose content the template strips of whitespace
    assistant_header: str = ""  # before an earlier assistant content, as the template renders history


@dataclasses.dataclass(frozen=True)
class ToolParts:
    """The markup of tool results: after an assistant turn's `end_of_turn after_end_of_turn`,
    `tool_header content (tool_separator content)* tool_suffix`, then the next assistant header."""

    tool_header: str
    tool_separator: str
    tool_suffix: str
    stripped: bool  # the template strips tool contents of whitespace


@dataclasses.dataclass(frozen=True)
class Deviation:
    """A way the template's rendering of a finished conversation differs from the framed ids (what
    the sampler saw turn by turn). `kind`: "generation_header", "final_turn" or "history"."""

    kind: str
    detail: str


class _Text(NamedTuple):
    """A piece of rendered text: template markup (split at control tokens) or message content."""

    text: str
    role: Role
    markup: bool


def _markup(text: str) -> _Text:
    return _Text(text, Role.TEMPLATE, True)


def _alternation(tokens: Sequence[str]) -> re.Pattern | None:
    """A splitting regex (one capture group) matching any of `tokens`, longest first."""
    return re.compile("(" + "|".join(map(re.escape, tokens)) + ")") if tokens else None


def _sentinel(i: int) -> str:
    return f"@@agentgym-sentinel-{i}@@"


def _split_at_sentinels(text: str, count: int) -> list[str]:
    """`head s0 p1 s1 ... p_n` -> `[head, p1, ..., p_n]`; each sentinel must appear once, in order."""
    pieces, rest = [], text
    for i in range(count):
        before, sep, rest = rest.partition(_sentinel(i))
        if not sep or _sentinel(i) in rest:
            raise FramingError(
                "the chat template does not render each message content once and verbatim "
                f"(content {i} of a probe conversation is missing or repeated)"
            )
        pieces.append(before)
    return pieces + [rest]


def _padded(i: int) -> str:
    return f" \n{_sentinel(i)}\n "


def _sentinel_conversation(roles: Sequence[Role], pad: Role | None = None) -> list[dict[str, str]]:
    """Messages with sentinel contents (padded with whitespace for the role `pad`)."""
    return [{"role": r.value, "content": _padded(i) if r is pad else _sentinel(i)} for i, r in enumerate(roles)]


def _text_roles(with_system: bool) -> list[Role]:
    """`[system], user, assistant, user, assistant, user`."""
    return ([Role.SYSTEM] if with_system else []) + [Role.USER, Role.ASSISTANT] * 2 + [Role.USER]


Render = Callable[[list[dict[str, str]], bool], str]


def read_template_parts(render: Render, control_tokens: Sequence[str]) -> TemplateParts:
    """Reads the markup around contents from renderings of sentinel conversations.

    `render(messages, add_generation_prompt) -> text`. Checks that the markup is the same at every
    turn, that an assistant turn ends with a control token and that the generation prompt only
    appends a header; raises `FramingError` naming what differs otherwise.
    """

    def variant(with_system: bool) -> dict[str, str] | None:
        messages = _sentinel_conversation(_text_roles(with_system))
        try:
            gen = _split_at_sentinels(render(messages, True), len(messages))
            plain = _split_at_sentinels(render(messages, False), len(messages))
            ends_assistant = _split_at_sentinels(render(messages[:-1], False), len(messages) - 1)
        except jinja2.TemplateError:
            return None  # e.g. a template that raises on a system message
        head = gen[:2] if with_system else gen[:1]
        u2a_1, a2u_1, u2a_2, a2u_2 = gen[len(head) : len(head) + 4]
        tail_gen, user_suffix, assistant_end = gen[-1], plain[-1], ends_assistant[-1]
        if gen[:-1] != plain[:-1] or not tail_gen.startswith(user_suffix) or tail_gen == user_suffix:
            raise FramingError("add_generation_prompt must only append a header after the last message")
        if u2a_1 != u2a_2 or not u2a_1.startswith(user_suffix):
            raise FramingError(f"the template renders assistant turns after different markup ({u2a_1!r} vs {u2a_2!r})")
        if a2u_1 != a2u_2 or not a2u_1.startswith(assistant_end):
            raise FramingError(f"the template renders later turns differently ({a2u_1!r} vs {a2u_2!r})")
        return {
            "head": head[0],
            "system_to_user": head[1] if with_system else None,
            "user_suffix": user_suffix,
            "generation_header": tail_gen[len(user_suffix) :],
            "assistant_header": u2a_1[len(user_suffix) :],
            "assistant_end": assistant_end,
            "user_header": a2u_1[len(assistant_end) :],
        }

    with_system, without_system = variant(True), variant(False)
    if with_system is None and without_system is None:
        raise FramingError("the chat template fails on a plain [system,] user/assistant conversation")
    common = ("user_suffix", "generation_header", "assistant_header", "assistant_end", "user_header")
    if with_system and without_system and any(with_system[k] != without_system[k] for k in common):
        raise FramingError("the template renders turns differently with and without a system message")
    parts = with_system or without_system
    end = parts["assistant_end"]
    end_of_turn = next((t for t in sorted(control_tokens, key=len, reverse=True) if end.startswith(t)), None)
    if end_of_turn is None:
        raise FramingError(
            f"an assistant turn ends with {end!r}, which does not start with a control token; "
            "the sampler needs one token to stop on"
        )
    return TemplateParts(
        head_with_system=with_system["head"] if with_system else None,
        system_to_user=with_system["system_to_user"] if with_system else None,
        head_without_system=without_system["head"] if without_system else None,
        user_suffix=parts["user_suffix"],
        generation_header=parts["generation_header"],
        end_of_turn=end_of_turn,
        after_end_of_turn=end[len(end_of_turn) :],
        user_header=parts["user_header"],
        stripped_roles=_stripped_roles(render, with_system is not None),
        assistant_header=parts["assistant_header"],
    )


def _is_stripped(render: Render, roles: Sequence[Role], role: Role) -> bool:
    """Whether the template strips `role`'s contents (Llama-3's `| trim`); other changes raise."""
    bare_messages = _sentinel_conversation(roles)
    bare = render(bare_messages, True)
    padded = render(_sentinel_conversation(roles, pad=role), True)
    verbatim = bare
    for i, message in enumerate(bare_messages):
        if message["role"] == role.value:
            verbatim = verbatim.replace(_sentinel(i), _padded(i))
    if padded == bare:
        return True
    if padded != verbatim:
        raise FramingError(f"the template changes {role.value} contents other than by stripping them")
    return False


def _stripped_roles(render: Render, with_system: bool) -> frozenset[Role]:
    roles = _text_roles(with_system)
    stripped = {role for role in dict.fromkeys(roles) if _is_stripped(render, roles, role)}
    if Role.USER in stripped:
        stripped.add(Role.ENVIRONMENT)
    return frozenset(stripped)


def read_tool_parts(render: Render, parts: TemplateParts) -> ToolParts:
    """Reads the markup of tool results from `user, assistant, tool, tool, assistant, tool`;
    raises `FramingError` when the template cannot render them or renders them unevenly."""
    roles = [Role.USER, Role.ASSISTANT, Role.TOOL, Role.TOOL, Role.ASSISTANT, Role.TOOL]
    messages = _sentinel_conversation(roles)
    try:
        gen = _split_at_sentinels(render(messages, True), len(roles))
        plain = _split_at_sentinels(render(messages, False), len(roles))
        stripped = _is_stripped(render, roles, Role.TOOL)
    except jinja2.TemplateError as e:
        raise FramingError(f"the chat template cannot render tool messages ({e})") from None
    a2t_1, t2t, t2a, a2t_2, tail_gen = gen[2:]
    opening = parts.end_of_turn + parts.after_end_of_turn
    tool_suffix = plain[-1]
    if a2t_1 != a2t_2 or not a2t_1.startswith(opening):
        raise FramingError(f"the template renders tool results after assistant turns unevenly ({a2t_1!r} vs {a2t_2!r})")
    if gen[:-1] != plain[:-1] or tail_gen != tool_suffix + parts.generation_header:
        raise FramingError("after tool results the generation prompt is not the usual assistant header")
    if t2a != tool_suffix + parts.assistant_header:
        raise FramingError(f"an assistant turn after tool results is rendered after {t2a!r}, "
                           f"not {tool_suffix + parts.assistant_header!r}")
    return ToolParts(a2t_1[len(opening) :], t2t, tool_suffix, stripped)


def conversation_error(messages: Sequence[Mapping[str, Any]]) -> str | None:
    """Why `messages` is not `[system], user-like, (assistant, user-like | tool+)*, [assistant]`
    (None if it is)."""
    if not messages:
        return "empty conversation"
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or not isinstance(message.get("content"), str):
            return f"message {i} must be a mapping with a str 'content'"
        if message.get("role") not in {r.value for r in MESSAGE_ROLES}:
            valid = ", ".join(r.value for r in MESSAGE_ROLES)
            return f"message {i} has role {message.get('role')!r}; valid: {valid}"
    offset = 1 if messages[0]["role"] == Role.SYSTEM else 0
    if len(messages) == offset:
        return "a conversation needs a user or environment message"
    previous = Role.SYSTEM
    for i, message in enumerate(messages[offset:], start=offset):
        role = Role(message["role"])
        if previous is Role.SYSTEM:
            expected = _USER_LIKE
        elif previous is Role.ASSISTANT:
            expected = _ANSWERS
        elif previous is Role.TOOL:
            expected = (Role.TOOL, Role.ASSISTANT)
        else:
            expected = (Role.ASSISTANT,)
        if role not in expected:
            names = " or ".join(r.value for r in expected)
            return f"message {i} has role {role.value!r}, expected {names} (turns must alternate)"
        previous = role
    return None


def _runs(messages: Sequence[Mapping[str, str]]) -> list[list[Mapping[str, str]]]:
    """A conversation (no system) cut into assistant messages and the runs between them."""
    runs: list[list[Mapping[str, str]]] = []
    for message in messages:
        if runs and message["role"] == Role.TOOL and runs[-1][-1]["role"] == Role.TOOL:
            runs[-1].append(message)
        else:
            runs.append([message])
    return runs


class ChatFraming:
    """Exact token framing of conversations for one tokenizer and chat template.

    Attributes (ids as tuples):
      generation_header_ids: the assistant header after which the policy samples.
      end_of_turn_ids: the token the policy samples to end its turn (the sampler's stop token).
      after_end_of_turn_ids: template tokens after it (ChatML `\\n`), the start of every continuation.
      deviations: where the template's own rendering of finished conversations differs from the
        framed ids (empty for a prefix-stable template).
      tool_error: why tool messages cannot be framed (None when they can).
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        chat_template: str | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ):
        """`chat_template` overrides the tokenizer's; `template_kwargs` are passed to the template
        (e.g. Llama-3.2's `date_string`, which otherwise follows today's date, or Qwen3's
        `enable_thinking`)."""
        self.tokenizer = tokenizer
        self.chat_template = chat_template if chat_template is not None else tokenizer.chat_template
        if not self.chat_template:
            raise FramingError(
                f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat template; "
                "pass chat_template=... (to ChatFraming or load_tokenizer)"
            )
        if not getattr(tokenizer, "is_fast", False):
            raise FramingError("chat framing needs a fast (tokenizers-backed) tokenizer for token offsets")
        self.template_kwargs = dict(template_kwargs or {})
        added = tokenizer.added_tokens_decoder.values()
        control = sorted((t.content for t in added), key=len, reverse=True)
        self._control_re = _alternation(control)
        self._lookalike_re = _alternation([t for t in control if not t.isspace()])  # "\n" tokens are text
        self._special_re = _alternation(sorted((t.content for t in added if t.special and not t.content.isspace()),
                                               key=len, reverse=True))

        self.parts = read_template_parts(self._render, control)
        self.generation_header_ids = self._tokenize([_markup(self.parts.generation_header)]).ids
        self.end_of_turn_ids = (tokenizer.convert_tokens_to_ids(self.parts.end_of_turn),)
        self.after_end_of_turn_ids = self._tokenize([_markup(self.parts.after_end_of_turn)]).ids
        try:
            self.tool_parts: ToolParts | None = read_tool_parts(self._render, self.parts)
            self.tool_error: str | None = None
        except FramingError as e:
            self.tool_parts, self.tool_error = None, f"this chat template cannot frame tool messages: {e}"
        self._parts_with_tools: dict[str, TemplateParts] = {}
        self.deviations = self._verify()

    # ---- the per-turn API used by the rollout ----

    def prompt_ids(self, messages: Sequence[Mapping[str, str]], tools: Sequence[Mapping[str, Any]] | None = None) -> Framed:
        """The first prompt: `[system], user, (assistant, answers)*` plus the generation header;
        `tools` (OpenAI function schemas) are written where the template writes them."""
        return self.encode(messages, add_generation_prompt=True, tools=tools)

    def continuation_ids(self, content: str, role: str = "environment") -> Framed:
        """Ids to append after the policy's end-of-turn token: template after it, `content` as a
        user, environment or tool message, and the generation header. Never re-renders the
        conversation."""
        return self.continuation_of([{"role": role, "content": content}])

    def continuation_of(self, messages: Sequence[Mapping[str, str]]) -> Framed:
        """`continuation_ids` of the messages that answer an assistant turn: one user or
        environment message, or one or more tool messages (one per call of the turn)."""
        error = conversation_error([{"role": "user", "content": ""}, {"role": "assistant", "content": ""}, *messages])
        if error or not messages:
            raise FramingError(f"a continuation is one user or environment message or a run of tool messages; "
                               f"{error or 'got none'}")
        if len(_runs(messages)) != 1 or messages[0]["role"] == Role.ASSISTANT:
            raise FramingError("a continuation is one user or environment message or a run of tool messages")
        opening = self.parts.after_end_of_turn + self._header_of(Role(messages[0]["role"]))
        return self._tokenize([_markup(opening), *self._run(messages, self.parts.generation_header)])

    def assistant_ids(self, content: str) -> Framed:
        """An assistant turn as the policy samples it: content tokenized alone, then end-of-turn."""
        return self._tokenize(
            [self._content(content, Role.ASSISTANT), _Text(self.parts.end_of_turn, Role.ASSISTANT, True)]
        )

    def encode(
        self,
        messages: Sequence[Mapping[str, str]],
        add_generation_prompt: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> Framed:
        """A whole conversation, built from the same pieces as prompt + assistant + continuations."""
        return self._encode(messages, add_generation_prompt, tools, history_headers=False)

    def render_assistant(self, message: Mapping[str, Any]) -> str:
        """The text the template writes for one assistant message between its header and its
        end-of-turn token: its `content` and, where the template writes them, its OpenAI
        `tool_calls` (a template that ignores them writes the content alone)."""
        messages = [{"role": "user", "content": _sentinel(0)}, dict(message), {"role": "user", "content": _sentinel(2)}]
        messages[1]["content"] = message.get("content") or ""
        try:
            text = self._render(messages, False)
        except jinja2.TemplateError as e:
            raise FramingError(f"the chat template cannot render this assistant message: {e}") from None
        start = text.index(_sentinel(0)) + len(_sentinel(0)) + len(self.parts.user_suffix + self.parts.assistant_header)
        end = text.rindex(self.parts.end_of_turn + self.parts.after_end_of_turn + self.parts.user_header + _sentinel(2))
        return text[start:end]

    # ---- rendering and tokenization ----

    def _render(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool, tools: Sequence[Mapping[str, Any]] | None = None
    ) -> str:
        return self.tokenizer.apply_chat_template(
            messages,
            tools=list(tools) if tools else None,
            chat_template=self.chat_template,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **self.template_kwargs,
        )

    def _template_parts(self, tools: Sequence[Mapping[str, Any]] | None) -> TemplateParts:
        """The parts for prompts with `tools`: only the heads may differ from the plain ones."""
        if not tools:
            return self.parts
        key = json.dumps(list(tools), sort_keys=True)
        if key not in self._parts_with_tools:
            control = [t.content for t in self.tokenizer.added_tokens_decoder.values()]
            try:
                parts = read_template_parts(lambda m, gen: self._render(m, gen, tools), control)
            except jinja2.TemplateError as e:
                raise FramingError(f"the chat template fails with these tools: {e}") from None
            heads = ("head_with_system", "system_to_user", "head_without_system")
            same = dataclasses.replace(parts, **{k: getattr(self.parts, k) for k in heads})
            if same != self.parts:
                raise FramingError("the chat template renders turns differently when given tools")
            self._parts_with_tools[key] = parts
            try:
                for system in ("You are an agent.", None):
                    if (parts.head_with_system if system else parts.head_without_system) is not None:
                        messages = ([{"role": "system", "content": system}] if system else []) + [_PROBE_TURNS[0]]
                        self._check_same(list(self.encode(messages, True, tools).ids), messages, True,
                                         "a prompt with tools", tools)
            except FramingError:
                del self._parts_with_tools[key]
                raise
        return self._parts_with_tools[key]

    def _header_of(self, role: Role) -> str:
        if role is Role.TOOL:
            if self.tool_parts is None:
                raise FramingError(self.tool_error)
            return self.tool_parts.tool_header
        return self.parts.user_header

    def _run(self, run: Sequence[Mapping[str, str]], header: str) -> list[_Text]:
        """The contents of a run of user-like or tool messages and the markup after each, ending
        with `header` (the next assistant turn's, or "" at the end of a conversation)."""
        role = Role(run[0]["role"])
        if role is Role.TOOL and self.tool_parts is None:
            raise FramingError(self.tool_error)
        pieces = []
        for k, message in enumerate(run):
            pieces.append(self._content(message["content"], role))
            if k + 1 < len(run):
                pieces.append(_markup(self.tool_parts.tool_separator))
        suffix = self.tool_parts.tool_suffix if role is Role.TOOL else self.parts.user_suffix
        return pieces + [_markup(suffix + header)]

    def _encode(
        self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool,
        tools: Sequence[Mapping[str, Any]] | None, history_headers: bool,
    ) -> Framed:
        """`history_headers`: earlier assistant turns after the template's history header (its
        own rendering) instead of the generation header (what the sampler saw)."""
        error = conversation_error(messages)
        if error:
            raise FramingError(error)
        if add_generation_prompt and messages[-1]["role"] == Role.ASSISTANT:
            raise FramingError("add_generation_prompt needs a conversation ending with a user, environment or tool turn")
        parts = self._template_parts(tools)
        has_system = messages[0]["role"] == Role.SYSTEM
        head = parts.head_with_system if has_system else parts.head_without_system
        if head is None:
            verb = "refuses" if has_system else "requires"
            raise FramingError(f"this chat template {verb} a system message")
        chunk = [_markup(head)]
        if has_system:
            chunk += [self._content(messages[0]["content"], Role.SYSTEM), _markup(parts.system_to_user)]
            messages = messages[1:]
        runs = _runs(messages)
        framed = Framed()
        for i, run in enumerate(runs):
            if run[0]["role"] == Role.ASSISTANT:
                framed += self._tokenize(chunk) + self.assistant_ids(run[0]["content"])
                after = self._header_of(Role(runs[i + 1][0]["role"])) if i + 1 < len(runs) else ""
                chunk = [_markup(self.parts.after_end_of_turn + after)]
            elif i + 1 < len(runs):
                chunk += self._run(run, self.parts.assistant_header if history_headers else self.parts.generation_header)
            else:
                chunk += self._run(run, self.parts.generation_header if add_generation_prompt else "")
        return framed + self._tokenize(chunk)

    def _content(self, text: str, role: Role) -> _Text:
        stripped = role in self.parts.stripped_roles or (role is Role.TOOL and self.tool_parts.stripped)
        return _Text(text.strip() if stripped else text, role, False)

    def _tokenize(self, pieces: Sequence[_Text]) -> Framed:
        """Tokenizes text as `apply_chat_template` does, with each token's role.

        Markup is split at control tokens; the text between control tokens is tokenized as one run
        (so BPE merges across markup/content boundaries as in the full rendering). Control-token
        text inside contents is tokenized as plain text on its own (in assistant contents only
        special tokens' text; other added tokens stay the ids the policy samples).
        """
        framed, run, spans = Framed(), "", []  # spans: (start, end, role) of contents in `run`

        def flush() -> Framed:
            nonlocal run, spans
            out = self._tokenize_run(run, spans) if run else Framed()
            run, spans = "", []
            return out

        for piece in pieces:
            if piece.markup:
                splitter = self._control_re
            else:
                splitter = self._special_re if piece.role is Role.ASSISTANT else self._lookalike_re
            parts = splitter.split(piece.text) if splitter else [piece.text]
            for j, part in enumerate(parts):
                if not part:
                    continue
                if j % 2 == 0:  # text between control tokens
                    if not piece.markup:
                        spans.append((len(run), len(run) + len(part), piece.role))
                    run += part
                elif piece.markup:  # a control token the template wrote
                    framed += flush() + Framed((self.tokenizer.convert_tokens_to_ids(part),), (piece.role,))
                else:  # control-token text inside a message: plain text, on its own
                    ids = self._plain_ids(part)
                    framed += flush() + Framed(tuple(ids), (piece.role,) * len(ids))
        return framed + flush()

    def _tokenize_run(self, text: str, spans: list[tuple[int, int, Role]]) -> Framed:
        encoding = self.tokenizer(
            text, add_special_tokens=False, split_special_tokens=True, return_offsets_mapping=True
        )
        roles = []
        for start, end in encoding["offset_mapping"]:
            end = max(end, start + 1)
            overlapping = [role for s, e, role in spans if s < end and start < e]
            roles.append(overlapping[0] if overlapping else Role.TEMPLATE)
        return Framed(tuple(encoding["input_ids"]), tuple(roles))

    def _plain_ids(self, text: str) -> list[int]:
        """`text` through normalizer, pre-tokenizer and model, matching no added tokens."""
        backend = self.tokenizer.backend_tokenizer
        if backend.normalizer is not None:
            text = backend.normalizer.normalize_str(text)
        splits = backend.pre_tokenizer.pre_tokenize_str(text) if backend.pre_tokenizer else [(text, None)]
        return [token.id for split, _ in splits for token in backend.model.tokenize(split)]

    # ---- construction-time checks ----

    def _verify(self) -> tuple[Deviation, ...]:
        """Checks the framing against `apply_chat_template` on probe conversations: the prompts
        and every turn's markup must be exact (else `FramingError`); where the template renders
        a finished conversation otherwise than the sampler saw it, returns the deviations."""
        deviations = []
        p = self.parts
        if p.generation_header != p.assistant_header:
            deviations.append(Deviation("generation_header", (
                f"the generation prompt is {p.generation_header!r}, but earlier assistant turns are rendered after "
                f"{p.assistant_header!r}; the framed ids keep the header each turn was sampled after")))
        final_checked = False
        for system in ("You are an agent.", None):
            if (p.head_with_system if system else p.head_without_system) is None:
                continue
            messages = [{"role": "system", "content": system}] if system else []
            messages.append(_PROBE_TURNS[0])
            ids = list(self.prompt_ids(messages).ids)
            self._check_same(ids, messages, True, "the first prompt")
            if tuple(ids[-len(self.generation_header_ids) :]) != self.generation_header_ids:
                raise FramingError("the prompt does not end with the generation header's ids")
            for j in range(1, len(_PROBE_TURNS), 2):
                ids += self.assistant_ids(_PROBE_TURNS[j]["content"]).ids + self.continuation_ids(_PROBE_TURNS[j + 1]["content"]).ids
                messages += _PROBE_TURNS[j : j + 2]
            if ids != list(self.encode(messages, True).ids):
                raise AssertionError("prompt + assistant + continuation ids differ from encode()")
            self._check_same(list(self._encode(messages, True, None, history_headers=True).ids), messages, True,
                             "prompt + assistant + continuation ids")
            messages = messages + [{"role": "assistant", "content": "Action: unlock door"}]
            difference = self._difference(list(self._encode(messages, False, None, history_headers=True).ids), messages, False)
            if difference and not final_checked:
                deviations.append(Deviation("final_turn", f"a conversation's last assistant turn is rendered otherwise: {difference}"))
            final_checked = True
        if self.tool_parts is not None:
            probe = [_PROBE_TURNS[0], *_PROBE_TOOL_TURNS]
            try:
                self._check_same(list(self._encode(probe, True, None, history_headers=True).ids), probe, True,
                                 "tool results")
            except FramingError as e:
                self.tool_parts, self.tool_error = None, f"this chat template cannot frame tool messages: {e}"
        for content in _PROBE_REASONING:
            for answer in (Role.USER, Role.TOOL) if self.tool_parts else (Role.USER,):
                messages = [_PROBE_TURNS[0], {"role": "assistant", "content": content},
                            {"role": answer.value, "content": "Done."}]
                difference = self._difference(list(self._encode(messages, True, None, history_headers=True).ids),
                                              messages, True)
                if difference:
                    deviations.append(Deviation("history", (
                        f"an earlier assistant turn {content!r} followed by a {answer.value} message is rendered "
                        f"otherwise: {difference}")))
        return tuple(deviations)

    def _reference(self, messages: list[dict[str, str]], gen: bool, tools: Sequence[Mapping[str, Any]] | None) -> list[int]:
        return list(self.tokenizer.apply_chat_template(
            messages,
            tools=list(tools) if tools else None,
            chat_template=self.chat_template,
            tokenize=True,
            return_dict=False,
            add_generation_prompt=gen,
            **self.template_kwargs,
        ))

    def _difference(self, ids: list[int], messages: list[dict[str, str]], gen: bool,
                    tools: Sequence[Mapping[str, Any]] | None = None) -> str | None:
        """Where `ids` first differ from the template's own ids of `messages` (None if equal)."""
        reference = self._reference(messages, gen, tools)
        if ids == reference:
            return None
        at = next((i for i, (a, b) in enumerate(zip(ids, reference)) if a != b), min(len(ids), len(reference)))
        decode = self.tokenizer.convert_ids_to_tokens
        return f"at token {at}: {decode(ids[at : at + 5])} vs {decode(reference[at : at + 5])}"

    def _check_same(self, ids: list[int], messages: list[dict[str, str]], gen: bool, what: str,
                    tools: Sequence[Mapping[str, Any]] | None = None) -> None:
        difference = self._difference(ids, messages, gen, tools)
        if difference:
            raise FramingError(f"{what} differ from apply_chat_template {difference}; "
                               "this template/tokenizer cannot be framed exactly")


# Probe conversations of the construction-time checks.
_PROBE_TURNS = (
    {"role": "user", "content": "Look around."},
    {"role": "assistant", "content": "Thought: I look.\nAction: look"},
    {"role": "user", "content": "You see a door, a key and 3 boxes."},
    {"role": "assistant", "content": "Action: open door"},
    {"role": "user", "content": "The door is locked."},
)
_PROBE_TOOL_TURNS = (
    {"role": "assistant", "content": '<tool_call>\n{"name": "get_key", "arguments": {"door": "red"}}\n</tool_call>'},
    {"role": "tool", "content": '{"key": "red key", "uses": 1}'},
    {"role": "tool", "content": "Error: no such door."},
    {"role": "assistant", "content": 'get_key(door="blue")'},
    {"role": "tool", "content": "[1, 2]"},
)
_PROBE_REASONING = ("<think>\nThe door is locked.\n</think>\n\nAction: open door", "<think>\n\n</think>\n\nAction: open door")
