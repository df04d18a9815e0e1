"""Maze variants that misbehave on purpose, served by `tests/test_server.py` as `module:Class`."""

from __future__ import annotations

import time

from environments.maze.env import MazeEnv


class FaultyMazeEnv(MazeEnv):
    """The action "explode" raises inside the environment; "sleep" takes half a second."""

    @classmethod
    def parse_action(cls, text: str) -> str | None:
        return text if text in ("explode", "sleep") else super().parse_action(text)

    def step(self, action: str):
        if action == "explode":
            raise RuntimeError("engine exploded")
        if action == "sleep":
            time.sleep(0.5)
        return super().step(action)


class BlockingFaultyMazeEnv(FaultyMazeEnv):
    """The same, with its calls run in the server's thread pool."""

    blocking = True
