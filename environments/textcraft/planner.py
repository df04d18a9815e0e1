"""The TextCraft oracle: a plan of `get`/`craft` commands from the recipe tree and an inventory.

Depth-first over the shallowest recipe of each item: fetch base items, craft intermediates
before the items that use them, craft ceil(need / output count) batches. A simulated inventory
reserves what each pending craft will consume, so one branch never spends what another needs,
and what the player already holds is used first; re-planning from any inventory therefore
continues an episode from where it stands.
"""

from __future__ import annotations

import math

from environments.textcraft.recipes import Cookbook, Recipe, display_name


def _shallowest(cookbook: Cookbook, item: str) -> Recipe:
    """The recipe of `item` with the smallest crafting depth (first in file order on ties)."""
    return min(
        cookbook.recipes[item],
        key=lambda r: 1 + max(cookbook.depth[name] for name, _ in r.inputs),
    )


def _resolve(cookbook: Cookbook, name: str, need: int, free: dict[str, int]) -> str:
    """A concrete item for recipe input `name`: a tag's member already held in quantity, else
    its shallowest member (alphabetical on ties); an item is itself."""
    if name not in cookbook.tags:
        return name
    members = [m for m in cookbook.members(name) if math.isfinite(cookbook.depth[m])]
    held = [m for m in members if free.get(m, 0) >= need]
    return held[0] if held else min(members, key=lambda m: (cookbook.depth[m], m))


def _obtain(cookbook: Cookbook, item: str, need: int, free: dict[str, int], plan: list[str]) -> None:
    """Appends to `plan` the commands that produce `need` of `item`, then takes them from `free`."""
    take = min(free.get(item, 0), need)
    free[item] = free.get(item, 0) - take
    need -= take
    if need == 0:
        return
    if not cookbook.is_craftable(item):
        plan.append(f"get {need} {display_name(item)}")
        return
    recipe = _shallowest(cookbook, item)
    batches = math.ceil(need / recipe.count)
    used = []
    for name, count in recipe.inputs:
        concrete = _resolve(cookbook, name, count * batches, free)
        _obtain(cookbook, concrete, count * batches, free, plan)
        used.append(f"{count} {display_name(concrete)}")
    command = f"craft {recipe.count} {display_name(item)} using {', '.join(used)}"
    plan.extend([command] * batches)
    free[item] += batches * recipe.count - need


def plan(cookbook: Cookbook, goal: str, inventory: dict[str, int]) -> list[str]:
    """Commands that craft one `goal` starting from `inventory` (empty if one is already held)."""
    if inventory.get(goal, 0) > 0:
        return []
    actions: list[str] = []
    _obtain(cookbook, goal, 1, dict(inventory), actions)
    return actions
