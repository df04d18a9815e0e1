"""The high-level action vocabulary and its compilation to minigrid's primitive actions.

Vocabulary (AgentGym's, plus the plain `pick up` and `toggle` primitives):
  turn left | turn right | move forward | pick up | drop | toggle | check available actions
  go to <color> <type> <n> | pick up <color> <type> <n>
  go through <color> door <n> | toggle and go through <color> door <n>
Targets are the labels of objects in view (`view.Scene`); `<n>` may be left out for 1. AgentGym's
spellings also work: `pickup ...`, and a door's state before `door` ("go through red open door 1";
the state word is not used to pick the door, whose current state decides). Paths are
searched over the agent's known grid. An action that cannot run now compiles to an `Invalid`
with the reason, which the environment shows as the observation.
"""

from __future__ import annotations

import dataclasses
import re

from minigrid.core.actions import Actions

from environments.babyai.view import CARRIABLE, Scene, door_state, steppable

CHECK = "check available actions"
PRIMITIVES: dict[str, Actions] = {
    "turn left": Actions.left,
    "turn right": Actions.right,
    "move forward": Actions.forward,
    "pick up": Actions.pickup,
    "drop": Actions.drop,
    "toggle": Actions.toggle,
}
VERBS = ("go to", "pick up", "go through", "toggle and go through")
# An object's number has at most 9 digits (a longer one is no object's, and int() of one past 4300 digits raises).
_TARGETED = re.compile(r"^(go to|pick up|go through|toggle and go through) (?:the )?(\w+) "
                       r"(?:open |closed |locked )?(\w+)(?: (\d{1,9}))?$")


@dataclasses.dataclass(frozen=True)
class Invalid:
    reason: str


def normalize(action: str) -> str:
    """Lower case, single spaces, no surrounding quotes or final period; AgentGym's `pickup` -> `pick up`."""
    action = " ".join(action.lower().split()).strip(" .!\"'`*")
    return re.sub(r"^pickup\b", "pick up", action)


def _front_check(scene: Scene, action: Actions) -> Invalid | None:
    """Why a primitive cannot act on the cell in front of the agent now, or None when it can."""
    front, carrying = scene.front, scene.engine.carrying
    what = f"the {front.color} {front.type}" if front is not None else "nothing"
    if action == Actions.forward and not steppable(front):
        return Invalid(f"You cannot move forward: {what} blocks the way.")
    if action == Actions.pickup:
        if carrying is not None:
            return Invalid(f"You cannot pick up: you already carry a {carrying.color} {carrying.type}; drop it first.")
        if front is None or not front.can_pickup():
            return Invalid(f"You cannot pick up {what}: only a key, ball or box right in front of you.")
    if action == Actions.drop:
        if carrying is None:
            return Invalid("You cannot drop: you are carrying nothing.")
        if front is not None:
            return Invalid(f"You cannot drop here: {what} is in front of you.")
    if action == Actions.toggle:
        if front is None or front.type not in ("door", "box"):
            return Invalid(f"You cannot toggle {what}: only a door or a box right in front of you.")
        if front.type == "door" and front.is_locked and not _has_key(scene, front):
            return Invalid(f"The {front.color} door is locked: you need to carry a {front.color} key.")
    return None


def _has_key(scene: Scene, door) -> bool:
    carrying = scene.engine.carrying
    return carrying is not None and carrying.type == "key" and carrying.color == door.color


def compile_action(action: str, scene: Scene) -> list[int] | Invalid:
    """A normalized action -> the primitive minigrid actions that carry it out, or why it cannot.

    `go to` a target the agent already faces compiles to minigrid's `done` (a step that moves
    nothing), so the engine still checks the arrival against the mission.
    """
    if action in PRIMITIVES:
        primitive = PRIMITIVES[action]
        invalid = _front_check(scene, primitive)
        return invalid if invalid else [int(primitive)]
    match = _TARGETED.match(action)
    if match is None:
        return Invalid(f"Unknown action {action[:80]!r}. Use one of the forms: turn left, turn right, "
                       "move forward, go to <color> <object> <n>, pick up <color> <object> <n>, pick up, "
                       "drop, toggle, go through <color> door <n>, toggle and go through <color> door <n>, "
                       f"{CHECK}.")
    verb, color, kind, number = match.groups()
    label = f"{color} {kind} {int(number) if number else 1}"
    target = scene.find(label)
    if target is None:
        return Invalid(f"There is no {label} in view.")
    if verb == "pick up":
        if kind not in CARRIABLE:
            return Invalid(f"You cannot pick up the {label}: only keys, balls and boxes can be carried.")
        if scene.engine.carrying is not None:
            carrying = scene.engine.carrying
            return Invalid(f"You cannot pick up the {label}: you already carry a {carrying.color} "
                           f"{carrying.type}; drop it first.")
    if verb in ("go through", "toggle and go through"):
        if kind != "door":
            return Invalid(f"The {label} is not a door.")
        state = door_state(target.obj)
        if verb == "go through" and state != "open":
            return Invalid(f"The {label} is {state}: use toggle and go through.")
        if verb == "toggle and go through" and state == "open":
            return Invalid(f"The {label} is already open: use go through.")
        if state == "locked" and not _has_key(scene, target.obj):
            return Invalid(f"The {label} is locked: you need to carry a {color} key.")
    path = scene.paths.face(target.pos)
    if path is None:
        return Invalid(f"You know no path to the {label}.")
    if verb == "go to":
        return path or [int(Actions.done)]
    if verb == "pick up":
        return path + [int(Actions.pickup)]
    forward = int(Actions.forward)
    if verb == "go through":
        return path + [forward, forward]
    return path + [int(Actions.toggle), forward, forward]


def available_actions(scene: Scene) -> list[str]:
    """Every action that compiles now: primitives, then per visible object (nearest first)."""
    actions = [name for name, primitive in PRIMITIVES.items() if _front_check(scene, primitive) is None]
    for o in scene.objects:
        verbs = ["go to"]
        if o.obj.type in CARRIABLE:
            verbs.append("pick up")
        if o.obj.type == "door":
            verbs.append("go through" if o.obj.is_open else "toggle and go through")
        for verb in verbs:
            text = f"{verb} {o.label}"
            if not isinstance(compile_action(text, scene), Invalid):
                actions.append(text)
    return actions + [CHECK]
