"""A user's agent program, called for one episode: `env.agent` read, run, its answer checked.

    spec = AgentSpec.of(config.env)             # env.agent = "my_pkg.agent:play" or "python my_agent.py"
    outcome = await run_agent(spec, task_id, base_url, api_key, {"env_url": ..., "horizon": ...})

A function target is called as `fn(task, base_url, api_key, **kwargs)` on a thread of its own
(`env.agent_workers="threads"`) or in a fresh Python process (`"processes"`, for agents that are not
thread-safe). A command line is run with `--task=<id> --base_url=<url> --api_key=<key>` and
`--<kwarg>=<value>` appended, and its last line of stdout is its answer. The kwargs: `env_url` (one
of this process's servers of the job's environment), `horizon`, `sample_idx`, `model` (the name
to request) and `env.agent_kwargs`.

An answer is a reward (a number) or `{"reward", "success", "status", "metadata"}` (all but reward
optional). How an episode ends (docs/agents.md):
- a valid answer: its `status`, else success / failure from `success`, else from the reward
  against the environment's success threshold;
- the agent raised, exited non-zero, ran past `env.agent_timeout_s`, or answered something else
  (no reward, a reward that is not a finite number in `env.agent_reward_range`, fields of the
  wrong type): `infra_error`, with the reason. The harness failed, not (as far as anyone can
  tell) the policy, so the episode is never trained on, and evaluations keep it in the
  end-to-end denominator (architecture rule 5).
A thread cannot be stopped: a timed-out thread agent is abandoned and its API key refused from
then on; a process agent is killed with its process group.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import json
import math
import os
import re
import shlex
import signal
import sys
import threading
from collections.abc import Callable, Mapping
from typing import Any

import ml_collections

from agentgym_jax.config import ConfigError
from agentgym_jax.envs.protocol import EpisodeStatus

WORKERS = ("threads", "processes")
_FUNCTION = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")  # module:function (else a command line)
# Runs a `module:function` target in a child process: reads (target, args) as JSON on stdin and
# prints the function's answer as the last line; imports nothing of this library.
_CHILD = """
import importlib, json, sys
target, args = json.load(sys.stdin)
module, name = target.split(":")
answer = getattr(importlib.import_module(module), name)(**args)
print("\\n" + json.dumps(answer), flush=True)
"""


@dataclasses.dataclass(frozen=True)
class AgentSpec:
    """`env.agent` and how it runs (`env.agent_workers`, `agent_timeout_s`, `agent_kwargs`,
    `agent_reward_range`)."""

    target: str
    workers: str = "threads"
    timeout_s: float = 600.0
    kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    reward_range: tuple[float, float] = (-math.inf, math.inf)

    @property
    def is_function(self) -> bool:
        return bool(_FUNCTION.match(self.target))

    @classmethod
    def of(cls, env: ml_collections.ConfigDict) -> AgentSpec | None:
        """The config's agent (None without `env.agent`), checked: a one-line `ConfigError` otherwise."""
        target = env.get("agent", "").strip()
        if not target:
            return None
        workers = env.get("agent_workers", "threads")
        if workers not in WORKERS:
            raise ConfigError(f"env.agent_workers must be one of {', '.join(WORKERS)}, got {workers!r}")
        timeout = env.get("agent_timeout_s", 600.0)
        if not timeout > 0:
            raise ConfigError(f"env.agent_timeout_s must be > 0 seconds, got {timeout!r}")
        try:
            kwargs = json.loads(env.get("agent_kwargs", "") or "{}")
        except ValueError as e:
            raise ConfigError(f"env.agent_kwargs must be a JSON object, got {env.agent_kwargs!r} ({e})") from None
        if not isinstance(kwargs, dict):
            raise ConfigError(f"env.agent_kwargs must be a JSON object, got {env.agent_kwargs!r}")
        low, high = (float(x) for x in env.get("agent_reward_range", (-math.inf, math.inf)))
        if not low < high:
            raise ConfigError(f"env.agent_reward_range must be (low, high) with low < high, got {(low, high)}")
        spec = cls(target, workers, float(timeout), kwargs, (low, high))
        if spec.is_function:
            spec.function()  # a mistyped module or name: now, not at the first episode
        return spec

    def function(self) -> Callable[..., Any]:
        module, name = self.target.split(":")
        try:
            fn = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as e:
            raise ConfigError(f"env.agent={self.target!r}: {e}") from None
        if not callable(fn):
            raise ConfigError(f"env.agent={self.target!r} is not a function")
        return fn


@dataclasses.dataclass(frozen=True)
class AgentOutcome:
    """How the agent's episode ended: its reward, status, metadata, and why, if it failed."""

    reward: float
    status: EpisodeStatus
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)
    error: str = ""

    @classmethod
    def failed(cls, error: str) -> AgentOutcome:
        return cls(0.0, EpisodeStatus.INFRA_ERROR, {}, error)


