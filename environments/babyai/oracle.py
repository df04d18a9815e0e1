"""The oracle: minigrid's BabyAIBot, kept in step with the episode, plus the help it needs, and a
shortcut to the high-level action that completes a one-clause mission whose target is in view.

The shortcut (`mission_action`) makes demonstrations read the way a policy is meant to act: "go to
red ball 1" when the mission is "go to the red ball" and one is in view, rather than the bot's
turns and steps. It names only an object the mission's own verifier accepts (`ObjDesc.obj_set`,
fixed at reset), so the action completes the mission; anything else (sequences, put-next, a target
out of view or behind a locked door) is the bot's.

The bot plans one primitive action at a time and must observe every step it plans for (it keeps
its own map of seen cells and a stack of subgoals). `Oracle.observe` is told which primitives the
episode executed; anything but the bot's own suggestion (the policy acted on its own) drops the
bot, and the next request builds a fresh one from the current state.

Three cases the bot cannot handle alone (its docstring lists the first two) get scripted help on
privileged knowledge of the grid; each script runs, then a fresh bot takes over:
- a fresh bot assumes empty hands (PutNext*Carrying starts carrying the object to move): drop it;
- a key hidden in a box (KeyInBox): open that box first;
- in some UnlockToUnlock layouts the bot never gets past a locked door whose key it has not seen:
  either its replanning loops forever (its subgoal stack grows without bound; a bounded stack turns
  that into an error) or it turns left and right on the spot for ever. Either way the script
  fetches a reachable key and unlocks its door.
"""

from __future__ import annotations

from collections import deque

import numpy as np
from minigrid.core.actions import Actions
from minigrid.envs.babyai.core.roomgrid_level import RoomGridLevel
from minigrid.envs.babyai.core.verifier import GoToInstr, OpenInstr, PickupInstr
from minigrid.utils.baby_ai_bot import BabyAIBot, DisappearedBoxError

from environments.babyai.actions import Invalid, compile_action
from environments.babyai.paths import DIR_VECS, PathTree
from environments.babyai.view import Scene, steppable

MAX_STACK = 64  # the bot's deepest honest plan is ~20 subgoals; a loop passes this in microseconds
MAX_TURNS_IN_PLACE = 6  # a 180-degree turn takes 2; more than 6 turns in a row make no progress
Step = int | tuple[str, tuple[int, int]]  # a primitive, or ("face", cell): walk to face the cell


# The action that completes each one-clause mission on its object ("open": toggle the door, which
# the engine checks on the toggle step, before the walk through).
MISSION_VERBS = {GoToInstr: "go to", PickupInstr: "pick up", OpenInstr: "toggle and go through"}


def mission_action(engine: RoomGridLevel, scene: Scene) -> str | None:
    """The high-level action that completes a one-clause mission now, or None (the bot's turn)."""
    verb = MISSION_VERBS.get(type(engine.instrs))
    if verb is None:
        return None
    targets = engine.instrs.desc.obj_set  # the objects the verifier accepts (not recomputed: "behind you" is from the start)
    for seen in scene.objects:  # nearest first
        if any(seen.obj is t for t in targets):
            action = f"{verb} {seen.label}"
            if not isinstance(compile_action(action, scene), Invalid):
                return action
    return None


class PlanningLoop(Exception):
    """The bot's subgoal stack grew past `MAX_STACK`: its replanning would never return."""


class _BoundedStack(list):
    def append(self, subgoal) -> None:
        if len(self) >= MAX_STACK:
            raise PlanningLoop(f"BabyAIBot stack passed {MAX_STACK} subgoals")
        super().append(subgoal)


