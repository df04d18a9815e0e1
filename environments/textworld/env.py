"""TextWorld household games: cooking and treasure hunting in generated houses (the ALFWorld role).

Each task is a game TextWorld generated offline (`games.py`), compiled to a Z-machine file and
played by Jericho through TextWorld's own wrappers, which track the game state to report the
admissible commands, the winning policy from the current state, `won`/`lost` and the score.

A command outside the admissible list is an invalid action: it is not sent to the game, gets
reward 0 and the list of valid commands. Reward: the points a command earns as a share of the
game's maximum (so an episode's rewards sum to 1 exactly when the game is won). The episode ends
when the game is won or lost, or after `MAX_STEPS` steps. Verifier: TextWorld's `won`. Oracle:
the first command of TextWorld's winning policy from the current state (the walkthrough while
followed; re-planned after any detour).

Task id -> game: `games.specs()` sorted by name; every fourth id is in the test split.
"""

from __future__ import annotations

import functools
import json
import pathlib
import re
import threading
import warnings
from typing import Any, ClassVar

import jericho
import textworld
from textworld.envs.wrappers.tw_inform7 import TWInform7
from textworld.envs.zmachine.jericho import JerichoEnv
from textworld.generator.game import EntityInfo, Game, GrammarOptions, KnowledgeBase, Quest, World
from textworld.logic import GameLogic

from agentgym_jax.envs.protocol import ProtocolError, StepResult, TaskInfo
from environments.base import Environment, parse_thought_action
from environments.textworld import games

MAX_STEPS = 50  # ALFWorld's episode length in AgentGym
TEST_EVERY = 4  # task ids divisible by this form the test split
INFOS = textworld.EnvInfos(admissible_commands=True, policy_commands=True, won=True, lost=True,
                           score=True, max_score=True, objective=True, extras=["walkthrough"])

_BANNER_LINE = re.compile(r"^[\s_|$\\/<>]*$")  # the ASCII-art "TEXTWORLD" title of every game
_STATUS_PROMPT = re.compile(r"\n>[^\n]*$")  # the prompt and status line after a game's last words
_RESTART_PROMPT = "Would you like to RESTART, RESTORE a saved game, QUIT or UNDO the last command?"

INSTRUCTION = (
    "You are in a house in a text adventure game. The first message tells you your goal: a meal "
    "to cook from a recipe, or an object to find and put somewhere. Each turn, answer with one "
    "command; I reply with what happened. Commands are short imperative sentences such as "
    '"go north", "open fridge", "take red apple from counter", "examine cookbook", '
    '"cook carrot with stove", "slice carrot with knife", "prepare meal", "eat meal" or '
    '"inventory". Only commands that make sense in the current situation are accepted; after '
    "an unaccepted command I list the accepted ones. Some mistakes lose the game, such as "
    "burning food or taking the wrong object.\n"
    "Reply in exactly this format:\n"
    "Thought:\nyour reasoning\n\nAction:\nyour command"
)


@functools.lru_cache(maxsize=None)
def _knowledge_base(logic: str, text_grammars_path: str) -> KnowledgeBase:
    """TextWorld's rules for a theme; parsing them takes seconds, so once per process per theme."""
    return KnowledgeBase(GameLogic.deserialize(logic), text_grammars_path)


# Jericho knows TextWorld's games only as "not fully supported": TextWorld's wrappers track the
# score and state themselves, so the warning it gives on every load says nothing here.
warnings.filterwarnings("ignore", category=jericho.UnsupportedGameWarning)

_load_lock = threading.Lock()


@functools.lru_cache(maxsize=None)
def _load_game(json_path: pathlib.Path) -> Game:
    """`textworld.Game.load` with the theme's knowledge base parsed once, not once per game."""
    with open(json_path) as f:
        data = json.load(f)
    with _load_lock:
        kb = _knowledge_base(data["KB"]["logic"], data["KB"]["text_grammars_path"])
    game = Game(World.deserialize(data["world"], kb=kb))
    game.grammar_options = GrammarOptions(data["grammar"])
    game.quests = tuple(Quest.deserialize(q) for q in data["quests"])
    game._infos = {k: EntityInfo.deserialize(v) for k, v in data["infos"]}
    game.metadata = data.get("metadata", {})
    game._objective = data.get("objective")
    return game


