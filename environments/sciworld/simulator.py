"""One ScienceWorld engine: a JVM running the `scienceworld` package's jar, reached over py4j.

Why not `scienceworld.ScienceWorldEnv`: its `step` also asks the engine for every valid
action-object combination (50-550 ms a step) and its JVM runs with the default heap (a quarter
of the machine's memory; 3 GB resident was measured). Here a step is the engine's plain step,
valid actions are computed only on request, and the heap is capped (`-Xmx`, serial GC).

One engine holds one world: two engines in one JVM share global state (measured: interleaved
episodes give different observations), so each engine is its own process.
"""

from __future__ import annotations

import subprocess

from py4j.java_gateway import GatewayParameters, JavaGateway, launch_gateway
from scienceworld.constants import BASEPATH, JAR_PATH

DEFAULT_HEAP_MB = 320  # the largest gold-path load (boil) needs more than 128 MB; 256 MB passes


class JavaMissing(RuntimeError):
    """No Java runtime on PATH; ScienceWorld's engine is a JVM program."""


class Simulator:
    """A started engine. Not thread-safe: one caller at a time (one server session)."""

    def __init__(self, heap_mb: int = DEFAULT_HEAP_MB):
        try:
            port, process = launch_gateway(
                classpath=JAR_PATH, cwd=BASEPATH, die_on_exit=True, return_proc=True,
                javaopts=[f"-Xmx{heap_mb}m", "-XX:+UseSerialGC"],
            )
        except FileNotFoundError as e:
            raise JavaMissing(
                "ScienceWorld needs a Java runtime (`java` on PATH), e.g. `apt-get install default-jre-headless`"
            ) from e
        self.process: subprocess.Popen = process
        self._gateway = JavaGateway(gateway_parameters=GatewayParameters(port=port, auto_field=True),
                                    java_process=process)
        self._engine = self._gateway.jvm.scienceworld.runtime.pythonapi.PythonInterface()

    def load(self, task_name: str, variation: int, gold_path: bool = False) -> None:
        """Starts `task_name` variation `variation`; `gold_path` also plans the gold actions (slow)."""
        self._engine.load(task_name, variation, "", gold_path)

    def step(self, action: str) -> str:
        """The engine's own step: the observation text, nothing else computed."""
        return str(self._engine.step(action))

    def score(self) -> float:
        """The engine's score: 0..1 while the task runs, -1 once it has failed."""
        return float(self._engine.getScore())

    def completed(self) -> bool:
        return bool(self._engine.getCompleted())

    def moves(self) -> int:
        """Time steps taken (`wait` takes ten; look-arounds and refused actions none)."""
        return int(self._engine.getNumMoves())

    def task_description(self) -> str:
        return str(self._engine.getTaskDescription())

    def goal_progress(self) -> str:
        return str(self._engine.getGoalProgressStr())

    def valid_actions(self) -> list[str]:
        """Every valid action-object combination in the current state (the slow call)."""
        return [str(a) for a in self._engine.getValidActionObjectCombinations()]

    def action_templates(self) -> list[str]:
        return [str(a) for a in self._engine.getPossibleActions()]

    def object_names(self) -> list[str]:
        return [str(o) for o in self._engine.getPossibleObjects()]

    def gold_actions(self) -> list[str]:
        """The gold path planned by the last `load(..., gold_path=True)`."""
        return [str(a) for a in self._engine.getGoldActionSequence()]

    def alive(self) -> bool:
        return self.process.poll() is None

    def close(self) -> None:
        """Shuts the gateway down and makes sure the JVM exits."""
        try:
            self._gateway.shutdown()
        except Exception:  # a dead JVM cannot be shut down politely
            pass
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=30)
