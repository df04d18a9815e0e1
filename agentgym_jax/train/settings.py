"""The training config read into typed settings, each section in one place.

`rl/` holds the pure pieces (schedules, curricula, estimators, losses) and knows nothing of
configs; this module reads `config.horizon` and `config.curriculum` into them and turns a bad
value into a one-line `ConfigError` (architecture rule 6).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any


from agentgym_jax.config import ConfigError
from agentgym_jax.rl.curriculum import Curriculum
from agentgym_jax.rl.horizon import HORIZON_SCHEDULES, HorizonSchedule


def horizon_schedule(section: Mapping[str, Any]) -> HorizonSchedule:
    """`config.horizon`: `{"schedule": "fixed", "rounds": 10}` or `{"schedule": "stepwise",
    "rounds": [10, 20, 30], "steps_per_stage": 100}` (a dict or a ConfigDict)."""
    params = dict(section.items())
    name = params.pop("schedule", None)
    if name not in HORIZON_SCHEDULES:
        raise ConfigError(f"unknown horizon schedule {name!r}; valid: {', '.join(HORIZON_SCHEDULES)}")
    builder = HORIZON_SCHEDULES[name]
    valid = inspect.signature(builder).parameters
    if unknown := sorted(set(params) - set(valid)):
        raise ConfigError(f"horizon schedule {name!r} takes no {unknown}; valid: {sorted(valid)}")
    if "rounds" not in params:
        raise ConfigError(f"horizon schedule {name!r} needs 'rounds'")
    try:
        return builder(**params)
    except ValueError as e:
        raise ConfigError(f"horizon: {e}") from e


def curriculum(section: Mapping[str, Any]) -> Curriculum:
    """`config.curriculum` (`key`, `max_grades`, `steps_per_stage`)."""
    params = dict(section.items())
    params["max_grades"] = tuple(params.get("max_grades") or ())
    try:
        return Curriculum(**params)
    except ValueError as e:
        raise ConfigError(str(e)) from e


def check_curriculum(plan: Curriculum, train_ids: Sequence[int], metadata: Mapping[str, Any]) -> None:
    """Refuses, when the job opens, a key the environment does not grade by or a stage with no task."""
    try:
        plan.check(train_ids, metadata)
    except ValueError as e:
        raise ConfigError(str(e)) from e
