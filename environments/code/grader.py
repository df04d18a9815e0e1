"""The grader: a program run on the host in a process of its own, never in the candidate's (`grading.py`).

It runs a problem's tests, HumanEval's own trusted code, in a namespace holding the prompt's
definitions, with `candidate` (and the entry point's name) bound to a proxy: each call sends
its arguments to the candidate's process in the sandbox as plain data (fd `argv[1]`) and takes
back one reply (fd `argv[2]`), from which only a plain value is rebuilt (`plain.py`). Every
comparison, and so every verdict, happens here. A call that raises in the candidate, returns
something that is not plain data, or gets no answer (a crash, an exit, the time limit) fails its
test; a broken channel fails every later call at once. The failure is a `CandidateFailed`, not an
`Exception`, so a test's own `except Exception` cannot swallow it; a hidden-test verdict also
counts every failed call, whatever the test did with it.

Input: a JSON spec on stdin, `{"mode": "public" | "hidden", "prompt", "entry_point", "wall_s",
"tests": [[source, shown], ...] | "test": str}`. Output: one JSON line, `{"lines": [...],
"passed": n, "total": m}` (public) or `{"passed": bool, "reason": str}` (hidden).
"""

import ast
import json
import os
import resource
import select
import sys
import time

from plain import NotPlain, decode, encode

MAX_REPLY_BYTES = 1 << 20
SHOWN_CHARS = 200  # a failed public test shows the value it got, cut to this
OWN_LIMITS = {resource.RLIMIT_CPU: 60, resource.RLIMIT_AS: 2 << 30}  # the tests are trusted, but not cheap


class CandidateFailed(BaseException):
    """A call of the candidate gave no plain value; the message says what happened instead."""


class Candidate:
    """The proxy a test calls as `candidate`: one request and one reply line per call."""

    def __init__(self, calls_fd: int, replies_fd: int, deadline: float):
        self.calls_fd, self.replies_fd, self.deadline = calls_fd, replies_fd, deadline
        os.set_blocking(calls_fd, False)  # a write never waits past the deadline
        self.pending = bytearray()
        self.broken = ""  # why the channel is no longer usable
        self.failures = 0

    def __call__(self, *args, **kwargs):
        try:
            if self.broken:
                raise CandidateFailed(self.broken)
            request = json.dumps({"args": encode(list(args)), "kwargs": encode(kwargs)}).encode() + b"\n"
            reply = self._exchange(request)
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
        if not ready or not (ready[1] if writing else ready[0]):
            raise self._broken("gave no answer within the time limit")

    def _exchange(self, request: bytes) -> dict:
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
            raise self._broken("answered with something that is not a reply") from None
        if type(reply) is not dict:
            raise self._broken("answered with something that is not a reply")
        return reply


def _evaluate(node: ast.expr, scope: dict):
    return eval(compile(ast.fix_missing_locations(ast.Expression(node)), "public_tests.py", "eval"), scope)


def public(spec: dict, scope: dict) -> dict:
    """Each public test (an `assert`): passed, FAILED with the value its left side got, or ERROR."""
    lines, passed = [], 0
    for source, shown in spec["tests"]:
        test = ast.parse(source).body[0].test
        got = None
        try:
            if isinstance(test, ast.Compare):  # the left side once, then the comparison with its value
                got = _evaluate(test.left, scope)
                ok = _evaluate(ast.Compare(ast.Name("__got__", ast.Load()), test.ops, test.comparators),
                               {**scope, "__got__": got})
            else:
                ok = _evaluate(test, scope)
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
            lines.append(f"FAILED: {shown}" + (f" (got {repr(got)[:SHOWN_CHARS]})" if isinstance(test, ast.Compare) else ""))
    return {"lines": lines, "passed": passed, "total": len(spec["tests"])}


def hidden(spec: dict, scope: dict, candidate: Candidate) -> dict:
    """HumanEval's whole `check(candidate)`: passed only if it returns and no call of the candidate failed."""
    exec(compile(spec["test"], "hidden_tests.py", "exec"), scope)
    try:
        scope["check"](candidate)
    except CandidateFailed as e:
        return {"passed": False, "reason": f"the function {e}"}
    except Exception as e:
        return {"passed": False, "reason": f"a test failed ({type(e).__name__})"}
    if candidate.failures:
        return {"passed": False, "reason": f"{candidate.failures} calls of the function failed"}
    return {"passed": True, "reason": ""}


def main() -> None:
    for limit, value in OWN_LIMITS.items():
        resource.setrlimit(limit, (value, value))
    spec = json.loads(sys.stdin.read())
    candidate = Candidate(int(sys.argv[1]), int(sys.argv[2]), time.monotonic() + spec["wall_s"])
    scope = {"__name__": "__main__"}
    exec(compile(spec["prompt"], "prompt.py", "exec"), scope)
    scope[spec["entry_point"]] = candidate
    scope["candidate"] = candidate
    verdict = public(spec, scope) if spec["mode"] == "public" else hidden(spec, scope, candidate)
    print(json.dumps(verdict), flush=True)


main()
