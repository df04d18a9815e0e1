"""Generates the TextWorld task set: `python -m environments.textworld.make_games [--out=DIR]`.

Makes every game of `games.specs()` that is not cached yet (the environment calls the same code
on first use). `--out` defaults to `$AGENTGYM_TEXTWORLD_CACHE` or `~/.cache/agentgym_jax/textworld`.
"""

from __future__ import annotations

import argparse
import pathlib

from environments.textworld import games


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m environments.textworld.make_games", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=None, help=f"cache folder (default: {games.cache_dir()})")
    parser.add_argument("--workers", type=int, default=None, help="generator processes (default: one per CPU)")
    args = parser.parse_args(argv)
    folder = games.ensure_games(args.out, workers=args.workers, log=lambda line: print(line, flush=True))
    print(f"{len(games.specs())} games in {folder}")


if __name__ == "__main__":
    main()