def read_answer(answer: Any, reward_range: tuple[float, float], success_threshold: float) -> AgentOutcome:
    """The outcome of what an agent returned (the module docstring says which answers are valid);
    any other answer is an `infra_error` saying what was wrong."""
    fields = answer if isinstance(answer, dict) else {"reward": answer}
    unknown = sorted(set(fields) - {"reward", "success", "status", "metadata"})
    if unknown:
        return AgentOutcome.failed(f"the agent answered unknown fields {unknown}; valid: reward, success, status, metadata")
    reward = fields.get("reward")
    if not isinstance(reward, (int, float)) or isinstance(reward, bool) or not math.isfinite(reward):
        return AgentOutcome.failed(f"the agent's reward must be a finite number, got {reward!r}")
    low, high = reward_range
    if not low <= reward <= high:
        return AgentOutcome.failed(f"the agent's reward {reward!r} is outside env.agent_reward_range [{low}, {high}]")
    metadata = fields.get("metadata", {})
    if not isinstance(metadata, dict):
        return AgentOutcome.failed(f"the agent's metadata must be an object, got {metadata!r}")
    success = fields.get("success")
    if success is not None and not isinstance(success, bool):
        return AgentOutcome.failed(f"the agent's success must be true or false, got {success!r}")
    if fields.get("status") is not None:
        try:
            status = EpisodeStatus(fields["status"])
        except ValueError:
            valid = ", ".join(s.value for s in EpisodeStatus)
            return AgentOutcome.failed(f"the agent's status {fields['status']!r} is not one of {valid}")
        if success is not None and success != (status is EpisodeStatus.SUCCESS):
            return AgentOutcome.failed(f"the agent answered success={success} with status {status.value!r}")
    elif success is not None:
        status = EpisodeStatus.SUCCESS if success else EpisodeStatus.FAILURE
    else:
        status = EpisodeStatus.SUCCESS if reward >= success_threshold else EpisodeStatus.FAILURE
    return AgentOutcome(float(reward), status, metadata)


async def run_agent(spec: AgentSpec, task_id: int, base_url: str, api_key: str, kwargs: Mapping[str, Any],
                    success_threshold: float) -> AgentOutcome:
    """One episode of the agent on `task_id` against the gateway at `base_url` (see the module docstring)."""
    args = {"task": int(task_id), "base_url": base_url, "api_key": api_key, **spec.kwargs, **kwargs}
    try:
        if spec.is_function and spec.workers == "threads":
            answer = await asyncio.wait_for(_on_thread(spec.function(), args), spec.timeout_s)
        else:
            answer = await _in_process(spec, args)
    except asyncio.TimeoutError:
        return AgentOutcome.failed(f"the agent did not return within env.agent_timeout_s={spec.timeout_s:g} s")
    except Exception as e:  # noqa: BLE001: the agent's own error ends its episode, not the job
        return AgentOutcome.failed(f"the agent raised {type(e).__name__}: {e}")
    return read_answer(answer, spec.reward_range, success_threshold)


def _on_thread(fn: Callable[..., Any], args: dict[str, Any]) -> asyncio.Future:
    """`fn(**args)` on a daemon thread of its own (one a hung agent keeps, not a pool's)."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def call() -> None:
        try:
            result, error = fn(**args), None
        except BaseException as e:  # noqa: BLE001: handed to the episode
            result, error = None, e
        loop.call_soon_threadsafe(_settle, future, result, error)

    threading.Thread(target=call, name="agent", daemon=True).start()
    return future


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():  # timed out meanwhile
        return
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error if isinstance(error, Exception) else RuntimeError(repr(error)))


async def _in_process(spec: AgentSpec, args: dict[str, Any]) -> Any:
    """The agent as a child process (its own process group, killed at the time-out); its last
    line of stdout, as JSON."""
    if spec.is_function:
        command, stdin = [sys.executable, "-c", _CHILD], json.dumps([spec.target, args]).encode()
    else:
        command = shlex.split(spec.target) + [f"--{k}={v}" for k, v in args.items()]
        stdin = b""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), *filter(None, [os.environ.get("PYTHONPATH")])])}
    child = await asyncio.create_subprocess_exec(*command, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                                                 stderr=asyncio.subprocess.PIPE, env=env, start_new_session=True)
    try:
        out, err = await asyncio.wait_for(child.communicate(stdin), spec.timeout_s)
    finally:
        if child.returncode is None:
            os.killpg(child.pid, signal.SIGKILL)
            await child.wait()
    if child.returncode != 0:
        tail = err.decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
        raise RuntimeError(f"the agent process exited {child.returncode}: {tail[0]}")
    lines = out.decode(errors="replace").strip().splitlines()
    try:
        return json.loads(lines[-1])
    except (IndexError, ValueError):
        raise RuntimeError(f"the agent process's last line is not JSON: {lines[-1:]!r}") from None