class Oracle:
    """Next primitive action for an engine; `observe` after every executed action."""

    def __init__(self, engine: RoomGridLevel):
        self.engine = engine
        self.bot: BabyAIBot | None = None
        self.script: deque[Step] = deque()
        self.pending: int | None = None  # the suggestion not yet executed
        self.turns_in_place = 0  # consecutive executed turns

    def next_action(self) -> int:
        """The primitive to execute next (the same one until something is executed)."""
        if self.pending is None:
            self.pending = self._plan()
        return self.pending

    def observe(self, executed: list[int]) -> None:
        """The episode executed `executed`; keeps the plan only if that was the suggestion."""
        if not executed:
            return  # invalid actions and `check available actions` leave the world as it was
        turning = all(a in (Actions.left, Actions.right) for a in executed)
        self.turns_in_place = self.turns_in_place + len(executed) if turning else 0
        if executed != [self.pending]:
            self.bot = None
            self.script.clear()
        self.pending = None

    def _plan(self) -> int:
        for _ in range(8):  # scripts and fresh bots, each a finite plan
            if self.script:
                step = self.script.popleft()
                if not isinstance(step, tuple):
                    return step
                path = self._paths().face(step[1])
                if path is None:
                    self.script.clear()
                    continue
                self.script.extendleft(reversed(path))
                continue
            if self.bot is not None and self.turns_in_place > MAX_TURNS_IN_PLACE:
                self.bot, self.turns_in_place = None, 0
                self.script.extend(self._unlock_script())
                continue
            if self.bot is None:
                self.script.extend(self._fresh_start_script())
                if self.script:
                    continue
                self.bot = BabyAIBot(self.engine)
                self.bot.stack = _BoundedStack(self.bot.stack)
            try:
                return int(self.bot.replan())
            except (PlanningLoop, AssertionError, DisappearedBoxError):
                self.bot = None
                self.script.extend(self._unlock_script())
        raise RuntimeError(f"no oracle plan for mission {self.engine.mission!r}")

    # --- scripts on privileged knowledge of the grid ---

    def _paths(self, cleared: tuple[int, int] | None = None) -> PathTree:
        """Paths over the whole grid, with the object at `cleared` (if any) taken away."""
        grid = self.engine.grid
        passable = np.array([[steppable(grid.get(x, y)) for y in range(grid.height)] for x in range(grid.width)])
        if cleared is not None:
            passable[cleared] = True
        x, y = self.engine.agent_pos
        return PathTree((int(x), int(y), int(self.engine.agent_dir)), passable)

    def _objects(self, kind: str):
        """(cell, object) of every `kind` object lying on the grid."""
        grid = self.engine.grid
        for x in range(grid.width):
            for y in range(grid.height):
                cell = grid.get(x, y)
                if cell is not None and cell.type == kind:
                    yield (x, y), cell

    def _drop_script(self) -> list[Step]:
        """Walk to the nearest state facing an empty cell and drop what is carried."""
        grid, paths = self.engine.grid, self._paths()
        width, height = grid.width, grid.height
        for state in paths.states():
            x, y, d = state
            fx, fy = x + DIR_VECS[d][0], y + DIR_VECS[d][1]
            if 0 <= fx < width and 0 <= fy < height and grid.get(fx, fy) is None:
                return [*paths.path_to(state), int(Actions.drop)]
        return []

    def _fresh_start_script(self) -> list[Step]:
        if self.engine.carrying is not None:
            return self._drop_script()
        loose_keys = {key.color for _, key in self._objects("key")}
        for pos, box in self._objects("box"):
            hidden = box.contains
            if hidden is not None and hidden.type == "key" and hidden.color not in loose_keys:
                return [("face", pos), int(Actions.toggle)]
        return []

    def _unlock_script(self) -> list[Step]:
        """Fetch the nearest reachable key whose locked door is reachable, and unlock that door."""
        paths = self._paths()
        locked = {door.color: pos for pos, door in self._objects("door") if door.is_locked}
        best = None
        for key_pos, key in self._objects("key"):
            door_pos = locked.get(key.color)
            to_key = paths.face(key_pos)
            if door_pos is None or to_key is None or self._paths(cleared=key_pos).face(door_pos) is None:
                continue
            if best is None or len(to_key) < best[0]:
                best = (len(to_key), key_pos, door_pos)
        if best is None:
            return []
        _, key_pos, door_pos = best
        drop = self._drop_script() if self.engine.carrying is not None else []
        return [*drop, ("face", key_pos), int(Actions.pickup), ("face", door_pos), int(Actions.toggle)]
