"""Blocking entry points work inside a running event loop, as in a Jupyter or Colab cell."""

import asyncio
import threading

import jax
import pytest

from agentgym_jax.aio import LoopThread, run_sync
from agentgym_jax.envs.pool import EnvPool
from agentgym_jax.envs.protocol import EpisodeStatus
from agentgym_jax.rollout.engine import RolloutConfig, RolloutEngine
from tests.test_rollout import MAX_NEW, framing, model, oracle_demonstrations, sampler  # noqa: F401 (module fixtures)
from tests.servers import start_server


async def _thread_name() -> str:
    await asyncio.sleep(0)
    return threading.current_thread().name


def _in_running_loop(fn):
    """Calls the blocking `fn()` from inside a running event loop, as a notebook cell does."""

    async def cell():
        asyncio.get_running_loop()  # the premise: a loop runs in this thread
        return fn()

    return asyncio.run(cell())


def test_run_sync_outside_and_inside_a_running_loop():
    assert run_sync(_thread_name()) == threading.current_thread().name  # plain asyncio.run
    refused = _thread_name()
    with pytest.raises(RuntimeError, match="running event loop"):
        _in_running_loop(lambda: asyncio.run(refused))  # what the library used to do
    refused.close()
    assert _in_running_loop(lambda: run_sync(_thread_name())).startswith("run_sync")


def test_loop_thread_keeps_one_loop_and_propagates_errors():
    loop_thread = LoopThread("test-loop")

    async def loop_id():
        return id(asyncio.get_running_loop())

    async def fail():
        raise KeyError("boom")

    first = loop_thread.run(loop_id())
    assert _in_running_loop(lambda: loop_thread.run(loop_id())) == first
    with pytest.raises(KeyError, match="boom"):
        loop_thread.run(fail())
    loop_thread.close()
    loop_thread.close()  # idempotent
    assert not any(t.name == "test-loop" for t in threading.enumerate())


def test_engine_and_demonstrations_run_inside_a_running_loop(framing, model, sampler):  # noqa: F811
    config = RolloutConfig(group_size=2, max_tokens_per_turn=MAX_NEW)
    with start_server("maze") as url:
        demos = _in_running_loop(lambda: oracle_demonstrations(url, framing, [12]))
        assert demos[0].status == EpisodeStatus.SUCCESS
        with RolloutEngine(sampler, framing, EnvPool(url), None, config) as engine:
            for horizon in (1, 2):  # the pool opened on the engine's loop serves the second call too
                trajectories = _in_running_loop(
                    lambda: engine.run(model[1], [0], horizon, jax.random.key(0), policy_version=0)
                )
                assert [t.num_turns for t in trajectories] == [horizon, horizon]
