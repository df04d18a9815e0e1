"""Progress credit: the potential-based reward shaping an environment may offer (`progress`).

The potential is minus the number of oracle steps still needed (the Maze: the shortest-path
distance to the goal; TextCraft: the commands left in the planner's plan). Each step earns
`step_reward` times the decrease of that number (negative when a step undoes progress), and the
solving step earns the rest of 1. Shaping of this form leaves the optimal policy alone (Ng, Harada
and Russell, 1999), and success is still the verifier's: an episode's return is exactly 1 on
success (`step_reward` a power of two, so the sums are exact in floating point) and below 1
otherwise as long as `step_reward` times the longest plan stays under 1.
"""

from __future__ import annotations


class ProgressCredit:
    """The credit of one episode; `pay` once per step."""

    def __init__(self, step_reward: float):
        self.step_reward = step_reward
        self.paid = 0.0

    def reset(self) -> None:
        self.paid = 0.0

    def pay(self, solved: bool, progress: int) -> float:
        """This step's reward: the rest of 1 on the solving step, else `step_reward * progress`."""
        reward = 1.0 - self.paid if solved else self.step_reward * progress
        self.paid += reward
        return reward
