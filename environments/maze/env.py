"""The Maze environment: reach the goal square of a grid maze by `move up/down/left/right`.

Observations use LMRL-Gym's wording (goal position, current position, adjacent walls), so
AgentGym's maze prompts and trajectories read the same here. Reward 1 on reaching the goal,
0 otherwise; an episode ends at the goal or after `MAX_STEPS` moves. Task id -> (layout, start,
goal): `TASKS_PER_LAYOUT` start/goal pairs on each of `NUM_LAYOUTS` generated layouts; the last
`TEST_LAYOUTS` layouts are held out as the test split.

Two oracles: the default follows a shortest path (it solves every task, but its moves depend on
walls no observation shows, so a policy cloned on them learns little on unseen layouts); `local`
(`GET /oracle_action?oracle=local`, `layouts.local_move`) acts only on what the observation and
its last move show, and is what the CPU recipe clones (`configs/cpu.py`); `local_thought` answers
the same move as a whole reply, `Thought: The goal is above me, to my right.\nAction: move up`
(demonstrations render it with `rollout.action_format="{action}"`).

Opt-in shaping (`/create {"reward_shaping": "progress"}`, off by default; `environments/shaping.py`):
each move earns `progress_reward` times the decrease of the shortest-path distance to the goal
(negative when it moves away), the goal the rest of 1; a failed episode stays below 1, since
`progress_reward * (MAX_DISTANCE - 1)` < 1, and success is the goal reached, as without it.
"""

from __future__ import annotations

import random
import re
from typing import ClassVar

from agentgym_jax.envs.protocol import StepResult, TaskInfo
from environments.base import Environment, parse_thought_action
from environments.maze import layouts
from environments.maze.layouts import MOVES, Position
from environments.shaping import ProgressCredit

NUM_LAYOUTS = 12
TEST_LAYOUTS = 2
TASKS_PER_LAYOUT = 25
NUM_TASKS = NUM_LAYOUTS * TASKS_PER_LAYOUT
MAX_STEPS = 50  # LMRL-Gym's maze limit
MIN_DISTANCE, MAX_DISTANCE = 4, 30  # shortest-path length of a task, so the limit leaves slack
PROGRESS_REWARD = 1 / 32  # shaping per step of progress: 29 steps (the longest task's) earn < 1

_MOVE_RE = re.compile(r"^(?:move\s+|go\s+)?(up|down|left|right)$")
_ACTIONS_TEXT = ", ".join(f'"{a}"' for a in MOVES)

INSTRUCTION_TEMPLATE = f"""\
You are an expert maze solver. You stand in a grid maze and must reach the goal in as few moves \
as possible. Positions are written "x, y": x is the row and y is the column, so "move down" adds \
1 to x and "move right" adds 1 to y. After every move you are told where the goal is, where you \
are, and which sides of your square are walls; moving into a wall leaves you where you are. You \
have {{max_steps}} moves. The possible actions are {_ACTIONS_TEXT}.

Answer every turn in this format:
Thought:
<your reasoning about where to go>

Action:
<one action>"""
INSTRUCTION = INSTRUCTION_TEMPLATE.format(max_steps=MAX_STEPS)


def task(task_id: int) -> tuple[int, Position, Position]:
    """Task id -> (layout index, start, goal), the same in every process."""
    layout_idx = task_id // TASKS_PER_LAYOUT
    layout = layouts.maze_layout(layout_idx)
    rng = random.Random(7_919 * task_id + 17)
    cells = layouts.open_cells(layout)
    while True:
        goal = rng.choice(cells)
        far_enough = [c for c, d in sorted(layouts.distances_to(layout, goal).items())
                      if MIN_DISTANCE <= d <= MAX_DISTANCE]
        if far_enough:
            return layout_idx, rng.choice(far_enough), goal


def describe_walls(layout: layouts.Layout, position: Position) -> str:
    x, y = position
    sides = {"to your right": (0, 1), "to your left": (0, -1), "above you": (-1, 0), "below you": (1, 0)}
    walls = [side for side, (dx, dy) in sides.items() if not layouts.is_open(layout, (x + dx, y + dy))]
    if not walls:
        return "There are no walls around you."
    if len(walls) == 1:
        return f"There is a wall {walls[0]}."
    return f"There are walls {', '.join(walls)}."


