"""Environment name -> class. Adding an environment is one folder plus one line here."""

from __future__ import annotations

import importlib

from environments.base import Environment

# name -> "module:Class"; imported lazily so a server loads only its own engine.
ENVIRONMENTS: dict[str, str] = {
    "textcraft": "environments.textcraft.env:TextCraftEnv",
    "babyai": "environments.babyai.env:BabyAIEnv",
    "maze": "environments.maze.env:MazeEnv",
    "wordle": "environments.wordle.env:WordleEnv",
    "room": "environments.room.env:RoomEnv",
    "sciworld": "environments.sciworld.env:SciWorldEnv",
    "textarena": "environments.textarena.env:TextArenaEnv",
    "textworld": "environments.textworld.env:TextWorldEnv",
    "miniwob": "environments.miniwob.env:MiniWoBEnv",
    "search": "environments.search.env:SearchEnv",
    "sql": "environments.sql.env:SQLEnv",
    "weather": "environments.tools.weather:WeatherEnv",
    "movie": "environments.tools.movie:MovieEnv",
    "academia": "environments.tools.academia:AcademiaEnv",
    "todo": "environments.tools.todo:TodoEnv",
    "sheet": "environments.tools.sheet:SheetEnv",
    "bash": "environments.bash.env:BashEnv",
    "code": "environments.code.env:CodeEnv",
}


def get_environment(name: str) -> type[Environment]:
    """The environment class registered as `name`; a clear error naming the valid ones."""
    if name not in ENVIRONMENTS:
        raise KeyError(f"unknown environment {name!r}; valid: {', '.join(sorted(ENVIRONMENTS))}")
    module, cls = ENVIRONMENTS[name].split(":")
    return getattr(importlib.import_module(module), cls)
