"""Chat framing at the token level: exact ids for a conversation, and the role of every token.

DESIGN rule 3 (token in, token out): a trajectory is the prompt ids, then for every turn the ids
the policy sampled and the ids appended for the environment's answer. The rollout never renders
the conversation again; it asks this module once per turn for the ids to append:

    framing = ChatFraming(tokenizer)
    prompt = framing.prompt_ids(messages)          # system? + user ... + generation header
    ...policy samples `sampled` (ending with one of framing.end_of_turn_ids)...
    nxt = framing.continuation_ids(observation)    # after-end-of-turn + user turn + header
    sequence = prompt.ids + sampled + nxt.ids + ...

The template text around message contents is read off the chat template itself (conversations
with sentinel contents, rendered and split), so Llama-3's system block with its dates, Qwen2.5's
default system prompt or any other markup comes from the template, not from code here. At
construction the framing is checked on a probe conversation against
`tokenizer.apply_chat_template(..., tokenize=True)`; a template that cannot be framed exactly
is refused with the reason.

Conventions:
- `environment` messages are rendered as the template's `user` role (AgentGym sends
  observations as user turns); their tokens carry `Role.ENVIRONMENT`.
- An assistant turn is its content tokenized on its own followed by the end-of-turn token: what
  the policy samples after the generation header. This equals `apply_chat_template` except when
  the content starts with whitespace that BPE would merge with the header's last characters
  (ChatML `assistant\\n` + `\\nfoo`); then the ids here are the ones the sampler would have seen.
- Control-token text inside a message (an observation containing `<|im_end|>`) is encoded as
  plain text, on its own, as `apply_chat_template(..., sanitize_control_tokens=True)` does, so
  that no message can end a turn or forge a header.
- Conversations are `[system], user|environment, assistant, user|environment, ...`, strictly
  alternating. Without a system message the template's own default (if any) is used and its
  tokens are `Role.TEMPLATE`.
"""

from __future__ import annotations

import dataclasses
import enum
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
    TEMPLATE = "template"  # markup: headers, end-of-turn after non-assistant turns, BOS, defaults


