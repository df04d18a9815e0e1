"""TextArena single-player games behind one adapter (GuessTheNumber, Mastermind, Sudoku, ...).

The game engines are TextArena's own (`textarena.envs.*`), built from its registry settings
without its LLM-facing wrappers. The model answers `Thought: ... Action: <move>`; the parser
keeps the first bracketed move (`[4 1 2 3]`) or brackets a bare one (`up` -> `[up]`), which is
the format every TextArena game reads, and `step` keeps only the game's own words in it
(`[guess 50]` -> `[50]`, `[move A to C]` -> `[A C]`). The game judges the move: one it rejects is an invalid
action (reward 0, no turn used). TextArena's own rule stays: a second rejected move in a row
ends the game as a loss (Minesweeper counts stepping on a mine as a rejected move).

Reward 1 on the move that wins (TextArena's outcome reward 1), else 0; `info["textarena_reward"]`
keeps TextArena's own end reward (its partial-completion score). Episodes end when the game
does (win, loss, its turn limit) or after `MAX_STEPS` steps of any kind.

Task id -> (game, seed) in `games.task`; `/tasks` lists each id's game in `metadata["game"]`,
which games have an oracle in `metadata["has_oracle"]`, and `metadata["oracle_task_ids"]`.
TextArena draws from Python's global `random`; each episode keeps its own generator state and
swaps it in around every engine call, so concurrent sessions never disturb each other's draws
(the server runs this environment inline on its event loop, one call at a time).
"""

from __future__ import annotations

import contextlib
import importlib
import random
import re
from typing import Any, ClassVar, Iterator

import textarena as ta
from textarena.envs.registration import ENV_REGISTRY

from agentgym_jax.envs.protocol import ProtocolError, StepResult, TaskInfo
from environments.base import Environment, parse_thought_action
from environments.textarena import games

MAX_STEPS = 200  # above every served game's own turn limit (Sudoku's 100), counting invalid moves
TEST_EVERY = 5  # seeds divisible by this form the test split of each game

_BRACKETED = re.compile(r"\[[^\[\]]*\]")
# No game's move has a number this long; TextArena's own int() raises on one past 4300 digits.
_LONG_NUMBER = re.compile(r"\d{10}")

INSTRUCTION = (
    "You are playing a single-player puzzle game from TextArena (for example Guess The Number, "
    "Mastermind, Frozen Lake, Tower of Hanoi, Sudoku, Lights Out, Minesweeper or 2048). The first "
    "message explains the game, its rules and its move format; after each move I reply with what "
    "happened. Write every move in square brackets exactly as the game asks, e.g. [50], "
    "[1 2 3 4], [up], [A C] or [3 4 7]. A move the rules forbid is refused and does not count "
    "as a turn.\n"
    "Reply in exactly this format:\n"
    "Thought:\nyour reasoning\n\nAction:\nyour move, e.g. [up]"
)


def _engine(game: games.Game) -> Any:
    """A fresh TextArena env for `game`, with its registry settings and no wrappers."""
    spec = ENV_REGISTRY[game.registry_id]
    module, cls = spec.entry_point.split(":")
    return getattr(importlib.import_module(module), cls)(**spec.kwargs)


