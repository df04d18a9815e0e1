"""Config helpers: load a `configs/*.py` file and refuse overrides of keys that do not exist.

ml_collections reports a mistyped `--config.lr=...` as a bare `AttributeError: 'lr'` deep in a
traceback; researchers deserve the bad key and the valid ones.
"""

from __future__ import annotations

import difflib
import importlib.util
from collections.abc import Sequence

import ml_collections


class ConfigError(ValueError):
    """A config that cannot be run: unknown keys, bad values, missing required fields."""


# Keys that have a new name (one name per concept: the turn limit is a `horizon` everywhere).
RENAMED = {
    "horizon.schedule": "horizon_schedule.kind",
    "horizon.rounds": "horizon_schedule.horizons",
    "horizon.steps_per_stage": "horizon_schedule.steps_per_stage",
    "sft.max_turns": "sft.horizon",
}


def check_renamed(keys: Sequence[str]) -> None:
    """Refuses, in one line naming the new key, a key that was renamed (an override or a config file's)."""
    for key in keys:
        if key in RENAMED:
            raise ConfigError(f"config key {key!r} is now {RENAMED[key]!r}")


def flat_keys(config: ml_collections.ConfigDict, prefix: str = "") -> list[str]:
    """All dotted leaf keys of a (nested) config, sorted."""
    keys = []
    for key, value in config.items():
        path = f"{prefix}{key}"
        if isinstance(value, ml_collections.ConfigDict):
            keys.extend(flat_keys(value, path + "."))
        else:
            keys.append(path)
    return sorted(keys)


def override_keys(argv: Sequence[str], flag: str = "config") -> list[str]:
    """The dotted keys of `--config.a.b=v` / `--config.a.b v` arguments."""
    marker = f"--{flag}."
    return [arg[len(marker):].split("=", 1)[0] for arg in argv if arg.startswith(marker)]


def check_override_keys(config: ml_collections.ConfigDict, keys: Sequence[str]) -> None:
    """Raises `ConfigError` naming every override key the config does not have (or a renamed one's new name)."""
    check_renamed(keys)
    valid = flat_keys(config)
    prefixes = {k.rsplit(".", i)[0] for k in valid for i in range(k.count(".") + 1)}
    unknown = [k for k in keys if k not in prefixes]
    if unknown:
        hints = [
            f"{k!r} (did you mean {', '.join(repr(m) for m in close)}?)" if close else repr(k)
            for k in unknown
            for close in [difflib.get_close_matches(k, valid, n=2)]
        ]
        raise ConfigError(
            f"unknown config key(s): {', '.join(hints)}. Valid keys: {', '.join(valid)}"
        )


def load_config_file(spec: str) -> ml_collections.ConfigDict:
    """`path/to/config.py[:arg]` -> `get_config(arg)` (or `get_config()` without an arg)."""
    path, _, arg = spec.partition(":")
    module_spec = importlib.util.spec_from_file_location("_agentgym_config", path)
    if module_spec is None or module_spec.loader is None:
        raise ConfigError(f"cannot load config file {path!r}")
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except FileNotFoundError as e:
        raise ConfigError(f"config file not found: {path!r}") from e
    return module.get_config(arg) if arg else module.get_config()
