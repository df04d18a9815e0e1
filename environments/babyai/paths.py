"""Shortest primitive-action paths for a minigrid agent, by breadth-first search over (x, y, heading).

A state is `(x, y, d)` with minigrid's headings `d`: 0 east (+x), 1 south (+y), 2 west, 3 north.
From a state the agent can turn left, turn right, or move forward onto a passable cell; each costs
one primitive step, so BFS gives a path with the fewest engine steps. `passable` is a boolean
`[width, height]` array: the caller decides what the agent knows (cells it has seen) and what it
can stand on (empty cells, open doors).
"""

from __future__ import annotations

from collections import deque

import numpy as np
from minigrid.core.actions import Actions

DIR_VECS = ((1, 0), (0, 1), (-1, 0), (0, -1))  # heading -> (dx, dy), minigrid's DIR_TO_VEC
State = tuple[int, int, int]


class PathTree:
    """BFS tree of every agent state reachable from `start`; paths to face any target cell.

    One search serves every target (the list of available actions asks about each visible object).
    """

    def __init__(self, start: State, passable: np.ndarray):
        self.start = start
        self.parent: dict[State, tuple[State, int] | None] = {start: None}
        self.rank: dict[State, int] = {start: 0}  # discovery order, i.e. sorted by path length
        width, height = passable.shape
        queue = deque([start])
        while queue:
            state = queue.popleft()
            x, y, d = state
            dx, dy = DIR_VECS[d]
            moves = ((Actions.forward, (x + dx, y + dy, d)),
                     (Actions.left, (x, y, (d - 1) % 4)),
                     (Actions.right, (x, y, (d + 1) % 4)))
            for action, nxt in moves:
                if nxt in self.parent:
                    continue
                nx, ny, _ = nxt
                if action == Actions.forward and not (0 <= nx < width and 0 <= ny < height and passable[nx, ny]):
                    continue
                self.parent[nxt] = (state, int(action))
                self.rank[nxt] = len(self.rank)
                queue.append(nxt)

    def path_to(self, goal: State) -> list[int] | None:
        """Primitive actions from `start` to `goal`, or None when `goal` is unreachable."""
        if goal not in self.parent:
            return None
        actions = []
        state = goal
        while (link := self.parent[state]) is not None:
            state, action = link
            actions.append(action)
        return actions[::-1]

    def face(self, target: tuple[int, int]) -> list[int] | None:
        """The shortest path to a cell next to `target`, ending turned towards it; None if none."""
        tx, ty = target
        goals = [(tx - dx, ty - dy, d) for d, (dx, dy) in enumerate(DIR_VECS)]
        reachable = [g for g in goals if g in self.rank]
        if not reachable:
            return None
        return self.path_to(min(reachable, key=self.rank.__getitem__))

    def states(self) -> list[State]:
        """Every reachable state, nearest first."""
        return sorted(self.rank, key=self.rank.__getitem__)
