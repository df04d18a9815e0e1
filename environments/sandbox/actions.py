"""Reading code out of a model's reply, for every environment whose action is code.

A command or a program spans lines and often comes in a Markdown fence, so the action is all
the text after the last `Action:` marker (the whole reply when there is none), with one
surrounding fence (```` ```bash ... ``` ````) taken off.
"""

from __future__ import annotations

import re

_MARKER = re.compile(r"Action:[ \t]*", re.IGNORECASE)
_FENCED = re.compile(r"^```[\w+-]*[ \t]*\n(.*?)\n?```$", re.DOTALL)
_INLINE = re.compile(r"^`([^`\n]+)`$")


def strip_fence(text: str) -> str:
    """`text` without one surrounding ``` fence (or inline backticks), stripped."""
    text = text.strip()
    match = _FENCED.match(text) or _INLINE.match(text)
    return (match.group(1) if match else text).strip("\n").rstrip()


def code_action(text: str) -> str | None:
    """The code after the last `Action:`, fence removed; None when nothing is left."""
    action = strip_fence(_MARKER.split(text)[-1])
    return action if action.strip() else None
