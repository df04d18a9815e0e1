"""TextCraft: craft a Minecraft item from base items with a few given crafting commands.

AgentGym's action grammar and wording: `get N item`, `craft N item using N a, N b`,
`inventory`; the first observation is "Crafting commands:\n...\n\nGoal: craft X.". Reward 1
(and done) when the goal is crafted. Base items come from `get`; craftable items and tags
cannot be fetched. A recipe input that is a tag (`planks`) is satisfied by naming a concrete
item of it (`oak planks`). The output count written in a craft command is ignored: one craft
makes what the recipe makes.

Opt-in shaping (`/create {"reward_shaping": "progress"}`, off by default; `environments/shaping.py`):
each step earns `PROGRESS_REWARD` times the decrease of the number of commands left in the
oracle's plan (`planner.plan` from the inventory: a needed `get` or craft shortens it by one), the
goal's craft the rest of 1. Plans run 2 to 48 commands, so a failed episode stays below 1.

Task id -> goal: the goals sorted by (crafting depth, item id); the test split is every fifth
id, so it covers every depth. Each task's command list is the goal's whole recipe tree plus up to
ten distractor recipes that use the same ingredients, drawn and shuffled by
`random.Random(task id)`.
"""

from __future__ import annotations

import random
import re
from typing import Any, ClassVar

from agentgym_jax.envs.protocol import ProtocolError, StepResult, TaskInfo
from environments.base import Environment, every_kth_held_out, parse_thought_action
from environments.shaping import ProgressCredit
from environments.textcraft import planner
from environments.textcraft.recipes import Cookbook, Recipe, cookbook, display_name, item_id

MAX_DISTRACTORS = 10
PROGRESS_REWARD = 1 / 64  # shaping per command of the plan done: the longest plan (48) earns < 1
TEST_EVERY = 5  # task ids divisible by this form the test split

# Counts have at most 9 digits: a longer one is no item count, and int() of one past 4300 digits raises.
_GET = re.compile(r"get (\d{1,9}) (.+)")
_CRAFT = re.compile(r"craft (?:\d+ )?(.+?) using (.+)")
_COUNTED = re.compile(r"(\d{1,9}) (.+)")

INSTRUCTION = (
    "You are crafting an item in Minecraft. At the start you see some crafting commands, written "
    '"craft [target] using [ingredients]", and the item to craft. Each turn, answer with one '
    "action; I reply with what happened.\n"
    "Actions:\n"
    '- "get N item" takes N of a base item (one that has no recipe) from the world.\n'
    '- "craft N target using N a, N b" crafts with one of the given commands, using items '
    "from your inventory.\n"
    '- "inventory" lists what you carry.\n'
    "Always give quantities, exactly as in the command, e.g. get 1 lapis lazuli, or craft 1 "
    "golden carrot using 8 gold nugget, 1 carrot. Use only the given crafting commands. When a "
    'command names a kind of ingredient such as "planks", write the concrete item you use, '
    'such as "dark oak planks".\n'
    "Reply in exactly this format:\n"
    "Thought:\nyour reasoning\n\nAction:\nyour next action"
)


class ActionFailed(Exception):
    """An invalid action; its message is the observation the player gets."""


def _normalize(action: str) -> str:
    """Lower-case, drops all but letters, digits, commas and spaces, squeezes spaces."""
    kept = re.sub(r"[^a-z0-9, ]+", " ", action.lower())
    return " ".join(kept.split())


