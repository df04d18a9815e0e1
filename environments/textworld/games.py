"""The fixed TextWorld task set: which games exist, where they are cached, and how they are made.

A task is one game generated offline by TextWorld's own challenge generators (what `tw-make`
runs) from a seed: the cooking theme (find ingredients, prepare the recipe, eat the meal) at
three difficulty levels and the treasure-hunter theme (fetch an object through rooms, doors and
containers) at levels 1-20. Task id -> game: the `GameSpec`s sorted by name. Generation is
deterministic given the spec (TextWorld seeds every random choice); a spec whose seed cannot
produce its quest retries seeds `seed + k * RETRY_STRIDE` in order, so the outcome is fixed too.

Games are compiled to Z-machine files (`<name>.z8` plus TextWorld's `<name>.json`) under
`cache_dir()`, in a folder named by `SET_VERSION`, once per machine: `ensure_games()` makes the
missing ones (in worker processes, under a file lock) and is a no-op once all exist.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import fcntl
import functools
import multiprocessing
import os
import pathlib
import shutil
import tempfile
import time
from typing import Callable

SET_VERSION = "v1"  # bump when the spec list or its generation changes
CACHE_ENV_VAR = "AGENTGYM_TEXTWORLD_CACHE"
RETRY_STRIDE = 1_000
MAX_ATTEMPTS = 5

# Cooking difficulty -> TextWorld's tw-cooking settings (the First TextWorld Problems skills).
COOKING_LEVELS: dict[str, dict[str, object]] = {
    "easy": dict(recipe=1, take=1, go=1, open=False, cook=False, cut=False),
    "medium": dict(recipe=2, take=1, go=6, open=True, cook=False, cut=False),
    "hard": dict(recipe=3, take=2, go=6, open=True, cook=True, cut=True),
}
COOKING_SEEDS = tuple(range(1, 7))
TREASURE_LEVELS = tuple(range(1, 21))  # 1-10: 5 open rooms; 11-20: 10 rooms, closed doors/containers
TREASURE_SEEDS = (1, 2)


@dataclasses.dataclass(frozen=True)
class GameSpec:
    """One game to generate: a TextWorld challenge, its difficulty, a seed."""

    theme: str  # "cooking" or "treasure_hunter"
    level: str  # cooking: easy/medium/hard; treasure hunter: "01".."20"
    seed: int

    @property
    def name(self) -> str:
        return f"{self.theme}-{self.level}-s{self.seed:03d}"

    @property
    def challenge(self) -> str:
        return f"tw-{self.theme}"

    def settings(self, seed: int) -> dict[str, object]:
        """The challenge's settings (what `tw-make <challenge>` flags set) for one attempt's seed."""
        if self.theme == "cooking":
            return dict(COOKING_LEVELS[self.level], drop=False, recipe_seed=seed, split=None)
        return {"level": int(self.level)}


@functools.lru_cache(maxsize=None)
def specs() -> tuple[GameSpec, ...]:
    """Task id -> spec: every game of the set, sorted by name (process-independent)."""
    cooking = [GameSpec("cooking", level, seed) for level in COOKING_LEVELS for seed in COOKING_SEEDS]
    treasure = [GameSpec("treasure_hunter", f"{level:02d}", seed) for level in TREASURE_LEVELS for seed in TREASURE_SEEDS]
    return tuple(sorted(cooking + treasure, key=lambda s: s.name))


def cache_dir() -> pathlib.Path:
    """`$AGENTGYM_TEXTWORLD_CACHE`, else `~/.cache/agentgym_jax/textworld`."""
    root = os.environ.get(CACHE_ENV_VAR) or pathlib.Path.home() / ".cache" / "agentgym_jax" / "textworld"
    return pathlib.Path(root).expanduser()


def game_dir(root: pathlib.Path | None = None) -> pathlib.Path:
    return (root or cache_dir()) / SET_VERSION


def game_file(spec: GameSpec, root: pathlib.Path | None = None) -> pathlib.Path:
    """The compiled game (`.z8`); TextWorld's `.json` game data sits next to it."""
    return game_dir(root) / f"{spec.name}.z8"


def is_made(spec: GameSpec, root: pathlib.Path | None = None) -> bool:
    path = game_file(spec, root)
    return path.is_file() and path.with_suffix(".json").is_file()


def make_game(spec: GameSpec, out_dir: pathlib.Path) -> int:
    """Generates and compiles one game into `out_dir`; returns the seed that worked.

    Files are built in a private temporary folder and moved in (json first, z8 last), so a game
    is either whole or absent even if the process is killed.
    """
    import textworld
    from textworld.challenges import CHALLENGES
    from textworld.generator.chaining import QuestGenerationError
    from textworld.generator.game import GameOptions

    make = CHALLENGES[spec.challenge][1]
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir, prefix=".build-") as tmp:
        for attempt in range(MAX_ATTEMPTS):
            seed = spec.seed + attempt * RETRY_STRIDE
            options = GameOptions()
            options.seeds = seed
            options.path = os.path.join(tmp, spec.name + ".z8")
            options.force_recompile = True
            try:
                game = make(spec.settings(seed), options)
            except QuestGenerationError:
                continue
            built = pathlib.Path(textworld.generator.compile_game(game, options))
            os.replace(built.with_suffix(".json"), out_dir / f"{spec.name}.json")
            os.replace(built, out_dir / f"{spec.name}.z8")
            return seed
    raise RuntimeError(f"TextWorld could not generate {spec.name} with {MAX_ATTEMPTS} seeds")


def ensure_games(root: pathlib.Path | None = None, workers: int | None = None,
                 log: Callable[[str], None] | None = None) -> pathlib.Path:
    """Makes every missing game of the set under `root` (default `cache_dir()`); the game folder.

    Holds an exclusive lock on `<root>/<SET_VERSION>.lock` while generating, so concurrent
    servers and tests make each game once. Workers are spawned processes (safe after threads or
    JAX are started in the caller).
    """
    out_dir = game_dir(root)
    if all(is_made(s, root) for s in specs()):
        return out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir.parent / f"{SET_VERSION}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        missing = [s for s in specs() if not is_made(s, root)]
        if missing:
            _make_all(missing, out_dir, workers or min(len(missing), os.cpu_count() or 1), log or (lambda _: None))
    return out_dir


def _make_all(missing: list[GameSpec], out_dir: pathlib.Path, workers: int, log: Callable[[str], None]) -> None:
    start = time.monotonic()
    log(f"generating {len(missing)} TextWorld games into {out_dir} with {workers} workers")
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context) as pool:
        futures = {pool.submit(make_game, spec, out_dir): spec for spec in missing}
        for future in concurrent.futures.as_completed(futures):
            seed = future.result()
            log(f"  {futures[future].name} (seed {seed}) at {time.monotonic() - start:.0f} s")
    for leftover in out_dir.glob(".build-*"):  # from killed runs
        shutil.rmtree(leftover, ignore_errors=True)
    log(f"made {len(missing)} games in {time.monotonic() - start:.0f} s")
