"""What every environment whose episode plays in a sandbox shares (`bash`, `code`).

One sandbox per episode, made at `reset` and closed with the session; the action is code
(`actions.code_action`); an episode ends unsolved after `max_turns`. A `SandboxError` during a
turn (the sandbox ended, stopped answering, or refused a request the environment did not expect
to fail) is something the agent's own commands caused, so it ends the episode as a failure with
reward 0 and an observation saying what happened, never as an error of the server: an
infrastructure error is for faults of the machine or the server (architecture rule 8a).
"""

from __future__ import annotations

import abc
from typing import Any, ClassVar

from agentgym_jax.envs.protocol import StepResult
from environments.base import Environment
from environments.sandbox.actions import code_action
from environments.sandbox.sandbox import Limits, Sandbox, SandboxError, announce


class SandboxEnv(Environment):
    """An episode in its own sandbox; subclasses set `limits` and `max_turns` and implement `act`."""

    blocking: ClassVar[bool] = True  # a command may run up to the wall limit
    max_sessions: ClassVar[int] = 64  # each session is a sandbox
    oracle_sweep_concurrency: ClassVar[int] = 4
    limits: ClassVar[Limits]
    max_turns: ClassVar[int]

    def __init__(self) -> None:
        self.sandbox: Sandbox | None = None
        self.turns = 0
        self._observation = ""

    @classmethod
    def on_server_start(cls) -> None:
        announce(cls.limits)  # a missing bubblewrap stops the server; says how sessions are held

    @classmethod
    def parse_action(cls, text: str) -> str | None:
        return code_action(text)

    def step(self, action: str) -> StepResult:
        self.turns += 1
        try:
            return self.act(action)
        except SandboxError as e:
            self.close()
            self._observation = f"The sandbox stopped ({e}). The task is over."
            return self.result(self._observation, 0.0, True, invalid=False, sandbox_error=str(e))

    @abc.abstractmethod
    def act(self, action: str) -> StepResult:
        """One turn, in the open sandbox."""

    def go_on(self, observation: str, invalid: bool, **info: Any) -> StepResult:
        """A turn that does not end the episode, unless it was the last one."""
        done = self.turns >= self.max_turns
        if done:
            observation += f"\nYou have used all {self.max_turns} turns without submitting. The task is over."
        self._observation = observation
        return self.result(observation, 0.0, done, invalid=invalid, **info)

    def observation(self) -> str:
        return self._observation

    def close(self) -> None:
        if self.sandbox is not None:
            self.sandbox.close()
            self.sandbox = None
