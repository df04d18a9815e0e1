"""A benchmark environment with ragged turns: observations of drawn lengths, never done.

Served as a real HTTP server (`python -m environments.serve --env=bench.ragged_env:RaggedLengthEnv`,
or `LocalServers(["bench.ragged_env:RaggedLengthEnv"])`). Observation t of task i has
`draw_length(OBSERVATION, i, t)` words ("ok ok ..."), so every run sees the same ragged mix; the
benchmark forces the policy's turn lengths from the same distribution (`TURN`). The episode
only ends by the rollout's horizon, so every episode plays the same number of turns.
"""

from __future__ import annotations

import numpy as np

from agentgym_jax.envs.protocol import StepResult, TaskInfo
from environments.base import Environment

NUM_TASKS = 1024
MIN_LEN, MAX_LEN = 5, 512  # the length range of turns and observations, in tokens (words)
MEDIAN, SIGMA = 48, 1.1  # lognormal: median 48, mean ~90 after clipping; a turn of 512 is ~1 in 300
SEED = 20260101
OBSERVATION, TURN = 0, 1  # what a length is drawn for


def draw_length(kind: int, *key: int) -> int:
    """A fixed heavy-tailed (lognormal, clipped) length in [MIN_LEN, MAX_LEN] for `key`."""
    rng = np.random.default_rng([SEED, kind, *key])
    return int(np.clip(round(rng.lognormal(np.log(MEDIAN), SIGMA)), MIN_LEN, MAX_LEN))


def observation_text(length: int) -> str:
    return " ".join(["ok"] * length)


class RaggedLengthEnv(Environment):
    name = "ragged"
    instruction = "Answer every observation. Observations are sequences of the word ok."
    has_oracle = False

    @classmethod
    def task_info(cls) -> TaskInfo:
        return TaskInfo(
            env=cls.name, instruction=cls.instruction, success_threshold=1.0,
            splits={"train": list(range(NUM_TASKS)), "test": []}, num_tasks=NUM_TASKS, has_oracle=False,
        )

    def reset(self, data_idx: int) -> str:
        self.task, self.turn = int(data_idx), 0
        self.text = observation_text(draw_length(OBSERVATION, self.task, 0))
        return self.text

    def step(self, action: str) -> StepResult:
        self.turn += 1
        self.text = observation_text(draw_length(OBSERVATION, self.task, self.turn))
        return self.result(self.text, 0.0, False, False)

    def observation(self) -> str:
        return self.text

    def available_actions(self) -> list[str]:
        return ["anything"]

    def verify(self) -> bool:
        return False

    def oracle_action(self) -> str:
        raise NotImplementedError("the ragged benchmark environment has no oracle")
