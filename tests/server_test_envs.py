"""Maze variants that misbehave on purpose, served by `tests/test_server.py` as `module:Class`."""

from __future__ import annotations

import os
import time

from environments.maze.env import MazeEnv


class FaultyMazeEnv(MazeEnv):
    """The action "explode" raises inside the environment; "sleep" takes a second.

    `close()` appends a line to the file named by $CLOSE_LOG, so tests can see it was called;
    `GET /maze_rows?id=` serves the layout as an extra query.
    """

    extra_queries = ("maze_rows",)

    def maze_rows(self) -> list[str]:
        return list(self.layout)

    @classmethod
    def parse_action(cls, text: str) -> str | None:
        return text if text in ("explode", "sleep") else super().parse_action(text)

    def step(self, action: str):
        if action == "explode":
            raise RuntimeError("engine exploded")
        if action == "sleep":
            time.sleep(1.0)
        return super().step(action)

    def close(self) -> None:
        if os.environ.get("CLOSE_LOG"):
            with open(os.environ["CLOSE_LOG"], "a") as log:
                log.write(f"closed at {self.position}\n")


class BlockingFaultyMazeEnv(FaultyMazeEnv):
    """The same, with its calls run in the server's thread pool."""

    blocking = True


class SlowStartMazeEnv(BlockingFaultyMazeEnv):
    """Takes a second to build (an engine starting), in the server's thread pool."""

    def __init__(self) -> None:
        time.sleep(1.0)
        super().__init__()