class TextCraftEnv(Environment):
    """One TextCraft episode over the shared, read-only cookbook."""

    name: ClassVar[str] = "textcraft"
    instruction: ClassVar[str] = INSTRUCTION
    extra_queries: ClassVar[tuple[str, ...]] = ("commands", "goal")  # AgentGym's extra GETs
    reward_shapings = ("progress",)

    def __init__(self) -> None:
        self.book: Cookbook = cookbook()
        self.goal_id: str | None = None
        self.commands_text = ""
        self.inventory: dict[str, int] = {}
        self._observation = ""
        self._credit = ProgressCredit(PROGRESS_REWARD)

    @classmethod
    def task_info(cls) -> TaskInfo:
        goals = cookbook().goals
        ids = range(len(goals))
        return TaskInfo(
            env=cls.name,
            instruction=cls.instruction,
            success_threshold=cls.success_threshold,
            splits=every_kth_held_out(len(ids), TEST_EVERY),
            num_tasks=len(goals),
            has_oracle=cls.has_oracle,
            metadata={"depth": [int(cookbook().depth[g]) for g in goals]},
        )

    @classmethod
    def check_create(cls, body: dict[str, Any]) -> None:
        """AgentGym's custom task (`commands`/`goal` at `/create`) is refused, not silently ignored."""
        super().check_create(body)
        custom = [key for key in ("commands", "goal") if body.get(key) is not None]
        if custom:
            raise ProtocolError(
                f"custom TextCraft tasks ({' and '.join(custom)} at /create, AgentGym's custom-task option) are "
                f"not supported: create without them and pick one of the {len(cookbook().goals)} fixed tasks "
                "with data_idx at /reset")

    @classmethod
    def parse_action(cls, text: str) -> str | None:
        action = parse_thought_action(text)
        if action is None:
            return None
        return _normalize(action) or None

    def _task_commands(self, data_idx: int) -> list[str]:
        """The goal's recipe tree plus seeded distractors, in a seeded order."""
        rng = random.Random(data_idx)
        tree = self.book.recipe_tree(self.goal_id)
        in_tree = {r.command for r in tree}
        near = {
            r.command
            for recipe in tree
            for name, _ in recipe.inputs
            for r in self.book.uses.get(name, ())
            if r.command not in in_tree
        }
        near_sorted = sorted(near)
        lines = [r.command for r in tree] + rng.sample(near_sorted, min(len(near_sorted), MAX_DISTRACTORS))
        rng.shuffle(lines)
        return lines

    def reset(self, data_idx: int) -> str:
        goals = self.book.goals
        if not 0 <= data_idx < len(goals):
            raise ValueError(f"TextCraft task id {data_idx} out of range [0, {len(goals)})")
        self.goal_id = goals[data_idx]
        self.commands_text = "\n".join(self._task_commands(data_idx))
        self.inventory = {}
        self._credit.reset()
        self._observation = f"Crafting commands:\n{self.commands_text}\n\nGoal: craft {self.goal()}."
        return self._observation

    def goal(self) -> str:
        """The goal's display name (AgentGym's `GET /goal`)."""
        return display_name(self.goal_id)

    def commands(self) -> str:
        """The task's crafting commands, one a line (AgentGym's `GET /commands`)."""
        return self.commands_text

    def step(self, action: str) -> StepResult:
        shaped = self.reward_shaping == "progress"
        left = len(self._plan()) if shaped else 0
        action = _normalize(action)
        try:
            if action == "inventory":
                observation, reward = self._show_inventory(), 0.0
            elif match := _GET.fullmatch(action):
                observation, reward = self._get(int(match.group(1)), match.group(2)), 0.0
            elif match := _CRAFT.fullmatch(action):
                observation, reward = self._craft(match.group(1), match.group(2))
            else:
                raise ActionFailed(f"Could not execute {action}")
        except ActionFailed as e:
            self._observation = str(e)
            return self.result(self._observation, 0.0, False, invalid=True)
        self._observation = observation
        solved = reward > 0
        if shaped:
            reward = self._credit.pay(solved, left - len(self._plan()))
        return self.result(observation, reward, solved, invalid=False)

    def _show_inventory(self) -> str:
        if not self.inventory:
            return "Inventory: You are not carrying anything."
        held = sorted((display_name(i), n) for i, n in self.inventory.items())
        return "Inventory: " + " ".join(f"[{name}] ({n})" for name, n in held)

    def _get(self, count: int, name: str) -> str:
        if count < 1:
            raise ActionFailed(f"Could not get {count} {name}: the quantity must be at least 1")
        if not self.book.is_fetchable(item_id(name)):
            raise ActionFailed(f"Could not find {name}")
        self._add(item_id(name), count)
        return f"Got {count} {name}"

    def _craft(self, target: str, ingredients: str) -> tuple[str, float]:
        given: dict[str, int] = {}  # item id -> count, duplicates summed
        for part in ingredients.split(","):
            match = _COUNTED.fullmatch(part.strip())
            if match is None:
                raise ActionFailed(f"Wrong item format: {part.strip()}")
            key = item_id(match.group(2))
            given[key] = given.get(key, 0) + int(match.group(1))
        output = item_id(target)
        if any(self.inventory.get(i, 0) < n for i, n in given.items()):
            raise ActionFailed(f"Could not find enough items to craft {target}")
        recipe = next((r for r in self.book.recipes.get(output, ()) if self._matches(r, given)), None)
        if recipe is None:
            raise ActionFailed(f"Could not find a valid recipe for {target}")
        for i, n in given.items():
            self._add(i, -n)
        self._add(output, recipe.count)
        solved = output == self.goal_id
        return f"Crafted {recipe.count} {target}", 1.0 if solved else 0.0

    def _matches(self, recipe: Recipe, given: dict[str, int]) -> bool:
        """Whether `given` is exactly the recipe's inputs (tags matched by any of their items)."""
        unused = dict(given)
        for wanted, count in recipe.inputs:
            hit = next((i for i in unused if self.book.accepts(wanted, i)), None)
            if hit is None or unused.pop(hit) != count:
                return False
        return not unused

    def _add(self, item: str, count: int) -> None:
        self.inventory[item] = self.inventory.get(item, 0) + count
        if self.inventory[item] == 0:
            del self.inventory[item]

    def observation(self) -> str:
        return self._observation

    def available_actions(self) -> list[str]:
        """The task's crafting commands (as shown) plus `inventory`."""
        return self.commands_text.splitlines() + ["inventory"]

    def verify(self) -> bool:
        return self.goal_id is not None and self.inventory.get(self.goal_id, 0) > 0

    def _plan(self) -> list[str]:
        """The oracle's commands from the current inventory to the goal."""
        return planner.plan(self.book, self.goal_id, self.inventory)

    def oracle_action(self) -> str:
        steps = self._plan()
        return steps[0] if steps else "inventory"