class TextArenaEnv(Environment):
    """One episode of one TextArena single-player game."""

    name: ClassVar[str] = "textarena"
    instruction: ClassVar[str] = INSTRUCTION
    has_oracle: ClassVar[bool] = any(g.oracle for g in games.GAMES)

    def __init__(self) -> None:
        self.game: games.Game | None = None
        self.engine: Any = None
        self.steps = 0
        self._rng_state: Any = None
        self._observation = ""

    @classmethod
    def task_info(cls) -> TaskInfo:
        ids = range(games.NUM_TASKS)
        per_id = [games.task(i)[0] for i in ids]
        return TaskInfo(
            env=cls.name,
            instruction=cls.instruction,
            success_threshold=cls.success_threshold,
            splits={
                "train": [i for i in ids if i % games.TASKS_PER_GAME % TEST_EVERY != 0],
                "test": [i for i in ids if i % games.TASKS_PER_GAME % TEST_EVERY == 0],
            },
            num_tasks=games.NUM_TASKS,
            has_oracle=cls.has_oracle,
            metadata={
                "games": [g.name for g in games.GAMES],
                "tasks_per_game": games.TASKS_PER_GAME,
                "task_id_to_game_and_seed": "game = games[id // tasks_per_game], seed = id % tasks_per_game",
                "textarena_ids": {g.name: g.registry_id for g in games.GAMES},
                "has_oracle": {g.name: g.oracle is not None for g in games.GAMES},
                "game": [g.name for g in per_id],
                "oracle_task_ids": [i for i, g in zip(ids, per_id) if g.oracle is not None],
                "max_steps": MAX_STEPS,
            },
        )

    @classmethod
    def parse_action(cls, text: str) -> str | None:
        """`Action: [4 1 2 3]` -> "[4 1 2 3]"; `Action: up` -> "[up]" (first bracketed move wins)."""
        action = parse_thought_action(text)
        if action is None:
            return None
        bracketed = _BRACKETED.search(action)
        if bracketed:
            return bracketed.group(0)
        bare = " ".join(action.strip(" .!\"'`*").split())
        return f"[{bare}]" if bare else None

    @contextlib.contextmanager
    def _own_random(self) -> Iterator[None]:
        """Runs engine code with this episode's `random` state (TextArena uses the global one)."""
        outside = random.getstate()
        random.setstate(self._rng_state)
        try:
            yield
        finally:
            self._rng_state = random.getstate()
            random.setstate(outside)

    def reset(self, data_idx: int) -> str:
        self.game, seed = games.task(data_idx)
        self.engine = _engine(self.game)
        self.steps = 0
        self._rng_state = random.Random(seed).getstate()
        with self._own_random():
            self.engine.reset(num_players=1, seed=seed)
        self._observation = self._new_messages()
        return self._observation

    def _new_messages(self) -> str:
        """The game's messages since the last call, without the echo of the player's own move."""
        _, messages = self.engine.get_observation()
        return "\n\n".join(text.strip() for _, text, kind in messages
                           if kind != ta.ObservationType.PLAYER_ACTION and text.strip())

    def step(self, action: str) -> StepResult:
        if _LONG_NUMBER.search(action):
            self._observation = "Invalid move: it has a number of 10 or more digits, and no game here takes one."
            return self.result(self._observation, 0.0, False, invalid=True, game=self.game.name,
                               textarena_reward=self._textarena_reward())
        state = self.engine.state
        turn = state.turn
        with self._own_random():
            self.engine.step(self.game.canonical(action))
        self.steps += 1
        # TextArena counts a turn only for a move it accepted, or flags the rejection that lost.
        invalid = state.turn == turn or bool(state.done and state.game_info[0].get("invalid_move"))
        observation = self._new_messages()
        if state.done:
            observation += f"\n\nGame over: {state.game_info[0].get('reason', '')}".rstrip()
        elif self.steps >= MAX_STEPS:
            observation += f"\n\nYou have used all {MAX_STEPS} steps."
        self._observation = observation or "Nothing happened."
        solved = self.verify()
        return self.result(self._observation, 1.0 if solved else 0.0, state.done or self.steps >= MAX_STEPS,
                           invalid=invalid, game=self.game.name, textarena_reward=self._textarena_reward())

    def _textarena_reward(self) -> float | None:
        rewards = self.engine.state.rewards
        return None if rewards is None else float(rewards[0])

    def observation(self) -> str:
        return self._observation

    def available_actions(self) -> list[str]:
        return self.game.moves(self.engine)

    def verify(self) -> bool:
        """Won: the game is over with TextArena's win reward (1)."""
        if self.engine is None or not self.engine.state.done:
            return False
        reward = self._textarena_reward()
        return reward is not None and reward >= 1.0

    def oracle_action(self) -> str:
        if self.game.oracle is None:
            raise ProtocolError(f"TextArena game {self.game.name} has no oracle "
                                "(see /tasks metadata has_oracle and oracle_task_ids)", 501)
        return self.game.oracle(self.engine)