class MazeEnv(Environment):
    """One maze episode. Cheap pure-python state, so the server calls it inline."""

    name = "maze"
    instruction = INSTRUCTION
    success_threshold = 1.0
    route_prefixes = ("/maze",)  # AgentGym's LMRL-Gym server serves the maze under /maze
    max_steps: ClassVar[int] = MAX_STEPS
    reward_shapings = ("progress",)
    # `local`: `layouts.local_move`, which acts on what observations show (SFT data a small policy can
    # learn); `local_thought`: the same move as a whole reply, after a thought naming where the goal lies
    # (`layouts.goal_direction`), so the comparison of positions is written out before the move.
    oracles = ("local", "local_thought")
    progress_reward: ClassVar[float] = PROGRESS_REWARD

    def __init__(self) -> None:
        self.layout: layouts.Layout = ()
        self.position: Position = (0, 0)
        self.goal: Position = (0, 0)
        self.steps = 0
        self.last_move: str | None = None
        self._dist: dict[Position, int] = {}
        self._observation = ""
        self._credit = ProgressCredit(self.progress_reward)

    @classmethod
    def task_info(cls) -> TaskInfo:
        first_test = (NUM_LAYOUTS - TEST_LAYOUTS) * TASKS_PER_LAYOUT
        return TaskInfo(
            env=cls.name,
            instruction=cls.instruction,
            success_threshold=cls.success_threshold,
            splits={"train": list(range(first_test)), "test": list(range(first_test, NUM_TASKS))},
            num_tasks=NUM_TASKS,
            metadata={"layout": [i // TASKS_PER_LAYOUT for i in range(NUM_TASKS)], "max_steps": MAX_STEPS},
        )

    @classmethod
    def parse_action(cls, text: str) -> str | None:
        """`Thought: ... Action: move up` -> "move up"; other text is kept and judged by `step`."""
        action = parse_thought_action(text)
        if action is None:
            return None
        match = _MOVE_RE.match(action.lower().strip(" .!\"'`*"))
        return f"move {match.group(1)}" if match else action

    @classmethod
    def task_setup(cls, data_idx: int) -> tuple[layouts.Layout, Position, Position]:
        """Task id -> (layout, start, goal); subclasses with other task sets override it."""
        layout_idx, start, goal = task(data_idx)
        return layouts.maze_layout(layout_idx), start, goal

    def reset(self, data_idx: int) -> str:
        return self.start(*self.task_setup(data_idx))

    def start(self, layout: layouts.Layout, start: Position, goal: Position) -> str:
        """Starts an episode on any layout (task ids use the generated ones); first observation."""
        if not (layouts.is_open(layout, start) and layouts.is_open(layout, goal)):
            raise ValueError(f"start {start} and goal {goal} must be open cells")
        self.layout, self.position, self.goal = layout, start, goal
        self._dist = layouts.distances_to(layout, goal)
        if start not in self._dist:
            raise ValueError(f"goal {goal} is unreachable from {start}")
        self.steps = 0
        self.last_move = None
        self._credit.reset()
        self._observation = self._describe()
        return self._observation

    def _describe(self) -> str:
        return (f"The goal is at position {self.goal[0]}, {self.goal[1]}. "
                f"Your current position is at position {self.position[0]}, {self.position[1]}. "
                + describe_walls(self.layout, self.position))

    def pays_progress(self) -> bool:
        """Whether moves earn partial credit (the module docstring): here only when opted into."""
        return self.reward_shaping == "progress"

    def step(self, action: str) -> StepResult:
        self.steps += 1
        before = self._dist[self.position]
        move = MOVES.get(action)
        self.last_move = action if move is not None else None
        if move is not None:
            target = (self.position[0] + move[0], self.position[1] + move[1])
            if layouts.is_open(self.layout, target):
                self.position = target
        solved = self.verify()
        out_of_moves = self.steps >= self.max_steps and not solved
        if solved:
            self._observation = "Success"
        elif move is None:
            self._observation = f"Invalid action {action[:80]!r}. The possible actions are {_ACTIONS_TEXT}. " + self._describe()
        else:
            self._observation = self._describe()
        if out_of_moves:
            self._observation += f" You have used all {self.max_steps} moves."
        reward = self._credit.pay(solved, before - self._dist[self.position]) if self.pays_progress() else float(solved)
        return self.result(self._observation, reward, solved or out_of_moves, invalid=move is None, steps=self.steps)

    def observation(self) -> str:
        return self._observation

    def available_actions(self) -> list[str]:
        return list(MOVES)

    def verify(self) -> bool:
        return bool(self.layout) and self.position == self.goal

    def oracle_action(self) -> str:
        return layouts.next_move(self.layout, self._dist, self.position)

    def named_oracle_action(self, oracle: str) -> str:
        move = layouts.local_move(self.layout, self.position, self.goal, self.last_move)
        if oracle == "local":
            return move
        return f"Thought: {layouts.goal_direction(self.position, self.goal)}\nAction: {move}"
