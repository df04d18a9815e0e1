"""What the agent sees, as text and as named objects that actions can refer to.

Objects in view are named `<color> <type> <n>` ("red ball 1"), numbered per name from the nearest
(Manhattan distance, then fewer steps forward, then further left), as AgentGym's BabyAI server
numbers them by distance. Positions are relative to the agent: steps forward and steps left/right.
The agent's known grid is every cell it has seen this episode (`seen`, `[width, height]`); the
world changes only through the agent's own actions, so those cells' current contents are known.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
from minigrid.core.world_object import WorldObj
from minigrid.minigrid_env import MiniGridEnv

from environments.babyai.paths import PathTree

CARRIABLE = ("key", "ball", "box")


@dataclasses.dataclass(frozen=True)
class SeenObject:
    name: str  # "<color> <type>", e.g. "grey door"
    number: int  # 1 = the nearest visible object of this name
    pos: tuple[int, int]  # absolute grid cell
    forward: int  # steps ahead of the agent (>= 0 inside the view)
    right: int  # steps to the right (< 0: to the left)
    obj: WorldObj

    @property
    def label(self) -> str:
        return f"{self.name} {self.number}"


def door_state(door: WorldObj) -> str:
    return "open" if door.is_open else "locked" if door.is_locked else "closed"


def steppable(cell: WorldObj | None) -> bool:
    """Whether the agent can stand on the cell (empty, open door, floor; never lava)."""
    return cell is None or (cell.can_overlap() and cell.type != "lava")


def visible_cells(engine: MiniGridEnv, obs: dict) -> list[tuple[int, int]]:
    """Absolute cells in the field of view of the engine observation `obs` (walls hide what lies
    behind them). minigrid encodes cells out of sight as type 0 ("unseen") in `obs["image"]`."""
    vis_i, vis_j = np.nonzero(obs["image"][:, :, 0])  # view coords: i to the right, j from far to near
    size = engine.agent_view_size
    (fx, fy), (rx, ry) = engine.dir_vec, engine.right_vec
    x0, y0 = engine.agent_pos
    left, far = x0 + fx * (size - 1) - rx * (size // 2), y0 + fy * (size - 1) - ry * (size // 2)
    xs, ys = left - fx * vis_j + rx * vis_i, far - fy * vis_j + ry * vis_i
    inside = (xs >= 0) & (xs < engine.width) & (ys >= 0) & (ys < engine.height)
    return list(zip(xs[inside].tolist(), ys[inside].tolist()))


def _steps(n: int, word: str) -> str:
    return f"{n} step{'s' if n != 1 else ''} {word}"


def relative_phrase(forward: int, right: int) -> str:
    """(3, -2) -> "3 steps forward and 2 steps left"."""
    parts = []
    if forward:
        parts.append(_steps(forward, "forward" if forward > 0 else "back"))
    if right:
        parts.append(_steps(abs(right), "right" if right > 0 else "left"))
    return " and ".join(parts) if parts else "here"


class Scene:
    """The agent's current view and known grid: the text it reads and the targets actions name."""

    def __init__(self, engine: MiniGridEnv, seen: np.ndarray, visible: list[tuple[int, int]]):
        self.engine = engine
        self.seen = seen
        self.visible = visible
        pos = np.asarray(engine.agent_pos)
        self.state = (int(pos[0]), int(pos[1]), int(engine.agent_dir))
        found = []
        for x, y in self.visible:
            cell = engine.grid.get(x, y)
            if cell is None or cell.type == "wall" or (x, y) == self.state[:2]:
                continue
            rel = np.array((x, y)) - pos
            found.append((int(abs(rel).sum()), int(rel @ engine.dir_vec), int(rel @ engine.right_vec), (x, y), cell))
        found.sort(key=lambda f: f[:3])
        counts: dict[str, int] = {}
        self.objects: list[SeenObject] = []
        for _, forward, right, xy, cell in found:
            name = f"{cell.color} {cell.type}"
            counts[name] = counts.get(name, 0) + 1
            self.objects.append(SeenObject(name, counts[name], xy, forward, right, cell))

    def find(self, label: str) -> SeenObject | None:
        return next((o for o in self.objects if o.label == label), None)

    def find_at(self, pos: tuple[int, int]) -> SeenObject | None:
        return next((o for o in self.objects if o.pos == pos), None)

    @property
    def front(self) -> WorldObj | None:
        return self.engine.grid.get(*self.engine.front_pos)

    @functools.cached_property
    def paths(self) -> PathTree:
        """Shortest paths over the known grid (seen cells the agent can stand on)."""
        grid = self.engine.grid
        passable = np.zeros_like(self.seen)
        for x, y in zip(*np.nonzero(self.seen)):
            passable[x, y] = steppable(grid.get(x, y))
        return PathTree(self.state, passable)

    def _wall_distance(self, direction: np.ndarray) -> int | None:
        """Steps to the first wall along `direction` when only free cells lie before it in view."""
        visible = set(self.visible)
        cell_pos = np.asarray(self.engine.agent_pos)
        for k in range(1, self.engine.agent_view_size):
            cell_pos = cell_pos + direction
            xy = (int(cell_pos[0]), int(cell_pos[1]))
            if xy not in visible:
                return None
            cell = self.engine.grid.get(*xy)
            if cell is not None and cell.type == "wall":
                return k
            if not steppable(cell):
                return None
        return None

    def describe(self) -> str:
        """The observation text: objects in view, walls straight ahead and to the sides, what is carried."""
        if self.objects:
            seen = "; ".join(
                f"a {o.label}{', ' + door_state(o.obj) if o.obj.type == 'door' else ''} "
                f"({relative_phrase(o.forward, o.right)})"
                for o in self.objects)
            lines = [f"You see {seen}."]
        else:
            lines = ["You see no objects."]
        f_vec, r_vec = self.engine.dir_vec, self.engine.right_vec
        walls = [_steps(k, side) for side, vec in (("forward", f_vec), ("left", -r_vec), ("right", r_vec))
                 if (k := self._wall_distance(vec)) is not None]
        if walls:
            lines.append(f"Walls: {', '.join(walls)}.")
        carrying = self.engine.carrying
        lines.append(f"You are carrying a {carrying.color} {carrying.type}." if carrying else
                     "You are carrying nothing.")
        return "\n".join(lines)
