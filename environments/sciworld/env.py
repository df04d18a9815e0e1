"""ScienceWorld: elementary-science tasks (boil water, build a circuit, find a plant, ...) in a
text world simulated by the `scienceworld` package's engine.

AgentGym's task ids, wording and reward: `data_idx` indexes the flattened (task, variation)
list (`tasks.py`); a reset loads the variation and looks around, and the first observation is
the task description, a newline, and the room. The score is the engine's 0-100 progress; the
reward of a step is the change in score; success is a score of 100. An episode ends when the
engine says the task is complete, when the task has failed (the engine's score turns negative,
e.g. focusing on the wrong object; the score then counts as 0), or after `STEP_LIMIT` time steps
(1000, not AgentGym's 100: see the constant).

Determinism: a task id always loads the same world, but the engine lists objects that share a
name (e.g. three wood cups of paint) in an order that changes from load to load (measured: 5
orders in 12 loads of one variation). Observations put such runs of same-named lines in sorted
order (`canonical_order`), so a task id always gives the same text.

Speed: a step is the engine's plain step; the valid-action list (the slow call) is computed
only for `/available_actions`. Each session owns one engine process from a warm pool (`pool.py`),
taken at its first reset (a `/create` holds none), so the server's default session cap follows
from the machine's memory at `session_memory_mb` per engine.

Oracle: the engine's gold path. Planning it makes a load 2-10x slower, so it is planned only
when `/oracle_action` is first asked, by reloading the variation with the gold path and replaying
the episode so far (checked observation by observation). The oracle's next action is the gold
action after the taken ones; taken actions that took no time and changed nothing (refused
actions, `look around`, `inventory`, `task`) are skipped. Once any other action leaves the gold
path the oracle answers 409 (it cannot plan from an arbitrary state) until the next reset.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from agentgym_jax.envs.protocol import ProtocolError, StepResult, TaskInfo
from environments.base import Environment
from environments.sciworld import pool
from environments.sciworld import tasks as task_list
from environments.sciworld.pool import shared_pool
from environments.sciworld.simulator import Simulator

# Time steps (`wait` is ten) after which an episode ends. AgentGym keeps ScienceWorldEnv's default
# of 100, under which the gold path of some variations cannot finish (melting or freezing mercury:
# 321-361 time steps, 121-141 actions); rollouts cap their turns themselves.
STEP_LIMIT = 1000
REFUSED = "No known action matches that input."
AMBIGUOUS = "Ambiguous request"  # the engine then waits for the number of the meant action

INSTRUCTION = (
    "You are an agent in ScienceWorld, a text simulation of a house with a kitchen, a workshop, a "
    "greenhouse and more. Your task is given at the start. Each turn, answer with one action; I "
    "reply with what happened.\n"
    "Actions (OBJ and LOC are names of things you can see):\n"
    "- open OBJ / close OBJ: open or close a container or door\n"
    "- activate OBJ / deactivate OBJ: switch a device on or off\n"
    "- connect OBJ to OBJ / disconnect OBJ: wire electrical components\n"
    "- use OBJ [on OBJ]: use a device or item\n"
    "- look around: describe the room; look at OBJ: describe a thing; look in OBJ: list a "
    "container's contents\n"
    "- read OBJ: read a book or note\n"
    "- move OBJ to OBJ: put a thing into a container; pick up OBJ: take it; put down OBJ: drop it\n"
    "- pour OBJ into OBJ: pour a liquid; dunk OBJ into OBJ: dunk a container into a liquid; "
    "mix OBJ: mix a container's contents\n"
    "- go to LOC: walk to a neighbouring room (its door must be open)\n"
    "- eat OBJ, flush OBJ\n"
    "- focus on OBJ: mark the thing your task is about (only do this for the right thing: focusing "
    "on a wrong one fails the task)\n"
    "- wait: let 10 time steps pass; wait1: let one pass\n"
    "- examine OBJ: describe a thing and what is on or in it\n"
    "- task: repeat the task; inventory: list what you carry\n"
    "If I answer that your request is ambiguous, reply with the number of the action you meant.\n"
    "Reply in exactly this format:\n"
    "Thought:\nyour reasoning\n\nAction:\nyour next action"
)


@dataclasses.dataclass(frozen=True)
class Turn:
    """One action of the episode, with what the engine answered and whether time passed."""

    action: str
    observation: str
    took_time: bool


def _tie_key(line: str) -> str | None:
    """Indentation plus object name of a listing line such as `\ta wood cup (containing ...)`."""
    return line.split("(", 1)[0] if "(" in line else None


def canonical_order(observation: str) -> str:
    """Sorts each run of adjacent lines that name the same object (the engine's ties); the rest,
    and the order of the runs, stay as printed."""
    lines = observation.split("\n")
    out: list[str] = []
    start = 0
    while start < len(lines):
        key, end = _tie_key(lines[start]), start + 1
        while key is not None and end < len(lines) and _tie_key(lines[end]) == key:
            end += 1
        out += sorted(lines[start:end])
        start = end
    return "\n".join(out)


def _words(observation: str) -> list[str]:
    """An observation up to word order, for replay checks (ties may also sit inside a line)."""
    return sorted(observation.split())


def _same_action(a: str, b: str) -> bool:
    return " ".join(a.lower().split()) == " ".join(b.lower().split())


class SciWorldEnv(Environment):
    """One ScienceWorld episode on an engine of its own, taken from the warm pool."""

    name: ClassVar[str] = "sciworld"
    instruction: ClassVar[str] = INSTRUCTION
    success_threshold: ClassVar[float] = 100.0
    blocking: ClassVar[bool] = True  # engine calls block on a JVM; run them in the thread pool
    session_memory_mb: ClassVar[float] = pool.configured_heap_mb() + pool.ENGINE_OVERHEAD_MB
    extra_queries: ClassVar[tuple[str, ...]] = ("task_description", "goals", "action_hint")  # AgentGym's GETs
    # The shared suite's sweep: a gold-path episode costs seconds of engine CPU, and sessions
    # beyond the idle engines start JVMs; tests/test_sciworld.py covers every task name.
    oracle_sweep_episodes: ClassVar[int] = 8
    oracle_sweep_concurrency: ClassVar[int] = 1

    def __init__(self, simulator: Simulator | None = None) -> None:
        """Runs on `simulator` if given (tests), else on an engine from the warm pool taken at the
        first reset (so a `/create` whose client timed out and sent it again holds no engine)."""
        self.simulator: Simulator | None = simulator
        self.task: task_list.Task | None = None
        self._description = ""
        self._first_observation = ""
        self._observation = ""
        self._score = 0  # the last reported score, 0..100: rewards are its changes
        self._turns: list[Turn] = []
        self._gold: list[str] | None = None  # planned on the first /oracle_action of an episode

    @classmethod
    def task_info(cls) -> TaskInfo:
        all_tasks = task_list.tasks()
        return TaskInfo(
            env=cls.name,
            instruction=cls.instruction,
            success_threshold=cls.success_threshold,
            splits=task_list.splits(),
            num_tasks=len(all_tasks),
            has_oracle=cls.has_oracle,
            metadata={
                "task_names": [t.name for t in all_tasks],
                "variations": [t.variation for t in all_tasks],
                "step_limit": STEP_LIMIT,
            },
        )

    @classmethod
    def idle_engines(cls) -> int:
        return pool.configured_size()

    @classmethod
    def on_server_start(cls) -> None:
        shared_pool().start()

    @classmethod
    def on_server_stop(cls) -> None:
        shared_pool().close()

    def reset(self, data_idx: int) -> str:
        all_tasks = task_list.tasks()
        if not 0 <= data_idx < len(all_tasks):
            raise ValueError(f"ScienceWorld task id {data_idx} out of range [0, {len(all_tasks)})")
        self.task = all_tasks[data_idx]
        if self.simulator is None:
            self.simulator = shared_pool().acquire()
        self.simulator.load(self.task.name, self.task.variation)
        self._description = self.simulator.task_description()
        self._first_observation = canonical_order(self.simulator.step("look around"))
        self._observation = self._first_observation  # AgentGym's server: the description is its own field
        self._score = self.score()
        self._turns = []
        self._gold = None
        return self._observation

    def reset_fields(self) -> dict[str, Any]:
        """AgentGym's `/reset` answer carries the task on its own; its client (and ours) prepends it."""
        return {"task_description": self._description}

    def step(self, action: str) -> StepResult:
        moves_before = self.simulator.moves()
        observation = canonical_order(self.simulator.step(action))
        moves = self.simulator.moves()
        self._turns.append(Turn(action, observation, took_time=moves != moves_before))
        self._observation = observation
        score = self.score()
        reward, self._score = score - self._score, score
        failed = self.simulator.score() < 0
        done = self.simulator.completed() or failed or moves > STEP_LIMIT
        return self.result(observation, reward, done, invalid=observation.startswith(REFUSED),
                           moves=moves, task_failed=failed)

    def observation(self) -> str:
        return self._observation

    def available_actions(self) -> list[str]:
        """Every valid action-object combination now (hundreds to thousands; 0.1-0.5 s)."""
        return sorted(set(self.simulator.valid_actions()))

    def score(self) -> float:
        """The engine's progress on the 0-100 scale; a failed task scores 0."""
        if self.task is None:
            return 0.0
        return float(max(0, round(100 * self.simulator.score())))

    def verify(self) -> bool:
        return self.task is not None and self.simulator.completed() and self.simulator.score() >= 1.0

    def oracle_action(self) -> str:
        if self._gold is None:
            self._gold = self._plan_gold_path()
        position = 0  # index of the next gold action
        for step, turn in enumerate(self._turns, 1):
            if position < len(self._gold) and _same_action(turn.action, self._gold[position]):
                position += 1
            elif turn.took_time or turn.observation.startswith(AMBIGUOUS):
                expected = self._gold[position] if position < len(self._gold) else "(none left)"
                raise ProtocolError(
                    f"oracle unavailable: step {step} ({turn.action!r}) left the gold path (its action "
                    f"there is {expected!r}); the oracle can only continue the gold path: reset the episode",
                    409,
                )
        if position == len(self._gold):
            raise ProtocolError("oracle unavailable: the gold path is used up but the episode goes on", 409)
        return self._gold[position]

    def _plan_gold_path(self) -> list[str]:
        """Reloads the variation with its gold path and replays the episode so far on it."""
        assert self.task is not None
        self.simulator.load(self.task.name, self.task.variation, gold_path=True)
        replayed = [self.simulator.step("look around")] + [self.simulator.step(t.action) for t in self._turns]
        recorded = [self._first_observation] + [t.observation for t in self._turns]
        for step, (again, before) in enumerate(zip(replayed, recorded)):
            if _words(again) != _words(before):
                raise RuntimeError(f"replaying the episode with the gold path diverged at step {step}")
        return self.simulator.gold_actions()

    def _require_episode(self) -> None:
        if self.task is None:
            raise ProtocolError("no episode yet: POST /reset first", 409)

    def task_description(self) -> dict[str, Any]:
        """AgentGym's `GET /task_description`."""
        self._require_episode()
        return {"task_description": self.simulator.task_description()}

    def goals(self) -> dict[str, Any]:
        """AgentGym's `GET /goals`: the engine's goal-progress report."""
        self._require_episode()
        return {"goals": self.simulator.goal_progress()}

    def action_hint(self) -> dict[str, Any]:
        """AgentGym's `GET /action_hint`: action templates and the objects in view."""
        self._require_episode()
        return {"possible_actions": self.simulator.action_templates(),
                "possible_objects": self.simulator.object_names()}

    def close(self) -> None:
        if self.simulator is not None:
            shared_pool().release(self.simulator)
