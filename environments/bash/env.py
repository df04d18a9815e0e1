"""Bash: multi-turn shell tasks over a generated file system, each command run in the sandbox.

Each turn the action is one shell command (it may span lines, e.g. a heredoc); the observation
is its stdout, stderr and exit code, and says when a limit stopped it (`RunResult.render`). A
command the shell cannot find (exit code 127) or cannot parse (its syntax error) is an invalid
action. Commands run one at a time in a fresh `bash -c` in /work: files persist between turns,
`cd`, variables and background processes do not. `submit` ends the episode (`submit <answer>`
for a question); reward 1 when the task is solved: the answer matches, or the state the host
reads back from the sandbox's files, following no link (`Sandbox.read`), does (`tasks.py` says
how each task is checked). The episode ends unsolved after `MAX_TURNS`.

Every episode gets a fresh sandbox (`environments/sandbox/`), closed with the session.
Tasks: `tasks.py`'s templates; the test split is every fifth id, which covers every template.
"""

from __future__ import annotations

import re
from typing import ClassVar

from agentgym_jax.envs.protocol import StepResult, TaskInfo
from environments.base import every_kth_held_out
from environments.bash import tasks
from environments.sandbox import Limits, RequestFailed, RunResult, Sandbox
from environments.sandbox.episode import SandboxEnv

MAX_TURNS = 20
TEST_EVERY = 5  # coprime with the 8 templates: the test split holds each template equally
LIMITS = Limits(cpu_s=5.0, wall_s=10.0, memory_bytes=512 << 20, processes=64, output_bytes=4096, disk_bytes=16 << 20,
                session_memory_bytes=1 << 30)
NOT_FOUND = 127  # bash's exit code for a command it cannot find
SYNTAX_ERROR = 2  # ... and for one it cannot parse, with this message first:
SYNTAX_MESSAGE = re.compile(r"^/bin/bash: -c: line \d+: syntax error")

INSTRUCTION = (
    "You solve tasks in a Linux shell. Your files are in /work, the current directory. Each turn, run one bash "
    "command; I reply with its stdout, stderr and exit code. Every command starts in a fresh shell in /work: "
    "files you change stay changed, but `cd`, variables and background processes do not carry over. There "
    f"is no network, and a command is stopped after {LIMITS.wall_s:g} seconds or {LIMITS.output_bytes} bytes "
    "of output.\n"
    "When a task asks a question, answer with `submit <answer>`; when it asks you to change files, reply "
    "`submit` once you are done. Submitting ends the task.\n"
    "Reply in exactly this format:\n"
    "Thought:\nyour reasoning\n\nAction:\nyour command"
)


def normal_answer(text: str) -> str:
    """An answer as compared: quotes, backticks and a final period dropped; a path without `./` or
    `/work/`; a number as an integer."""
    text = text.strip().rstrip(".").strip("`'\"").rstrip(".").strip()
    for prefix in ("/work/", "./"):
        if text.startswith(prefix):
            text = text[len(prefix):]
    try:
        return str(int(text))
    except ValueError:
        return text


def unrunnable(run: RunResult) -> bool:
    """A command bash could not find or not parse: the shell's own invalid action."""
    return run.exit_code == NOT_FOUND or (run.exit_code == SYNTAX_ERROR and bool(SYNTAX_MESSAGE.match(run.stderr)))


def _same_text(got: str | None, want: str) -> bool:
    """File contents equal up to trailing newlines."""
    return got is not None and got.rstrip("\n") == want.rstrip("\n")


class BashEnv(SandboxEnv):
    """One shell task in its own sandbox."""

    name: ClassVar[str] = "bash"
    instruction: ClassVar[str] = INSTRUCTION
    limits: ClassVar[Limits] = LIMITS
    max_turns: ClassVar[int] = MAX_TURNS
    oracle_sweep_episodes: ClassVar[int] = 40  # the whole test split

    def __init__(self) -> None:
        super().__init__()
        self.task: tasks.Task | None = None
        self.solved: bool | None = None  # None until submitted
        self.oracle_next = 0  # index of the oracle's next command in `task.commands`

    @classmethod
    def task_info(cls) -> TaskInfo:
        all_tasks = tasks.all_tasks()
        return TaskInfo(
            env=cls.name, instruction=cls.instruction, success_threshold=cls.success_threshold,
            splits=every_kth_held_out(len(all_tasks), TEST_EVERY), num_tasks=len(all_tasks),
            has_oracle=cls.has_oracle,
            metadata={"templates": [t.template for t in all_tasks], "max_turns": MAX_TURNS,
                      "limits": LIMITS.as_json()},
        )

    def reset(self, data_idx: int) -> str:
        all_tasks = tasks.all_tasks()
        if not 0 <= data_idx < len(all_tasks):
            raise ValueError(f"bash task id {data_idx} out of range [0, {len(all_tasks)})")
        self.close()
        self.task = all_tasks[data_idx]
        self.sandbox = Sandbox(LIMITS)
        self.sandbox.write(self.task.files, self.task.executable)
        self.turns, self.solved, self.oracle_next = 0, None, 0
        self._observation = f"Task: {self.task.question}"
        return self._observation

    def act(self, action: str) -> StepResult:
        if action == self.task.commands[min(self.oracle_next, len(self.task.commands) - 1)]:
            self.oracle_next += 1
        word, _, rest = action.partition(" ")
        if word == "submit":
            return self._submit(rest.strip())
        run = self.sandbox.run(action)
        return self.go_on(run.render(LIMITS), invalid=unrunnable(run), exit_code=run.exit_code,
                          timed_out=run.timed_out, truncated=run.truncated)

    def _submit(self, answer: str) -> StepResult:
        if self.task.answer is not None and not answer:
            return self.go_on("This task asks a question: reply `submit <answer>`.", invalid=True)
        self.solved = self._check(answer)
        verdict = "correct" if self.solved else "not correct"
        self._observation = f"Your submission is {verdict}. The task is over."
        return self.result(self._observation, float(self.solved), True, invalid=False)

    def _check(self, answer: str) -> bool:
        """The answer, or the state read back from the sandbox, against the task's."""
        task = self.task
        if task.answer is not None:
            return normal_answer(answer) == normal_answer(task.answer)
        try:
            if task.check_root:
                got = self.sandbox.read([task.check_root])
                return got.keys() == task.expected.keys() and all(_same_text(got[p], t) for p, t in task.expected.items())
            self.sandbox.write(task.check_files)
        except RequestFailed:  # a tree past the read caps; no room, or a folder, where the new data goes
            return False
        run = self.sandbox.run(task.check_command)
        return run.exit_code == 0 and run.stdout.strip() == task.expected_output.strip()

    def available_actions(self) -> list[str]:
        """Examples of the action forms (any bash command is an action)."""
        return ["ls -R", "cat <file>", "grep -rn <text> .", "submit", "submit <answer>"]

    def verify(self) -> bool:
        return bool(self.solved)

    def oracle_action(self) -> str:
        return self.task.commands[min(self.oracle_next, len(self.task.commands) - 1)]
