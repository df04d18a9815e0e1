"""A benchmark environment whose steps take as long as a real environment's, and the measurement
those latencies come from.

Served as a real HTTP server (`python -m environments.serve --env=bench.latency_env:MiniWoBLatencyEnv`,
or `LocalServers(["bench.latency_env:MiniWoBLatencyEnv"])`; one class per profile below). Task i
lasts `episode_turns(i)` turns (1 to `MAX_TURNS`, ragged) unless the policy says the goal word
("ok") first: that ends it at once as a success, so a group's episodes differ in length and in
reward. Every `/step` sleeps `step_latency(profile, task, turn)` seconds, drawn from the profile's
lognormal (fixed per task and turn, so every run sees the same delays), on the server's thread
pool (`blocking = True`): concurrent sessions wait side by side, as on a real engine's server.

The profiles are our own servers' `/step` latencies, oracle actions replayed by `--sessions`
concurrent sessions (`bench/env_server.py`'s recording and replay), fitted by maximum likelihood
(median = exp(mean log x), sigma = std log x; `--measure` prints the fit's p90/p99 beside the
measured ones). Measured on 2026-12-04 on the 2-core AMD EPYC machine, shared with other jobs:

- `miniwob`: MiniWoB++ in headless Chromium 156, one session (a browser step: act on the page,
  let it run, render it to text); `--measure=miniwob --tasks=16` (load average ~1.2).
- `miniwob_8`: the same server stepped by 8 sessions at once, 8 browsers on the 2 cores: what a
  browser server with 4 sessions per core answers; `--measure=miniwob --tasks=30 --sessions=8`
  (load average 6 rising to 25, our browsers among it).
- `sciworld`: ScienceWorld's JVM engine, one session (steps of the `boil` tasks' gold paths);
  `--measure=code,sciworld --tasks=8` (load average ~4.6), as for
- `code`: the code environment's bubblewrap sandbox, one session: `write` a file (~1 ms), `run`
  and `submit` start Python test programs (~30 ms), so the lognormal fits a two-humped
  distribution loosely (fit p50 13 ms, measured 27 ms): a tool call that executes code.

Every `--measure` run replays for `--seconds` (60) per environment:

    python bench/latency_env.py --measure=miniwob,sciworld,code [--sessions=8] [--tasks=16]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import pathlib
import sys
import time
from typing import ClassVar

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from agentgym_jax.envs.protocol import StepResult, TaskInfo  # noqa: E402
from environments.base import Environment, every_kth_held_out  # noqa: E402


@dataclasses.dataclass(frozen=True)
class LatencyProfile:
    """A lognormal step latency, with the quantiles it was fitted to (seconds)."""

    median_s: float
    sigma: float
    max_s: float  # draws are clipped here (the longest step measured)
    p50_s: float
    p90_s: float
    p99_s: float
    steps: int  # how many /step calls were timed
    sessions: int  # concurrent sessions on the server while they were

    def draw(self, rng: np.random.Generator) -> float:
        return float(min(rng.lognormal(math.log(self.median_s), self.sigma), self.max_s))


# The measured constants (`--measure` prints these lines); seconds.
PROFILES: dict[str, LatencyProfile] = {
    "miniwob": LatencyProfile(median_s=0.07396, sigma=0.1601, max_s=0.1171, p50_s=0.07393, p90_s=0.09083,
                              p99_s=0.1103, steps=416, sessions=1),
    "miniwob_8": LatencyProfile(median_s=0.5313, sigma=0.4400, max_s=1.2506, p50_s=0.5792, p90_s=0.8296,
                                p99_s=1.0326, steps=445, sessions=8),
    "sciworld": LatencyProfile(median_s=0.004781, sigma=0.5313, max_s=0.09992, p50_s=0.004411, p90_s=0.009335,
                               p99_s=0.02447, steps=9713, sessions=1),
    "code": LatencyProfile(median_s=0.01328, sigma=1.2877, max_s=0.07856, p50_s=0.02743, p90_s=0.04030,
                           p99_s=0.06025, steps=1699, sessions=1),
}

NUM_TASKS = 1024
MAX_TURNS = 8  # an episode lasts 1..MAX_TURNS turns when the goal word never comes
GOAL = "ok"  # an action containing it solves the task
SEED = 20261205
_TURNS, _LATENCY = 0, 1  # what a number is drawn for


def episode_turns(task: int) -> int:
    """How many turns task `task` lasts without the goal word: uniform in [1, MAX_TURNS]."""
    return int(np.random.default_rng([SEED, _TURNS, task]).integers(1, MAX_TURNS + 1))


def step_latency(profile: str, task: int, turn: int) -> float:
    """Seconds step `turn` (1-based) of task `task` takes under `profile`: the same in every run."""
    rng = np.random.default_rng([SEED, _LATENCY, sorted(PROFILES).index(profile), task, turn])
    return PROFILES[profile].draw(rng)


class LatencyEnv(Environment):
    """Say the goal word within the task's turns; every step takes a drawn, measured latency."""

    name = "latency"
    instruction = f"Each turn, answer with one word. Saying {GOAL} solves the task."
    has_oracle = True
    blocking = True  # a step sleeps: on the server's threads, never on its event loop
    profile: ClassVar[str]  # a key of PROFILES; serve one of the subclasses below

    @classmethod
    def task_info(cls) -> TaskInfo:
        return TaskInfo(env=cls.name, instruction=cls.instruction, success_threshold=1.0,
                        splits=every_kth_held_out(NUM_TASKS, 8), num_tasks=NUM_TASKS, has_oracle=True)

    def reset(self, data_idx: int) -> str:
        self.task, self.turn, self.solved = int(data_idx), 0, False
        self.turns = episode_turns(self.task)
        self.text = self._observation()
        return self.text

    def step(self, action: str) -> StepResult:
        self.turn += 1
        latency = step_latency(self.profile, self.task, self.turn)
        time.sleep(latency)
        self.solved = GOAL in action.lower()
        done = self.solved or self.turn >= self.turns
        self.text = "solved" if self.solved else "out of turns" if done else self._observation()
        return self.result(self.text, float(self.solved), done, False, turn_latency_s=latency)

    def _observation(self) -> str:
        return f"task {self.task}: turn {self.turn + 1} of {self.turns}. Say the word."

    def observation(self) -> str:
        return self.text

    def available_actions(self) -> list[str]:
        return [GOAL]

    def verify(self) -> bool:
        return self.solved

    def oracle_action(self) -> str:
        return GOAL


