"""Grading a solution where the candidate cannot reach the verdict (architecture rule 8a).

Each `run` or `submit` is two processes: the candidate's, in the sandbox (`harness.py`: the
prompt, then solution.py, then the entry point called on demand), and the grader's, on the host
(`grader.py`: the tests, with `candidate` a proxy). They talk over two pipes, one end of each
handed to each side; the verdict is the grader's output alone. Whatever the candidate prints,
hooks, patches, exits with, reads from its own interpreter or writes to its sandbox's files,
the grader never sees it: it holds the tests, and compares plain values rebuilt from builtins.
A grader that crashes or hangs (nothing the candidate sends should make it) counts as failed
tests, logged.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pathlib
import subprocess
from typing import Any

from environments.code import problems
from environments.sandbox import RunResult, Sandbox
from environments.sandbox.sandbox import GRACE_S, PYTHON

log = logging.getLogger(__name__)

HERE = pathlib.Path(__file__).parent
CANDIDATE_COMMAND = "python3 -I -"  # the harness arrives on stdin; -I: no user site, no environment variables


def program(name: str, **constants: Any) -> str:
    """`<name>.py` as a standalone program: `plain.py` as the module `plain`, the constants, then its code."""
    plain = (HERE / "plain.py").read_text()
    boot = ("import sys, types\nplain = types.ModuleType('plain')\n"
            f"exec(compile({plain!r}, 'plain.py', 'exec'), plain.__dict__)\nsys.modules['plain'] = plain\n")
    return boot + "".join(f"{key} = {value!r}\n" for key, value in constants.items()) + (HERE / f"{name}.py").read_text()


GRADER = program("grader")


@dataclasses.dataclass(frozen=True)
class Graded:
    verdict: dict[str, Any]  # the grader's answer (`grader.py` says what it holds)
    run: RunResult  # how the candidate's program ran: its own output, exit code, limits hit


def _spec(problem: problems.Problem, mode: str, wall_s: float) -> dict[str, Any]:
    spec = {"mode": mode, "prompt": problem.prompt, "entry_point": problem.entry_point, "wall_s": wall_s}
    if mode == "public":
        spec["tests"] = [[t, problems.shown_test(t, problem.entry_point)] for t in problem.public_tests]
    else:
        spec["test"] = problem.test
    return spec


def _failed(mode: str, reason: str) -> dict[str, Any]:
    if mode == "public":
        return {"lines": [f"ERROR: the public tests did not finish ({reason})"], "passed": 0, "total": 0}
    return {"passed": False, "reason": reason}


def grade(sandbox: Sandbox, problem: problems.Problem, mode: str) -> Graded:
    """Runs the public (`mode="public"`) or hidden (`"hidden"`) tests of `problem` on solution.py."""
    calls_r, calls_w = os.pipe()
    replies_r, replies_w = os.pipe()
    spec_r, spec_w = os.pipe()
    try:
        grader = subprocess.Popen([PYTHON, "-I", "-S", "-c", GRADER, str(calls_w), str(replies_r)],
                                  stdin=spec_r, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  pass_fds=(calls_w, replies_r), cwd="/")
    except OSError:
        for fd in (calls_r, replies_w, spec_w):
            os.close(fd)
        raise
    finally:
        for fd in (calls_w, replies_r, spec_r):
            os.close(fd)
    harness = program("harness", PROMPT=problem.prompt, ENTRY_POINT=problem.entry_point, SOLUTION=problems.SOLUTION_FILE)
    try:
        with open(spec_w, "wb") as spec:  # the grader reads it whole before anything else
            spec.write(json.dumps(_spec(problem, mode, sandbox.limits.wall_s)).encode())
        run = sandbox.run(CANDIDATE_COMMAND, stdin=harness, give_fds=(calls_r, replies_w))
    except BaseException:
        grader.kill()
        grader.communicate()
        raise
    try:
        out, err = grader.communicate(timeout=GRACE_S)
    except subprocess.TimeoutExpired:
        grader.kill()
        out, err = grader.communicate()
    if grader.returncode != 0:
        log.warning("the %s grader of %s ended with %s: %s", mode, problem.task_id, grader.returncode,
                    err.decode(errors="replace")[-2000:])
        return Graded(_failed(mode, "the grader ended early"), run)
    return Graded(json.loads(out), run)
