"""Room: reach the goal in a small room with a few obstacles; the Maze's rules and actions.

Sized for the CPU quickstart, where a small policy trained from scratch on two cores must learn
visibly within minutes. The Maze holds out whole layouts and describes absolute positions, so
solving a test task needs exploration and arithmetic a tiny model cannot pick up that fast. A
room is open, and each observation says where the goal lies relative to you and which sides are
walls, in a few tokens; choosing a move towards the goal that no wall blocks is most of the
skill. `NUM_LAYOUTS` seeded rooms, `TASKS_PER_LAYOUT` start/goal pairs on each; every fourth
task id is held out for the test split (same rooms, unseen start/goal pairs).

Partial credit, always paid (the Maze's opt-in `progress` shaping, as the room's own reward):
each move earns `PROGRESS_REWARD` times the change in shortest-path distance to the goal
(negative when it moves away), and reaching the goal earns the rest of 1. An episode's reward (the
sum) is 1 exactly on success and at most `PROGRESS_REWARD * (MAX_DISTANCE - 1)` < 1 otherwise, so
success (reward >= `success_threshold` = 1) is unchanged, while episodes that all fail still
differ: a group-relative estimator (GRPO) gets a learning signal from every task, not only from
tasks where some samples happen to succeed. Multiples of 1/8 add exactly in floating point, so
the sum is never 0.999... on success.
"""

from __future__ import annotations

import functools
import random

from agentgym_jax.envs.protocol import TaskInfo
from environments.base import every_kth_held_out
from environments.maze import layouts
from environments.maze.env import MazeEnv
from environments.maze.layouts import Layout, Position

NUM_LAYOUTS = 4
TASKS_PER_LAYOUT = 100
NUM_TASKS = NUM_LAYOUTS * TASKS_PER_LAYOUT
SIZE = 6  # open cells per side
OBSTACLES = 3
MAX_STEPS = 12
MIN_DISTANCE, MAX_DISTANCE = 2, 7
PROGRESS_REWARD = 0.125  # per step of shortest-path progress; a power of two, so sums are exact

INSTRUCTION = f"""\
Reach the goal in a small room. Each turn says where the goal is and which sides of your square \
are walls (a move into a wall does nothing). You have {MAX_STEPS} moves: move up, move down, \
move left, move right.
Answer with:
Action: <one action>"""
_SIDES = (("up", (-1, 0)), ("down", (1, 0)), ("left", (0, -1)), ("right", (0, 1)))


@functools.lru_cache(maxsize=None)
def room_layout(index: int) -> Layout:
    """A SIZE x SIZE room inside walls with OBSTACLES wall cells, every open cell connected."""
    rng = random.Random(5_000 + index)
    while True:
        grid = [["#"] * (SIZE + 2)] + [["#"] + ["."] * SIZE + ["#"] for _ in range(SIZE)] + [["#"] * (SIZE + 2)]
        for x, y in rng.sample([(x, y) for x in range(1, SIZE + 1) for y in range(1, SIZE + 1)], OBSTACLES):
            grid[x][y] = "#"
        layout = tuple("".join(row) for row in grid)
        cells = layouts.open_cells(layout)
        if len(layouts.distances_to(layout, cells[0])) == len(cells):
            return layout


def room_task(task_id: int) -> tuple[Layout, Position, Position]:
    """Task id -> (layout, start, goal), the same in every process."""
    layout = room_layout(task_id // TASKS_PER_LAYOUT)
    rng = random.Random(104_729 * task_id + 3)
    cells = layouts.open_cells(layout)
    while True:
        goal = rng.choice(cells)
        starts = [c for c, d in sorted(layouts.distances_to(layout, goal).items()) if MIN_DISTANCE <= d <= MAX_DISTANCE]
        if starts:
            return layout, rng.choice(starts), goal


class RoomEnv(MazeEnv):
    """One room episode; everything but the task set and the move budget is the Maze's."""

    name = "room"
    instruction = INSTRUCTION
    route_prefixes = ()
    max_steps = MAX_STEPS
    reward_shapings = ()  # the credit below is the room's own reward, always paid
    progress_reward = PROGRESS_REWARD

    @classmethod
    def task_info(cls) -> TaskInfo:
        ids = range(NUM_TASKS)
        return TaskInfo(
            env=cls.name,
            instruction=cls.instruction,
            success_threshold=cls.success_threshold,
            splits=every_kth_held_out(NUM_TASKS, 4),
            num_tasks=NUM_TASKS,
            metadata={"layout": [i // TASKS_PER_LAYOUT for i in ids], "max_steps": MAX_STEPS},
        )

    @classmethod
    def task_setup(cls, data_idx: int) -> tuple[Layout, Position, Position]:
        return room_task(data_idx)

    def pays_progress(self) -> bool:
        return True  # the room's own reward (module docstring), not an option

    def _describe(self) -> str:
        """E.g. "Goal: 2 up, 3 right. Walls: left." (relative, so a move is read off directly)."""
        dx, dy = self.goal[0] - self.position[0], self.goal[1] - self.position[1]
        parts = [f"{abs(dx)} {'down' if dx > 0 else 'up'}"] if dx else []
        parts += [f"{abs(dy)} {'right' if dy > 0 else 'left'}"] if dy else []
        x, y = self.position
        walls = [side for side, (ax, ay) in _SIDES if not layouts.is_open(self.layout, (x + ax, y + ay))]
        return f"Goal: {', '.join(parts) or 'here'}. Walls: {', '.join(walls) or 'none'}."