MESSAGE_ROLES = (Role.SYSTEM, Role.USER, Role.ASSISTANT, Role.ENVIRONMENT)
_USER_LIKE = (Role.USER, Role.ENVIRONMENT)


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
    `head [system content system_to_user] user content (user_suffix generation_header
    assistant content end_of_turn after_end_of_turn user_header user content)* user_suffix`.
    """

    head_with_system: str | None  # before the system content; None: template refuses system
    system_to_user: str | None  # after the system content, up to the first user content
    head_without_system: str | None  # before the first user content (may hold a default system)
    user_suffix: str  # after a user content
    generation_header: str  # what `add_generation_prompt` appends: the assistant header
    end_of_turn: str  # the control token that ends an assistant turn (the policy samples it)
    after_end_of_turn: str  # template text after it (ChatML: "\n")
    user_header: str  # before a later user content
    stripped_roles: frozenset[Role]  # roles whose content the template strips of whitespace


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


def _sentinel_conversation(with_system: bool, pad: Role | None = None) -> list[dict[str, str]]:
    """`[system], user, assistant, user, assistant, user` with sentinel contents (padded for `pad`)."""
    roles = ([Role.SYSTEM] if with_system else []) + [Role.USER, Role.ASSISTANT] * 2 + [Role.USER]
    return [
        {"role": r.value, "content": f" \n{_sentinel(i)}\n " if r is pad else _sentinel(i)}
        for i, r in enumerate(roles)
    ]


Render = Callable[[list[dict[str, str]], bool], str]


def read_template_parts(render: Render, control_tokens: Sequence[str]) -> TemplateParts:
    """Reads the markup around contents from renderings of sentinel conversations.

    `render(messages, add_generation_prompt) -> text`. Checks that the markup is the same at every
    turn, that an assistant turn starts with exactly the generation header and ends with a
    control token; raises `FramingError` naming what differs otherwise.
    """

    def variant(with_system: bool) -> dict[str, str] | None:
        messages = _sentinel_conversation(with_system)
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
        if not u2a_1 == u2a_2 == tail_gen:
            raise FramingError(
                f"an assistant turn is rendered after {u2a_1!r}, but the generation prompt after a user "
                f"turn is {tail_gen!r}; the policy would sample after different ids than it trains on"
            )
        if a2u_1 != a2u_2 or not a2u_1.startswith(assistant_end):
            raise FramingError(f"the template renders later turns differently ({a2u_1!r} vs {a2u_2!r})")
        return {
            "head": head[0],
            "system_to_user": head[1] if with_system else None,
            "user_suffix": user_suffix,
            "generation_header": tail_gen[len(user_suffix) :],
            "assistant_end": assistant_end,
            "user_header": a2u_1[len(assistant_end) :],
        }

    with_system, without_system = variant(True), variant(False)
    if with_system is None and without_system is None:
        raise FramingError("the chat template fails on a plain [system,] user/assistant conversation")
    common = ("user_suffix", "generation_header", "assistant_end", "user_header")
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
    )


def _stripped_roles(render: Render, with_system: bool) -> frozenset[Role]:
    """Roles whose content the template strips (Llama-3's `| trim`); other transforms are refused."""
    bare_messages = _sentinel_conversation(with_system)
    bare = render(bare_messages, True)
    stripped = set()
    for role in (Role.SYSTEM, Role.USER, Role.ASSISTANT) if with_system else (Role.USER, Role.ASSISTANT):
        padded = render(_sentinel_conversation(with_system, pad=role), True)
        verbatim = bare
        for i, message in enumerate(bare_messages):
            if message["role"] == role.value:
                verbatim = verbatim.replace(_sentinel(i), f" \n{_sentinel(i)}\n ")
        if padded == bare:
            stripped.add(role)
        elif padded != verbatim:
            raise FramingError(f"the template changes {role.value} contents other than by stripping them")
    if Role.USER in stripped:
        stripped.add(Role.ENVIRONMENT)
    return frozenset(stripped)


def _alternation_error(messages: Sequence[Mapping[str, Any]]) -> str | None:
    """Why `messages` is not `[system], user-like, assistant, user-like, ...` (None if it is)."""
    if not messages:
        return "empty conversation"
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or not isinstance(message.get("content"), str):
            return f"message {i} must be a mapping with a str 'content'"
        if message.get("role") not in {r.value for r in MESSAGE_ROLES}:
            valid = ", ".join(r.value for r in MESSAGE_ROLES)
            return f"message {i} has role {message.get('role')!r}; valid: {valid}"
    offset = 1 if messages[0]["role"] == Role.SYSTEM else 0
    for i, message in enumerate(messages[offset:], start=offset):
        want_user = (i - offset) % 2 == 0
        if (message["role"] in ("user", "environment")) != want_user:
            expected = "user or environment" if want_user else "assistant"
            return f"message {i} has role {message['role']!r}, expected {expected} (turns must alternate)"
    if len(messages) == offset:
        return "a conversation needs a user or environment message"
    return None


class ChatFraming:
    """Exact token framing of conversations for one tokenizer and chat template.

    Attributes (ids as tuples):
      generation_header_ids: the assistant header after which the policy samples.
      end_of_turn_ids: the token the policy samples to end its turn (the sampler's stop token).
      after_end_of_turn_ids: template tokens after it (ChatML `\\n`), the start of every continuation.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        chat_template: str | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ):
        """`chat_template` overrides the tokenizer's; `template_kwargs` are passed to the template
        (e.g. Llama-3.2's `date_string`, which otherwise follows today's date)."""
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
        added = sorted(tokenizer.get_added_vocab(), key=len, reverse=True)
        self._control_re = _alternation(added)
        self._lookalike_re = _alternation([t for t in added if not t.isspace()])  # "\n" tokens are text

        self.parts = read_template_parts(self._render, added)
        self.generation_header_ids = self._tokenize([_markup(self.parts.generation_header)]).ids
        self.end_of_turn_ids = (tokenizer.convert_tokens_to_ids(self.parts.end_of_turn),)
        self.after_end_of_turn_ids = self._tokenize([_markup(self.parts.after_end_of_turn)]).ids
        self._verify()

    # ---- the per-turn API used by the rollout ----

    def prompt_ids(self, messages: Sequence[Mapping[str, str]]) -> Framed:
        """The first prompt: `[system], user, (assistant, user)*` plus the generation header."""
        return self.encode(messages, add_generation_prompt=True)

    def continuation_ids(self, content: str, role: str = "environment") -> Framed:
        """Ids to append after the policy's end-of-turn token: template after it, `content` as a
        user turn, and the generation header. Never re-renders the conversation."""
        role = Role(role)
        if role not in _USER_LIKE:
            raise FramingError(f"a continuation is a user or environment message, got {role.value!r}")
        return self._tokenize(
            [
                _markup(self.parts.after_end_of_turn + self.parts.user_header),
                *self._user_turn(content, role, last=True, add_generation_prompt=True),
            ]
        )

    def assistant_ids(self, content: str) -> Framed:
        """An assistant turn as the policy samples it: content tokenized alone, then end-of-turn."""
        return self._tokenize(
            [self._content(content, Role.ASSISTANT), _Text(self.parts.end_of_turn, Role.ASSISTANT, True)]
        )

    def encode(self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = False) -> Framed:
        """A whole conversation, built from the same pieces as prompt + assistant + continuations."""
        error = _alternation_error(messages)
        if error:
            raise FramingError(error)
        last = Role(messages[-1]["role"])
        if add_generation_prompt and last is Role.ASSISTANT:
            raise FramingError("add_generation_prompt needs a conversation ending with a user turn")
        has_system = messages[0]["role"] == Role.SYSTEM
        head = self.parts.head_with_system if has_system else self.parts.head_without_system
        if head is None:
            verb = "refuses" if has_system else "requires"
            raise FramingError(f"this chat template {verb} a system message")
        chunk = [_markup(head)]
        if has_system:
            chunk += [self._content(messages[0]["content"], Role.SYSTEM), _markup(self.parts.system_to_user)]
            messages = messages[1:]
        framed = Framed()
        for i, message in enumerate(messages):
            role, is_last = Role(message["role"]), i == len(messages) - 1
            if role is Role.ASSISTANT:
                framed += self._tokenize(chunk) + self.assistant_ids(message["content"])
                header = "" if is_last else self.parts.user_header
                chunk = [_markup(self.parts.after_end_of_turn + header)]
            else:
                chunk += self._user_turn(message["content"], role, is_last, add_generation_prompt)
        return framed + self._tokenize(chunk)

    # ---- rendering and tokenization ----

    def _render(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages,
            chat_template=self.chat_template,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **self.template_kwargs,
        )

    def _content(self, text: str, role: Role) -> _Text:
        return _Text(text.strip() if role in self.parts.stripped_roles else text, role, False)

    def _user_turn(self, content: str, role: Role, last: bool, add_generation_prompt: bool) -> list[_Text]:
        """A user-like content and the markup after it (up to the next assistant content)."""
        header = self.parts.generation_header if (add_generation_prompt or not last) else ""
        return [self._content(content, role), _markup(self.parts.user_suffix + header)]

    def _tokenize(self, pieces: Sequence[_Text]) -> Framed:
        """Tokenizes text as `apply_chat_template` does, with each token's role.

        Markup is split at control tokens; the text between control tokens is tokenized as one run
        (so BPE merges across markup/content boundaries as in the full rendering). Control-token
        text inside contents is tokenized as plain text on its own.
        """
        framed, run, spans = Framed(), "", []  # spans: (start, end, role) of contents in `run`

        def flush() -> Framed:
            nonlocal run, spans
            out = self._tokenize_run(run, spans) if run else Framed()
            run, spans = "", []
            return out

        for piece in pieces:
            splitter = self._control_re if piece.markup else self._lookalike_re
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

    # ---- construction-time check ----

    def _verify(self) -> None:
        """Prompt + assistant turns + continuations must equal `apply_chat_template` exactly."""
        turns = ["Look around.", "Thought: I look.\nAction: look", "You see a door, a key and 3 boxes.",
                 "Action: open door", "The door is locked."]  # fmt: skip
        for system in ("You are an agent.", None):
            if (self.parts.head_with_system if system else self.parts.head_without_system) is None:
                continue
            messages = [{"role": "system", "content": system}] if system else []
            messages.append({"role": "user", "content": turns[0]})
            ids = list(self.prompt_ids(messages).ids)
            if tuple(ids[-len(self.generation_header_ids) :]) != self.generation_header_ids:
                raise FramingError("the prompt does not end with the generation header's ids")
            for j in range(1, len(turns), 2):
                ids += self.assistant_ids(turns[j]).ids + self.continuation_ids(turns[j + 1]).ids
                messages.append({"role": "assistant", "content": turns[j]})
                messages.append({"role": "user", "content": turns[j + 1]})
            self._check_same(ids, messages, True, "prompt + assistant + continuation ids")
            messages.append({"role": "assistant", "content": "Action: unlock door"})
            self._check_same(list(self.encode(messages).ids), messages, False, "encode()")

    def _check_same(self, ids: list[int], messages: list[dict[str, str]], gen: bool, what: str) -> None:
        reference = self.tokenizer.apply_chat_template(
            messages,
            chat_template=self.chat_template,
            tokenize=True,
            return_dict=False,
            add_generation_prompt=gen,
            **self.template_kwargs,
        )
        if ids != list(reference):
            pairs = enumerate(zip(ids, reference))
            at = next((i for i, (a, b) in pairs if a != b), min(len(ids), len(reference)))
            decode = self.tokenizer.convert_ids_to_tokens
            raise FramingError(
                f"{what} differ from apply_chat_template at token {at}: "
                f"{decode(ids[at : at + 5])} vs {decode(list(reference[at : at + 5]))}; "
                "this template/tokenizer cannot be framed exactly"
            )