class MiniWoBLatencyEnv(LatencyEnv):
    name = "latency_miniwob"
    profile = "miniwob"


class MiniWoB8LatencyEnv(LatencyEnv):
    name = "latency_miniwob_8"
    profile = "miniwob_8"


class SciWorldLatencyEnv(LatencyEnv):
    name = "latency_sciworld"
    profile = "sciworld"


class CodeLatencyEnv(LatencyEnv):
    name = "latency_code"
    profile = "code"


def measure(env: str, tasks: int, seconds: float, sessions: int = 1) -> list[float]:
    """`/step` latencies (s) of our `env` server at `sessions` concurrent sessions, replaying recorded
    oracle actions."""
    import asyncio

    from agentgym_jax.envs.client import EnvClient
    from agentgym_jax.envs.launcher import LocalServers
    from bench.env_server import drive, record_oracle

    with LocalServers([env]) as servers:
        url = servers.urls[env]
        scripts = asyncio.run(record_oracle(url, tasks))
        return asyncio.run(drive(url, EnvClient, scripts, sessions, seconds)).latencies_s


def fit(latencies: list[float], sessions: int) -> LatencyProfile:
    logs = np.log(latencies)
    p50, p90, p99 = (float(q) for q in np.quantile(latencies, [0.5, 0.9, 0.99]))
    return LatencyProfile(median_s=float(np.exp(logs.mean())), sigma=float(logs.std()), max_s=max(latencies),
                          p50_s=p50, p90_s=p90, p99_s=p99, steps=len(latencies), sessions=sessions)


def main() -> None:
    parser = argparse.ArgumentParser(description="Measure our servers' /step latency profiles")
    parser.add_argument("--measure", default="miniwob,sciworld,code", help="comma-separated environments")
    parser.add_argument("--tasks", type=int, default=16, help="test tasks whose oracle actions are replayed")
    parser.add_argument("--seconds", type=float, default=60.0, help="timed replay per environment")
    parser.add_argument("--sessions", type=int, default=1, help="concurrent sessions replaying")
    args = parser.parse_args()
    print(f"{'profile':>10} {'steps':>6} {'p50_ms':>8} {'p90_ms':>8} {'p99_ms':>8} {'max_ms':>8} "
          f"{'median_ms':>9} {'sigma':>6} {'fit_p90_ms':>10} {'fit_p99_ms':>10}", flush=True)
    for env in args.measure.split(","):
        p = fit(measure(env, args.tasks, args.seconds, args.sessions), args.sessions)
        name = env if args.sessions == 1 else f"{env}_{args.sessions}"
        fitted = [1e3 * p.median_s * math.exp(p.sigma * z) for z in (1.2816, 2.3263)]  # standard normal p90, p99
        print(f"{name:>10} {p.steps:>6} {1e3 * p.p50_s:>8.1f} {1e3 * p.p90_s:>8.1f} {1e3 * p.p99_s:>8.1f} "
              f"{1e3 * p.max_s:>8.1f} {1e3 * p.median_s:>9.1f} {p.sigma:>6.3f} {fitted[0]:>10.1f} {fitted[1]:>10.1f}",
              flush=True)
        print(f"    {name!r}: {p!r},", flush=True)


if __name__ == "__main__":
    main()
