"""Each task's difficulty, for a training curriculum (`curriculum.key=oracle_turns`): how many
actions the oracle takes to complete it. A policy limited to `h` turns can finish a task only about
as fast as the oracle does, so a stage that admits `oracle_turns <= h` gives GRPO groups that can
succeed. Playing the oracle on all 900 tasks takes ~15 s, too long for every server start, so the
numbers are computed once and stored beside this file; tasks it does not finish within
`MAX_TURNS` actions are graded `MAX_TURNS + 1`. Regenerate them after changing the oracle, the
actions or the levels (`tests/test_babyai.py` replays a sample against the stored numbers):

    python -m environments.babyai.grades
"""

from __future__ import annotations

import functools
import json
import pathlib
from typing import TYPE_CHECKING

from environments.babyai import levels

if TYPE_CHECKING:  # the environment reads this module's grades
    from environments.babyai.env import BabyAIEnv

MAX_TURNS = 64
PATH = pathlib.Path(__file__).with_name("oracle_turns.json")


def play_oracle(env: BabyAIEnv, data_idx: int) -> int:
    """The oracle's action count on task `data_idx`, or MAX_TURNS + 1 where it does not finish."""
    env.reset(data_idx)
    for turn in range(1, MAX_TURNS + 1):
        if env.step(env.oracle_action()).done:
            return turn if env.verify() else MAX_TURNS + 1
    return MAX_TURNS + 1


@functools.cache
def oracle_turns() -> tuple[int, ...]:
    """The stored grade of every task id (index = task id)."""
    turns = tuple(json.loads(PATH.read_text()))
    if len(turns) != levels.NUM_TASKS:
        raise RuntimeError(f"{PATH} grades {len(turns)} tasks, BabyAI has {levels.NUM_TASKS}: "
                           "regenerate it with python -m environments.babyai.grades")
    return turns


def main() -> None:
    from environments.babyai.env import BabyAIEnv

    env = BabyAIEnv()
    PATH.write_text(json.dumps([play_oracle(env, i) for i in range(levels.NUM_TASKS)]) + "\n")
    print(f"wrote {PATH}")


if __name__ == "__main__":
    main()
