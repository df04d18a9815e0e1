"""The TextArena single-player games served, their task ids, legal moves and oracles.

Only games that run offline (no NLTK corpora, no LLM opponent) and have clear win conditions.
Task id -> (game, seed): game `GAMES[task_id // TASKS_PER_GAME]`, reset with seed
`task_id % TASKS_PER_GAME`. Each game reads and writes its own state through the TextArena env
object (`env.state.game_state` and the env's attributes), as TextArena's own renderers do.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from typing import Any, Callable

from environments.textarena import solvers

TASKS_PER_GAME = 100


@dataclasses.dataclass(frozen=True)
class Game:
    """One TextArena game as served: its registry id, its moves, and its oracle (if any)."""

    name: str
    registry_id: str  # TextArena's `ENV_REGISTRY` key (its settings: board size, turn limit, ...)
    moves: Callable[[Any], list[str]]  # TextArena env -> legal moves now, bracketed
    token: str  # regex of the words a move is made of (numbers, directions, tower letters)
    oracle: Callable[[Any], str] | None = None  # TextArena env -> the solver's next move, bracketed

    def canonical(self, move: str) -> str:
        """`[guess 50]` -> `[50]`, `[move A to C]` -> `[A C]`: a bracketed move's own words only.

        A move with none of the game's words is left as it is, for the game to reject.
        """
        inner = move[1:-1] if move.startswith("[") and move.endswith("]") else move
        words = re.findall(self.token, inner, flags=re.IGNORECASE)
        return "[" + " ".join(words) + "]" if words else move


def _guess_the_number_moves(env) -> list[str]:
    guessed = {g for g, _ in env.state.game_state["guess_history"]}
    return [f"[{n}]" for n in range(env.min_number, env.max_number + 1) if n not in guessed]


def _guess_the_number_oracle(env) -> str:
    return f"[{solvers.guess_the_number(env.min_number, env.max_number, env.state.game_state['guess_history'])}]"


def _mastermind_history(env) -> list[tuple[list[int], int, int]]:
    return [(h["guess"], h["black"], h["white"]) for h in env.state.game_state["history"]]


def _mastermind_moves(env) -> list[str]:
    """The first 20 codes consistent with the feedback (a representative subset)."""
    s = env.state.game_state
    codes = solvers.mastermind_codes(s["code_length"], s["num_numbers"], s["duplicate_numbers"], _mastermind_history(env))
    return ["[" + " ".join(map(str, c)) + "]" for c in itertools.islice(codes, 20)]


def _mastermind_oracle(env) -> str:
    s = env.state.game_state
    code = solvers.mastermind(s["code_length"], s["num_numbers"], s["duplicate_numbers"], _mastermind_history(env))
    return "[" + " ".join(map(str, code)) + "]"


def _directions(env) -> list[str]:
    return ["[up]", "[down]", "[left]", "[right]"]


def _frozen_lake_oracle(env) -> str:
    s = env.state.game_state
    return f"[{solvers.frozen_lake(s['grid'], tuple(s['player_pos']), tuple(s['goal_pos']))}]"


def _hanoi_moves(env) -> list[str]:
    towers = env.state.game_state["towers"]
    return [f"[{a} {b}]" for a in "ABC" for b in "ABC"
            if a != b and towers[a] and (not towers[b] or towers[b][-1] > towers[a][-1])]


def _hanoi_oracle(env) -> str:
    source, target = solvers.hanoi(env.state.game_state["towers"])
    return f"[{source} {target}]"


def _sudoku_moves(env) -> list[str]:
    board = env.state.game_state["board"]
    return [f"[{r + 1} {c + 1} {d}]" for r in range(9) for c in range(9) if board[r][c] == 0
            for d in sorted(solvers.sudoku_candidates(board, r, c))]


def _sudoku_oracle(env) -> str:
    return "[{} {} {}]".format(*solvers.sudoku(env.state.game_state["board"]))


def _lights_out_moves(env) -> list[str]:
    return [f"[{r} {c}]" for r in range(env.size) for c in range(env.size)]


def _lights_out_oracle(env) -> str:
    return "[{} {}]".format(*solvers.lights_out(env.state.game_state["grid"]))


def _minesweeper_moves(env) -> list[str]:
    return [f"[{r} {c}]" for r in range(env.rows) for c in range(env.cols) if not env.revealed[r][c]]


_NUMBER = r"\d+"
_DIRECTION = r"\b(?:up|down|left|right)\b"
_TOWER = r"\b[ABC]\b"

GAMES: tuple[Game, ...] = (
    Game("GuessTheNumber", "GuessTheNumber-v0", _guess_the_number_moves, _NUMBER, _guess_the_number_oracle),
    Game("Mastermind", "Mastermind-v0", _mastermind_moves, _NUMBER, _mastermind_oracle),
    Game("FrozenLake", "FrozenLake-v0", _directions, _DIRECTION, _frozen_lake_oracle),
    Game("TowerOfHanoi", "TowerOfHanoi-v0", _hanoi_moves, _TOWER, _hanoi_oracle),
    Game("Sudoku", "Sudoku-v0-easy", _sudoku_moves, _NUMBER, _sudoku_oracle),
    Game("LightsOut", "LightsOut-v0", _lights_out_moves, _NUMBER, _lights_out_oracle),
    Game("Minesweeper", "Minesweeper-v0-small", _minesweeper_moves, _NUMBER),  # no guess-free solver
    Game("2048", "2048-v0-ultra-easy", _directions, _DIRECTION),  # random tile spawns: no exact solver
)
NUM_TASKS = len(GAMES) * TASKS_PER_GAME


def task(task_id: int) -> tuple[Game, int]:
    """Task id -> (game, seed)."""
    if not 0 <= task_id < NUM_TASKS:
        raise ValueError(f"TextArena task id {task_id} out of range [0, {NUM_TASKS})")
    return GAMES[task_id // TASKS_PER_GAME], task_id % TASKS_PER_GAME
