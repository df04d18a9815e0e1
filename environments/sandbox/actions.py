"""Reading code out of a model's reply, for every environment whose action is code.

A command or a program spans lines and often comes in a Markdown fence, so the action is all
the text after the last `Action:` marker (the whole reply when there is none), with one
surrounding fence (```` ```bash ... ``` ````) taken off. A marker inside a fenced block (a line
opening with ```` ``` ```` up to the line that closes it, or to the end when none does) is part of
the code, not a marker: `print("Action: done")` in a program does not cut it.
"""

from __future__ import annotations

import re

_MARKER = re.compile(r"Action:[ \t]*", re.IGNORECASE)
_FENCE_LINE = re.compile(r"^[ \t]*```", re.MULTILINE)
_FENCED = re.compile(r"^```[\w+-]*[ \t]*\n(.*?)\n?```$", re.DOTALL)
_INLINE = re.compile(r"^`([^`\n]+)`$")


def strip_fence(text: str) -> str:
    """`text` without one surrounding ``` fence (or inline backticks), stripped."""
    text = text.strip()
    match = _FENCED.match(text) or _INLINE.match(text)
    return (match.group(1) if match else text).strip("\n").rstrip()


def _action_start(text: str) -> int:
    """Where the text after the last `Action:` outside fenced blocks starts (0: no such marker).
    One pass over the markers and the fence lines, in order: linear in the length of the reply."""
    fences = [m.start() for m in _FENCE_LINE.finditer(text)]
    start, passed, inside = 0, 0, False
    for marker in _MARKER.finditer(text):
        while passed < len(fences) and fences[passed] < marker.start():
            inside = not inside
            passed += 1
        if not inside:
            start = marker.end()
    return start


def code_action(text: str) -> str | None:
    """The code after the last `Action:` outside a fenced block, fence removed; None when nothing is left."""
    action = strip_fence(text[_action_start(text):])
    return action if action.strip() else None