def _clean(text: str) -> str:
    """Game text without the title art, the end-of-game menu and the trailing prompt/status line."""
    lines = text.splitlines()
    while lines and _BANNER_LINE.match(lines[0]):
        lines.pop(0)
    return _STATUS_PROMPT.sub("", "\n".join(lines)).replace(_RESTART_PROMPT, "").strip()


class TextWorldEnv(Environment):
    """One TextWorld game episode (a Jericho interpreter plus TextWorld's state tracking)."""

    name: ClassVar[str] = "textworld"
    instruction: ClassVar[str] = INSTRUCTION
    blocking: ClassVar[bool] = True  # loading a game and tracking its state take tens of ms
    extra_queries: ClassVar[tuple[str, ...]] = ("walkthrough",)

    def __init__(self) -> None:
        self._env: Any = None
        self._state: Any = None  # TextWorld's GameState after the last command
        self.steps = 0
        self._observation = ""

    @classmethod
    def task_info(cls) -> TaskInfo:
        """Makes the game set if it is not cached yet (minutes, once per machine)."""
        games.ensure_games()
        specs = games.specs()
        ids = range(len(specs))
        return TaskInfo(
            env=cls.name,
            instruction=cls.instruction,
            success_threshold=cls.success_threshold,
            splits={"train": [i for i in ids if i % TEST_EVERY], "test": [i for i in ids if not i % TEST_EVERY]},
            num_tasks=len(specs),
            has_oracle=cls.has_oracle,
            metadata={
                "game": [s.name for s in specs],
                "theme": [s.theme for s in specs],
                "level": [s.level for s in specs],
                "max_steps": MAX_STEPS,
                "textworld_version": textworld.__version__,
            },
        )

    @classmethod
    def parse_action(cls, text: str) -> str | None:
        """`Action: Take the red apple.` -> "take the red apple": lower case, no quotes or end stop."""
        action = parse_thought_action(text)
        if action is None:
            return None
        return " ".join(action.lower().strip(" .!\"'`*").split()) or None

    def reset(self, data_idx: int) -> str:
        specs = games.specs()
        if not 0 <= data_idx < len(specs):
            raise ValueError(f"TextWorld task id {data_idx} out of range [0, {len(specs)})")
        self.close()
        path = games.game_file(specs[data_idx])
        interpreter = JerichoEnv(INFOS)
        interpreter._game = _load_game(path.with_suffix(".json"))  # TextWorld's wrappers reuse it
        self._env = TWInform7(interpreter)
        self._env.load(str(path))
        self._state = self._env.reset()
        self.steps = 0
        self._observation = _clean(self._state.feedback)
        return self._observation

    def step(self, action: str) -> StepResult:
        self.steps += 1
        out_of_steps = self.steps >= MAX_STEPS
        if action not in self._state["admissible_commands"]:
            self._observation = (f"Nothing happens: {action[:80]!r} is not a valid command here. "
                                 f"Valid commands: {', '.join(self.available_actions())}.")
            return self.result(self._observation, 0.0, out_of_steps, invalid=True, steps=self.steps)
        before = self._state["score"]
        self._state, _, _ = self._env.step(action)
        self._observation = _clean(self._state.feedback)
        reward = (self._state["score"] - before) / max(self._state["max_score"], 1)
        done = self._state["won"] or self._state["lost"] or out_of_steps
        return self.result(self._observation, reward, done, invalid=False, steps=self.steps,
                           won=self._state["won"], lost=self._state["lost"],
                           points=self._state["score"], max_points=self._state["max_score"])

    def observation(self) -> str:
        return self._observation

    def available_actions(self) -> list[str]:
        """TextWorld's admissible commands in the current state, sorted."""
        return sorted(self._state["admissible_commands"])

    def verify(self) -> bool:
        return self._state is not None and bool(self._state["won"])

    def score(self) -> float:
        """Points so far as a share of the game's maximum (1.0 when won)."""
        if self._state is None:
            return 0.0
        return self._state["score"] / max(self._state["max_score"], 1)

    def oracle_action(self) -> str:
        policy = self._state["policy_commands"]
        if not policy:
            raise ProtocolError("TextWorld has no winning policy from this state (the game is lost)", 409)
        return policy[0]

    def walkthrough(self) -> list[str]:
        """The game's walkthrough from its start, as the generator recorded it (`GET /walkthrough`)."""
        return [] if self._state is None else list(self._state["extra.walkthrough"])

    def close(self) -> None:
        if self._env is not None:
            self._env.close()
            self._env = None
