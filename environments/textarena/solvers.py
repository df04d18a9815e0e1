"""Exact solvers for the TextArena puzzles that have a simple one; pure functions on plain data.

Each returns the next move (in the game's own terms, not yet bracketed) from any reachable state,
so an oracle that follows them also recovers from someone else's earlier moves.
"""

from __future__ import annotations

import collections
import itertools
from typing import Iterator, Sequence

Cell = tuple[int, int]


def guess_the_number(low: int, high: int, history: Sequence[tuple[int, str]]) -> int:
    """Binary search: the middle of the range the "higher"/"lower" hints leave open."""
    for guess, hint in history:
        if hint == "higher":
            low = max(low, guess + 1)
        else:
            high = min(high, guess - 1)
    return (low + high) // 2


def mastermind_feedback(code: Sequence[int], guess: Sequence[int]) -> tuple[int, int]:
    """(black, white) pegs: right digit right place; right digit wrong place (multiset count)."""
    black = sum(c == g for c, g in zip(code, guess))
    common = sum((collections.Counter(code) & collections.Counter(guess)).values())
    return black, common - black


def mastermind_codes(length: int, digits: int, repeats: bool,
                     history: Sequence[tuple[Sequence[int], int, int]]) -> Iterator[tuple[int, ...]]:
    """Codes consistent with every (guess, black, white) so far, in lexicographic order."""
    codes = (itertools.product(range(1, digits + 1), repeat=length) if repeats
             else itertools.permutations(range(1, digits + 1), length))
    for code in codes:
        if all(mastermind_feedback(code, guess) == (black, white) for guess, black, white in history):
            yield code


def mastermind(length: int, digits: int, repeats: bool, history: Sequence[tuple[Sequence[int], int, int]]) -> tuple[int, ...]:
    """The consistent-candidate strategy: guess the first code that fits all feedback so far."""
    code = next(mastermind_codes(length, digits, repeats, history), None)
    if code is None:
        raise ValueError("no code is consistent with the feedback")
    return code


def frozen_lake(grid: Sequence[Sequence[str]], start: Cell, goal: Cell) -> str:
    """First move ("up"/"down"/"left"/"right") of a shortest hole-free path (BFS back from the goal)."""
    moves = {"up": (-1, 0), "down": (1, 0), "left": (0, -1), "right": (0, 1)}
    rows, cols = len(grid), len(grid[0])
    dist = {goal: 0}
    queue = collections.deque([goal])
    while queue:
        r, c = queue.popleft()
        for dr, dc in moves.values():
            n = (r - dr, c - dc)
            if 0 <= n[0] < rows and 0 <= n[1] < cols and n not in dist and grid[n[0]][n[1]] != "H":
                dist[n] = dist[(r, c)] + 1
                queue.append(n)
    options = [(dist[(start[0] + dr, start[1] + dc)], name) for name, (dr, dc) in moves.items()
               if (start[0] + dr, start[1] + dc) in dist]
    if not options:
        raise ValueError(f"no hole-free path from {start} to {goal}")
    return min(options)[1]


def hanoi(towers: dict[str, Sequence[int]], target: str = "C") -> tuple[str, str]:
    """Next (source, target) move of the shortest way to stack every disk on `target`.

    The classic recursion from an arbitrary legal state: the largest disk not yet in place must
    go to its destination, so first clear every smaller disk onto the third peg.
    """
    where = {disk: peg for peg, disks in towers.items() for disk in disks}
    goal = {disk: target for disk in where}
    for disk in sorted(where, reverse=True):
        if where[disk] != goal[disk]:
            return _hanoi_move(where, disk, goal[disk])
    raise ValueError("the disks are already stacked on the target")


def _hanoi_move(where: dict[int, str], disk: int, dest: str) -> tuple[str, str]:
    """First move that brings `disk` to `dest`: clear the smaller disks onto the spare peg."""
    source = where[disk]
    spare = ({"A", "B", "C"} - {source, dest}).pop()
    for smaller in range(disk - 1, 0, -1):
        if where[smaller] != spare:
            return _hanoi_move(where, smaller, spare)
    return source, dest


def sudoku(board: Sequence[Sequence[int]]) -> tuple[int, int, int]:
    """(row, col, digit), 1-based, of an empty cell in the board's completed solution (backtracking).

    Chooses the empty cell with the fewest candidates first, which keeps the search tiny.
    """
    grid = [list(row) for row in board]
    empty = [(r, c) for r in range(9) for c in range(9) if grid[r][c] == 0]
    if not empty:
        raise ValueError("the board is already full")
    if not _fill(grid):
        raise ValueError("the board has no solution")
    r, c = empty[0]
    return r + 1, c + 1, grid[r][c]


def sudoku_candidates(grid: Sequence[Sequence[int]], r: int, c: int) -> set[int]:
    """Digits that row `r`, column `c` and their box leave free."""
    box_r, box_c = 3 * (r // 3), 3 * (c // 3)
    used = set(grid[r]) | {grid[i][c] for i in range(9)}
    used |= {grid[i][j] for i in range(box_r, box_r + 3) for j in range(box_c, box_c + 3)}
    return set(range(1, 10)) - used


def _fill(grid: list[list[int]]) -> bool:
    empty = [(r, c) for r in range(9) for c in range(9) if grid[r][c] == 0]
    if not empty:
        return True
    r, c = min(empty, key=lambda rc: len(sudoku_candidates(grid, *rc)))
    for digit in sorted(sudoku_candidates(grid, r, c)):
        grid[r][c] = digit
        if _fill(grid):
            return True
    grid[r][c] = 0
    return False


def lights_out(grid: Sequence[Sequence[bool]]) -> Cell:
    """A press (row, col) of a fewest-press solution: try every first-row pattern, chase the rest."""
    size = len(grid)
    best: list[Cell] | None = None
    for pattern in itertools.product((False, True), repeat=size):
        lights = [list(row) for row in grid]
        presses = []
        for r in range(size):
            for c in range(size):
                if (pattern[c] if r == 0 else lights[r - 1][c]):
                    presses.append((r, c))
                    for dr, dc in ((0, 0), (1, 0), (-1, 0), (0, 1), (0, -1)):
                        if 0 <= r + dr < size and 0 <= c + dc < size:
                            lights[r + dr][c + dc] = not lights[r + dr][c + dc]
        if not any(lights[-1]) and (best is None or len(presses) < len(best)):
            best = presses
    if not best:
        raise ValueError("the grid has no solution (or is already dark)")
    return best[0]
