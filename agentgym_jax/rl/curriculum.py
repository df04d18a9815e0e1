"""A curriculum over task difficulty: which training tasks an RL step may draw.

An environment that grades its tasks lists one number per task id in its task metadata
(TextCraft: `depth`, how many crafting levels its goal needs). Stage k admits the training tasks
graded at most `max_grades[k]`; a stage lasts `steps_per_stage` steps and the last lasts
forever. Sparse rewards give GRPO a signal only where some samples of a task succeed, so early
stages keep to the tasks the warm-started policy can already finish. Like the horizon schedule
(`rl/horizon.py`) it is a pure function of the step, so a resumed run draws the tasks the
uninterrupted run drew. It is independent of the horizon schedule: `horizon_schedule.kind=fixed`
leaves it as it is.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from agentgym_jax.rl.horizon import stage_of


@dataclasses.dataclass(frozen=True)
class Curriculum:
    """Training tasks per stage: `max_grades[k]` bounds the grade of stage k's tasks; () admits all."""

    key: str = ""  # the task-metadata list that grades tasks; "" turns the curriculum off
    max_grades: tuple[float, ...] = ()
    steps_per_stage: int = 1

    def __post_init__(self):
        if bool(self.key) != bool(self.max_grades):
            raise ValueError(f"curriculum.key and curriculum.max_grades go together, got key={self.key!r}, "
                             f"max_grades={self.max_grades!r}")
        if list(self.max_grades) != sorted(self.max_grades):
            raise ValueError(f"curriculum.max_grades must not decrease, got {self.max_grades!r}")
        if not isinstance(self.steps_per_stage, int) or self.steps_per_stage < 1:
            raise ValueError(f"curriculum.steps_per_stage must be a positive integer, got {self.steps_per_stage!r}")

    def stage(self, step: int) -> int:
        return stage_of(step, self.steps_per_stage, len(self.max_grades))

    def pool(self, train_ids: Sequence[int], metadata: Mapping[str, Any], step: int) -> list[int]:
        """The training tasks step `step` draws from (all of `train_ids` when off)."""
        if not self.key:
            return list(train_ids)
        graded, bound = grades(metadata, self.key), self.max_grades[self.stage(step)]
        return [i for i in train_ids if graded[i] <= bound]

    def check(self, train_ids: Sequence[int], metadata: Mapping[str, Any]) -> None:
        """Refuses, before any work, a key the environment does not grade by or a stage with no task."""
        for k in range(len(self.max_grades)):
            if not self.pool(train_ids, metadata, k * self.steps_per_stage):
                raise ValueError(f"curriculum stage {k} (grade <= {self.max_grades[k]}) admits no training task")


def grades(metadata: Mapping[str, Any], key: str) -> Sequence[float]:
    if key not in metadata:
        graded = [k for k, v in metadata.items() if isinstance(v, (list, tuple))]
        raise ValueError(f"curriculum.key={key!r}: the environment's task metadata has no such list; "
                         f"it has: {', '.join(graded) or 'none'}")
    return metadata[key]

