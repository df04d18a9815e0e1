"""The verdict: a problem's tests run with `candidate` a proxy for the function in the sandbox.

The tests are HumanEval's own trusted code, run here, in the server's process, which the
candidate's code never runs in: in a namespace holding the prompt's definitions, with
`candidate` (and the entry point's name) bound to a `Candidate`. Each call sends its arguments
to the candidate's process as plain data and takes back one reply, from which only a plain value
is rebuilt (`plain.py`): every comparison, and so every verdict, happens here. A call that
raises in the candidate, returns something that is not plain data, or gets no answer (a crash,
an exit, the time limit) fails its test; a broken channel fails every later call at once. The
failure is a `CandidateFailed`, not an `Exception`, so a test's own `except Exception` cannot
swallow it, and a hidden-test verdict also counts every failed call, whatever the test did.
"""

from __future__ import annotations

import ast
import json
import os
import select
import time
from typing import Any

from environments.code.plain import NotPlain, decode, encode

MAX_REPLY_BYTES = 1 << 20
SHOWN_CHARS = 200  # a failed public test shows the value it got, cut to this


class CandidateFailed(BaseException):
    """A call of the candidate gave no plain value; the message says what happened instead."""


class Candidate:
    """The proxy a test calls as `candidate`: one request line out, one reply line in, per call."""

    def __init__(self, calls_fd: int, replies_fd: int, deadline: float):
        self.calls_fd, self.replies_fd, self.deadline = calls_fd, replies_fd, deadline
        os.set_blocking(calls_fd, False)  # a write never waits past the deadline
        self.pending = bytearray()
        self.broken = ""  # why the channel is no longer usable
        self.failures = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            if self.broken:
                raise CandidateFailed(self.broken)
            reply = self._exchange(json.dumps({"args": encode(list(args)), "kwargs": encode(kwargs)}).encode() + b"\n")
            if "value" in reply:
                try:
                    return decode(reply["value"])
                except (NotPlain, TypeError, ValueError, RecursionError) as e:
                    raise CandidateFailed(f"returned malformed data ({e})") from None
            if "raised" in reply:
                raise CandidateFailed(f"raised {reply['raised']}")
            raise CandidateFailed(f"returned a value that is not plain data ({reply.get('not_plain', 'no reason given')})")
        except CandidateFailed:
            self.failures += 1
            raise

    def _broken(self, why: str) -> CandidateFailed:
        self.broken = why
        return CandidateFailed(why)

    def _wait(self, fd: int, writing: bool) -> None:
        left = self.deadline - time.monotonic()
        ready = left > 0 and select.select([] if writing else [fd], [fd] if writing else [], [], left)
        if not ready or not any(ready):
            raise self._broken("gave no answer within the time limit")

    def _exchange(self, request: bytes) -> dict[str, Any]:
        view = memoryview(request)
        try:
            while view:
                self._wait(self.calls_fd, writing=True)
                view = view[os.write(self.calls_fd, view):]
        except BrokenPipeError:
            raise self._broken("gave no answer (its program had ended)") from None
        scanned = 0
        while (newline := self.pending.find(b"\n", scanned)) < 0:
            scanned = len(self.pending)
            self._wait(self.replies_fd, writing=False)
            chunk = os.read(self.replies_fd, 1 << 16)
            if not chunk:
                raise self._broken("gave no answer (its program had ended)")
            self.pending += chunk
            if len(self.pending) > MAX_REPLY_BYTES:
                raise self._broken(f"answered with more than {MAX_REPLY_BYTES} bytes")
        line = bytes(self.pending[:newline])
        del self.pending[:newline + 1]
        try:
            reply = json.loads(line)
        except (ValueError, RecursionError):
            reply = None
        if type(reply) is not dict:
            raise self._broken("answered with something that is not a reply")
        return reply


def scope(prompt: str, entry_point: str, candidate: Candidate) -> dict[str, Any]:
    """The prompt's definitions (imports, helpers), with the entry point and `candidate` the proxy."""
    names: dict[str, Any] = {"__name__": "__main__"}
    exec(compile(prompt, "prompt.py", "exec"), names)
    names[entry_point] = names["candidate"] = candidate
    return names


def _evaluate(node: ast.expr, names: dict[str, Any]) -> Any:
    return eval(compile(ast.fix_missing_locations(ast.Expression(node)), "public_tests.py", "eval"), names)


def public(tests: list[tuple[str, str]], names: dict[str, Any]) -> tuple[list[str], int]:
    """(source, shown) asserts -> a line each (passed, FAILED with the value its left side got, or
    ERROR) and how many passed."""
    lines, passed = [], 0
    for source, shown in tests:
        test = ast.parse(source).body[0].test
        compared = isinstance(test, ast.Compare)
        got = None
        try:
            if compared:  # the left side once, then the comparison with its value
                got = _evaluate(test.left, names)
                ok = _evaluate(ast.Compare(ast.Name("__got__", ast.Load()), test.ops, test.comparators),
                               {**names, "__got__": got})
            else:
                ok = _evaluate(test, names)
        except CandidateFailed as e:
            lines.append(f"ERROR: {shown}: the function {e}")
            continue
        except Exception as e:
            lines.append(f"ERROR: {shown} raised {type(e).__name__}: {str(e)[:SHOWN_CHARS]}")
            continue
        if ok:
            passed += 1
            lines.append(f"passed: {shown}")
        else:
            lines.append(f"FAILED: {shown}" + (f" (got {repr(got)[:SHOWN_CHARS]})" if compared else ""))
    return lines, passed


def hidden(test: str, names: dict[str, Any], candidate: Candidate) -> str:
    """HumanEval's whole `check(candidate)`: "" when it returns and no call of the candidate
    failed, else why it did not pass."""
    exec(compile(test, "hidden_tests.py", "exec"), names)
    try:
        names["check"](candidate)
    except CandidateFailed as e:
        return f"the function {e}"
    except Exception as e:
        return f"a test failed ({type(e).__name__})"
    return f"{candidate.failures} calls of the function failed" if candidate.failures else ""
