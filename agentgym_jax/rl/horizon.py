"""Interaction-horizon schedules: the most turns an episode may take at a given training step.

ScalingInter-RL (AgentGym-RL) starts with a short horizon and raises it in stages, e.g. 10 -> 20
-> 30 turns every 100 steps. Here a schedule is a pure function of the training step, so a resumed
run gets exactly the horizon the uninterrupted run had (AgentGym-RL's stateful scheduler is one
stage ahead after a resume).

Step convention: `step` counts the updates already done (0 for the first training step, which is
the value a checkpoint written after n updates restores). Stage k covers steps
`[k * steps_per_stage, (k + 1) * steps_per_stage)`; the last stage lasts forever. With
`stepwise((10, 20, 30), 100)`: steps 0..99 -> 10 turns, 100..199 -> 20, 200.. -> 30.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Sequence


def stage_of(step: int, steps_per_stage: int, num_stages: int) -> int:
    """The stage of training step `step` (>= 0): a new one every `steps_per_stage` steps, the last forever."""
    step = operator.index(step)
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return min(step // steps_per_stage, max(num_stages - 1, 0))


@dataclasses.dataclass(frozen=True)
class HorizonSchedule:
    """The horizon (turns allowed) of each stage; a new stage every `steps_per_stage` training steps."""

    horizons: tuple[int, ...]
    steps_per_stage: int

    def __post_init__(self):
        if not self.horizons or any(not isinstance(h, int) or h < 1 for h in self.horizons):
            raise ValueError(f"horizons must be positive integers, got {self.horizons!r}")
        if not isinstance(self.steps_per_stage, int) or self.steps_per_stage < 1:
            raise ValueError(
                f"steps_per_stage must be a positive integer, got {self.steps_per_stage!r}"
            )

    def stage(self, step: int) -> int:
        """Index into `horizons` for training step `step` (>= 0)."""
        return stage_of(step, self.steps_per_stage, len(self.horizons))

    def horizon(self, step: int) -> int:
        """Maximum number of turns per episode at training step `step` (>= 0)."""
        return self.horizons[self.stage(step)]


def fixed(horizons: int | Sequence[int], steps_per_stage: int | None = None) -> HorizonSchedule:
    """The same horizon at every step: `horizons`, or the last of a stepwise schedule's `horizons`.

    So `--config.horizon_schedule.kind=fixed` on a stepwise config trains at its final horizon
    throughout, ScalingInter-RL's baseline, with nothing else changed (`steps_per_stage` is
    accepted for the same reason; one stage has no length).
    """
    del steps_per_stage
    if isinstance(horizons, (list, tuple)):
        horizons = tuple(horizons)
        if not horizons:
            raise ValueError("horizons must be positive integers, got ()")
        horizons = horizons[-1]
    return HorizonSchedule(horizons=(horizons,), steps_per_stage=1)


def stepwise(horizons: Sequence[int] = (10, 20, 30), steps_per_stage: int = 100) -> HorizonSchedule:
    """ScalingInter-RL: `horizons[k]` turns in stage k; a stage lasts `steps_per_stage` steps."""
    return HorizonSchedule(horizons=tuple(horizons), steps_per_stage=steps_per_stage)


# kind -> builder; `train/settings.py` reads `config.horizon_schedule` into one of these.
HORIZON_SCHEDULES = {"fixed": fixed, "stepwise": stepwise}

