"""ScienceWorld task ids: AgentGym's flattened (task, variation) list and the simulator's splits.

AgentGym's server walks the simulator's tasks in their catalogue order (`1-1`, `1-2`, ...),
skips seven of them (`EXCLUDED`: the grow-plant, inclined-plane and Mendelian-genetics tasks)
and lists every variation of each remaining task; `data_idx` indexes that list (4639 entries).
Each task's variations are cut by the simulator into contiguous train / dev / test ranges;
`VARIATIONS` records those counts for scienceworld 1.2.3 (pinned), read from the simulator
(`getTaskMaxVariations`, `getVariationsDev`, `getVariationsTest`); `tests/test_sciworld.py`
checks them against a live simulator. No JVM is needed to know the task list.
"""

from __future__ import annotations

import dataclasses
import functools

from scienceworld.constants import ID2TASK

EXCLUDED = frozenset({"5-1", "5-2", "9-1", "9-2", "9-3", "10-1", "10-2"})  # as in AgentGym

# task id -> (number of variations, first dev variation, first test variation)
VARIATIONS: dict[str, tuple[int, int, int]] = {
    "1-1": (30, 14, 21),  # boil
    "1-2": (30, 14, 21),  # melt
    "1-3": (30, 14, 21),  # freeze
    "1-4": (30, 14, 21),  # change-the-state-of-matter-of
    "2-1": (540, 270, 405),  # use-thermometer
    "2-2": (436, 218, 327),  # measure-melting-point-known-substance
    "2-3": (300, 150, 225),  # measure-melting-point-unknown-substance
    "3-1": (20, 10, 15),  # power-component
    "3-2": (20, 10, 15),  # power-component-renewable-vs-nonrenewable-energy
    "3-3": (900, 450, 675),  # test-conductivity
    "3-4": (600, 300, 450),  # test-conductivity-of-unknown-substances
    "4-1": (300, 150, 225),  # find-living-thing
    "4-2": (300, 150, 225),  # find-non-living-thing
    "4-3": (300, 150, 225),  # find-plant
    "4-4": (300, 150, 225),  # find-animal
    "6-1": (32, 16, 24),  # chemistry-mix
    "6-2": (36, 18, 27),  # chemistry-mix-paint-secondary-color
    "6-3": (36, 18, 27),  # chemistry-mix-paint-tertiary-color
    "7-1": (125, 62, 93),  # lifespan-longest-lived
    "7-2": (125, 62, 93),  # lifespan-shortest-lived
    "7-3": (125, 62, 93),  # lifespan-longest-lived-then-shortest-lived
    "8-1": (14, 6, 9),  # identify-life-stages-1
    "8-2": (10, 4, 6),  # identify-life-stages-2
}


@dataclasses.dataclass(frozen=True)
class Task:
    """One entry of the flattened list: a simulator task name, a variation and its split."""

    task_id: str  # the catalogue id, e.g. "1-1"
    name: str  # the simulator's task name, e.g. "boil"
    variation: int
    split: str  # "train", "dev" or "test" (the simulator's own cut)


def _split(variation: int, dev_start: int, test_start: int) -> str:
    if variation >= test_start:
        return "test"
    return "dev" if variation >= dev_start else "train"


@functools.cache
def tasks() -> tuple[Task, ...]:
    """The flattened list in AgentGym's order: `tasks()[data_idx]`."""
    included = [task_id for task_id in ID2TASK if task_id not in EXCLUDED]
    if sorted(included) != sorted(VARIATIONS):
        raise RuntimeError(f"the installed scienceworld's tasks {included} differ from the table for 1.2.3")
    return tuple(
        Task(task_id, ID2TASK[task_id], v, _split(v, dev_start, test_start))
        for task_id in included
        for count, dev_start, test_start in [VARIATIONS[task_id]]
        for v in range(count)
    )


@functools.cache
def splits() -> dict[str, list[int]]:
    """Split name -> sorted task ids; every task name appears in every split."""
    out: dict[str, list[int]] = {"train": [], "dev": [], "test": []}
    for data_idx, task in enumerate(tasks()):
        out[task.split].append(data_idx)
    return out
