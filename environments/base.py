"""The contract every environment implements; the server framework hosts any subclass.

An `Environment` instance is one live episode (one server session). The server holds one lock
per session, so an instance never sees two calls at once. Everything an environment needs to
be trained on and evaluated lives here: the instruction text, the parser from model text to an
action, deterministic task-id splits, a verifier that reads the state, and an oracle.
"""

from __future__ import annotations

import abc
import re
from typing import Any, ClassVar

from agentgym_jax.envs.protocol import ProtocolError, StepResult, TaskInfo

_ACTION_MARKER = re.compile(r"action:", re.IGNORECASE)
_NON_SPACE = re.compile(r"\S")
_LINE_END = re.compile("[\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029]")  # what `str.splitlines` splits at


def parse_thought_action(text: str) -> str | None:
    """`Thought: ... Action: <a>` -> `<a>` (first non-empty line after the last `Action:`).

    Text without an `Action:` marker is taken as the action itself, so AgentGym clients that
    send already-parsed actions work unchanged. Empty results are `None` (an invalid action).
    Linear in the length of the text, like every parser here: replies are untrusted input.
    """
    last = None
    for last in _ACTION_MARKER.finditer(text):
        pass
    start = _NON_SPACE.search(text, last.end() if last else 0)  # the first non-empty line starts here
    if start is None:
        return None
    end = _LINE_END.search(text, start.start())
    return " ".join(text[start.start():end.start() if end else len(text)].split())


def every_kth_held_out(num_tasks: int, every: int) -> dict[str, list[int]]:
    """Train/test splits holding out every `every`-th task id: sorted, the same in every process."""
    ids = range(num_tasks)
    return {"train": [i for i in ids if i % every], "test": [i for i in ids if i % every == 0]}


class Environment(abc.ABC):
    """One episode of one environment. Subclasses set the class attributes and the methods."""

    name: ClassVar[str]
    instruction: ClassVar[str]  # AgentGym's `conversation_start` (the first user message)
    success_threshold: ClassVar[float] = 1.0  # on the environment's own score scale
    has_oracle: ClassVar[bool] = True
    route_prefixes: ClassVar[tuple[str, ...]] = ()  # AgentGym's path prefixes, e.g. ("/maze",)
    blocking: ClassVar[bool] = False  # True: the server runs this env's calls in a thread pool
    # The server's session cap when `--max_sessions` is not given (each session one live episode).
    max_sessions: ClassVar[int] = 1024
    # Resident memory (MiB) of the engine process each session holds (a JVM, a browser); non-zero:
    # the default cap follows from the machine's memory instead (`sessions.default_max_sessions`).
    session_memory_mb: ClassVar[float] = 0.0
    # Names of extra zero-argument methods served as `GET /<name>?id=` (AgentGym extras such as
    # Wordle's `filtered_vocab`); the method's JSON-able return value is the whole answer.
    extra_queries: ClassVar[tuple[str, ...]] = ()
    # The shared test suite's oracle sweep: how many test-split ids it plays and how many at once
    # (lower both where an episode costs seconds of engine time or a session is a process).
    oracle_sweep_episodes: ClassVar[int] = 100
    oracle_sweep_concurrency: ClassVar[int] = 32
    # Shaped rewards a session may opt into (`/create {"reward_shaping": <name>}`), off by default.
    # Shaping changes the rewards paid, never `verify` (what counts as success).
    reward_shapings: ClassVar[tuple[str, ...]] = ()
    reward_shaping: str = ""  # this session's choice; "": the environment's own reward
    # Other oracles a client may ask for (`GET /oracle_action?id=&oracle=<name>`), beside the
    # default one that solves every task: e.g. Maze's `local`, which acts only on what an
    # observation shows, so a policy can learn to imitate it (`named_oracle_action`).
    oracles: ClassVar[tuple[str, ...]] = ()

    @classmethod
    @abc.abstractmethod
    def task_info(cls) -> TaskInfo:
        """Splits (sorted, process-independent), counts and metadata for `/tasks`."""

    @classmethod
    def parse_action(cls, text: str) -> str | None:
        """Model text -> action string, or None when nothing usable was said."""
        return parse_thought_action(text)

    @classmethod
    def tool_schemas(cls) -> list[dict[str, Any]]:
        """The tools of a tool environment in the OpenAI function format (`GET /tools`); [] for
        environments whose actions are text."""
        return []

    def session_tool_schemas(self) -> list[dict[str, Any]]:
        """This session's tools (`GET /tools?id=`): a perturbation may hide or change some."""
        return self.tool_schemas()

    @abc.abstractmethod
    def reset(self, data_idx: int) -> str:
        """Starts task `data_idx` (same task in every process) and returns the first observation."""

    @abc.abstractmethod
    def step(self, action: str) -> StepResult:
        """Applies one parsed action. Invalid actions give reward 0 and `info.invalid_action`."""

    @abc.abstractmethod
    def observation(self) -> str:
        """The current observation (what the last reset/step returned)."""

    @abc.abstractmethod
    def available_actions(self) -> list[str]:
        """Actions valid in the current state (may be a representative subset)."""

    @abc.abstractmethod
    def verify(self) -> bool:
        """Whether the task is solved, read from the environment state, not from rewards."""

    @abc.abstractmethod
    def oracle_action(self) -> str:
        """The oracle's next action from the current state; following it solves the task."""

    def named_oracle_action(self, oracle: str) -> str:
        """The next action of `oracle`, one of `oracles` (the server checks the name)."""
        raise NotImplementedError(f"{self.name} lists oracles {self.oracles} but serves none of them")

    @classmethod
    def check_create(cls, body: dict[str, Any]) -> None:
        """Refuses `/create` settings this environment cannot honour (raise a `ProtocolError`).

        `reward_shaping` must be one of `reward_shapings`; the body is otherwise ignored: a
        session starts its episode at `/reset`. Subclasses that refuse more call this too.
        """
        shaping = body.get("reward_shaping", "")
        if shaping and shaping not in cls.reward_shapings:
            valid = ", ".join(repr(s) for s in cls.reward_shapings) or "none"
            raise ProtocolError(f"{cls.name} has no reward shaping {shaping!r}; valid: {valid}")

    def reset_fields(self) -> dict[str, Any]:
        """Extra fields of the `/reset` answer that AgentGym's client reads (SciWorld's `task_description`)."""
        return {}

    @classmethod
    def idle_engines(cls) -> int:
        """Engines of `session_memory_mb` kept warm besides the sessions' own (they count against memory)."""
        return 0

    @classmethod
    def on_server_start(cls) -> None:
        """Called once when a server for this class starts (e.g. to warm engine processes); must not block."""

    @classmethod
    def on_server_stop(cls) -> None:
        """Called once when that server shuts down, after every session is closed."""

    def score(self) -> float:
        """The episode score on the environment's own scale (0-1 unless overridden)."""
        return 1.0 if self.verify() else 0.0

    def close(self) -> None:
        """Frees engine resources; called when the session ends or is reaped."""

    def result(self, observation: str, reward: float, done: bool, invalid: bool, **info: Any) -> StepResult:
        """Builds a `StepResult` with the info keys every client relies on."""
        info = {"invalid_action": invalid, "success": self.verify(), "score": self.score(), **info}
        return StepResult(observation=observation, reward=float(reward), done=done, info=info)
