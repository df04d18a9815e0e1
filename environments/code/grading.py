"""Grading a solution where the candidate cannot reach the verdict (architecture rule 8a).

Each `run` or `submit` runs the candidate's program in the sandbox (`harness.py`: the prompt,
then solution.py, then the entry point called on demand) while the tests run here, in the
server's process (`grader.py`), with `candidate` a proxy that calls it over two pipes whose other
ends the harness gets as its fds 3 and 4. Whatever the candidate prints, hooks, patches, exits
with, reads from its own interpreter or writes to its sandbox's files, the grader never sees
it: it holds the tests, and compares plain values rebuilt from builtins.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import pathlib
import time
from typing import Any

from environments.code import grader, problems
from environments.sandbox import RunResult, Sandbox

HERE = pathlib.Path(__file__).parent
CANDIDATE_COMMAND = "python3 -I -"  # the harness arrives on stdin; -I: no user site, no environment variables


def program(name: str, **constants: Any) -> str:
    """`<name>.py` as a standalone program: `plain.py` as the module `plain`, the constants, then its code."""
    plain = (HERE / "plain.py").read_text()
    boot = ("import sys, types\nplain = types.ModuleType('plain')\n"
            f"exec(compile({plain!r}, 'plain.py', 'exec'), plain.__dict__)\nsys.modules['plain'] = plain\n")
    return boot + "".join(f"{key} = {value!r}\n" for key, value in constants.items()) + (HERE / f"{name}.py").read_text()


@dataclasses.dataclass(frozen=True)
class Graded:
    lines: list[str]  # public: one line per test; hidden: why the tests did not pass (none when they did)
    passed: int  # public tests passed; hidden: 1 when all of `check` passed, else 0
    run: RunResult  # how the candidate's program ran: its own output, exit code, limits hit


def grade(sandbox: Sandbox, problem: problems.Problem, mode: str) -> Graded:
    """Runs the public (`mode="public"`) or hidden (`"hidden"`) tests of `problem` on solution.py."""
    calls_r, calls_w = os.pipe()
    replies_r, replies_w = os.pipe()
    harness = program("harness", PROMPT=problem.prompt, ENTRY_POINT=problem.entry_point, SOLUTION=problems.SOLUTION_FILE)
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="candidate") as pool:
        ran = pool.submit(sandbox.run, CANDIDATE_COMMAND, harness, (calls_r, replies_w))
        try:
            candidate = grader.Candidate(calls_w, replies_r, time.monotonic() + sandbox.limits.wall_s)
            names = grader.scope(problem.prompt, problem.entry_point, candidate)
            if mode == "public":
                tests = [(t, problems.shown_test(t, problem.entry_point)) for t in problem.public_tests]
                lines, passed = grader.public(tests, names)
            else:
                reason = grader.hidden(problem.test, names, candidate)
                lines, passed = [reason] if reason else [], int(not reason)
        finally:
            os.close(calls_w)  # the harness reads the end of its calls and exits
            os.close(replies_r)
        return Graded(lines, passed, ran.result())
