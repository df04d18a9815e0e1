"""EnvPool against real Maze servers on 127.0.0.1: scale, dead servers, time-outs, retries."""

from __future__ import annotations

import asyncio
import collections
import os
import signal
import socket
import subprocess
import sys
import time

import aiohttp
import pytest

from agentgym_jax.envs.client import EnvClient, EnvConnectionError, EnvRequestTimeout, EnvServerError
from agentgym_jax.envs.dialects import DialectClient
from agentgym_jax.envs.launcher import LocalServers
from agentgym_jax.envs.pool import EnvPool
from agentgym_jax.envs.protocol import EpisodeStatus
from tests.servers import REPO

S = EpisodeStatus


class CountingClient(EnvClient):
    """A real client that also counts requests per path, the most it had in flight, and the
    sessions it holds open (created and not yet closed), now and at most."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls: collections.Counter[str] = collections.Counter()
        self.statuses: collections.Counter[int] = collections.Counter()  # HTTP errors by status
        self.in_flight = 0
        self.max_in_flight = 0
        self.open_sessions = 0
        self.max_open_sessions = 0

    async def request(self, method, path, **kwargs):
        self.calls[path] += 1
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        if path == "/close":
            self.open_sessions -= 1  # sent: gone from the server whether or not the answer arrives
        try:
            answer = await super().request(method, path, **kwargs)
        except EnvServerError as e:
            self.statuses[e.status] += 1
            raise
        finally:
            self.in_flight -= 1
        if path == "/create":
            self.open_sessions += 1
            self.max_open_sessions = max(self.max_open_sessions, self.open_sessions)
        return answer


def counting_pool(urls, **kwargs) -> tuple[EnvPool, list[CountingClient]]:
    clients: list[CountingClient] = []

    def factory(*args, **client_kwargs):
        clients.append(CountingClient(*args, **client_kwargs))
        return clients[-1]

    return EnvPool(urls, client_factory=factory, **kwargs), clients


async def play_to_end(pool: EnvPool, slots: list[int], task_ids: list[int], after_first_step=None) -> dict[int, S]:
    """Batched oracle play: reset all slots, then step whichever observations arrived first."""
    statuses: dict[int, S] = {}
    for result in await pool.reset_many(list(zip(slots, task_ids))):
        assert result.status is None and result.observation, result
    live = list(slots)
    first = True
    while live:
        oracle = await asyncio.gather(*(pool.oracle_action(s) for s in live), return_exceptions=True)
        actions = [a if isinstance(a, str) else "move up" for a in oracle]  # a dead server has no oracle
        if first and after_first_step is not None:
            after_first_step()
        first = False
        async for result in pool.step_as_completed(list(zip(live, actions))):
            if result.status is not None:
                statuses[result.slot] = result.status
                live.remove(result.slot)
    return statuses


@pytest.fixture(scope="module")
def maze():
    with LocalServers(["maze"]) as servers:
        yield servers


def test_256_concurrent_sessions_finish_oracle_episodes(maze):
    url = maze.urls["maze"]

    async def main():
        pool, clients = counting_pool(url, max_concurrency=32)
        async with pool:
            info = await pool.tasks()
            ids = [info.splits["train"][i % len(info.splits["train"])] for i in range(256)]
            statuses = await play_to_end(pool, list(range(256)), ids)
        return statuses, clients[0]

    statuses, client = asyncio.run(asyncio.wait_for(main(), 60))
    assert len(statuses) == 256 and set(statuses.values()) == {S.SUCCESS}
    assert client.calls["/create"] == 256 and client.calls["/close"] == 256  # one session per slot, all closed
    assert 1 < client.max_in_flight <= 32  # concurrent, and bounded by max_concurrency


def test_killed_server_ends_only_its_episodes_with_infra_error():
    with LocalServers(["maze"]) as a, LocalServers(["maze"]) as b:
        doomed = a.servers[0].process

        async def main():
            pool = EnvPool([a.urls["maze"], b.urls["maze"]], max_retries=2, backoff_s=0.05)
            async with pool:
                info = await pool.tasks()
                long_tasks = info.splits["train"][:16]  # slot s lives on urls[s % 2]
                return await play_to_end(pool, list(range(16)), long_tasks, after_first_step=doomed.kill)

        start = time.monotonic()
        statuses = asyncio.run(asyncio.wait_for(main(), 30))
    assert time.monotonic() - start < 30
    assert {statuses[s] for s in range(0, 16, 2)} == {S.INFRA_ERROR}
    assert {statuses[s] for s in range(1, 16, 2)} == {S.SUCCESS}


def test_unreachable_server_reports_infra_error_and_error_text():
    port = _free_port()

    async def main():
        async with EnvPool(f"http://127.0.0.1:{port}", max_retries=1, backoff_s=0.01) as pool:
            return await pool.reset(0, 0)

    result = asyncio.run(asyncio.wait_for(main(), 10))
    assert result.status is S.INFRA_ERROR and result.done and "127.0.0.1" in result.error


@pytest.mark.parametrize("request_timeout_s, episode_timeout_s", [(0.3, 100.0), (30.0, 0.5)])
def test_hung_server_gives_env_timeout(maze, request_timeout_s, episode_timeout_s):
    """A stopped (SIGSTOP) server: a step past the request or the episode time-out is `env_timeout`."""
    process = maze.servers[0].process

    async def main():
        async with EnvPool(maze.urls["maze"], request_timeout_s=request_timeout_s,
                           episode_timeout_s=episode_timeout_s) as pool:
            assert (await pool.reset(0, 1)).status is None
            os.kill(process.pid, signal.SIGSTOP)
            try:
                start = time.monotonic()
                result = await pool.step(0, "move up")
                return result, time.monotonic() - start
            finally:
                os.kill(process.pid, signal.SIGCONT)

    result, elapsed = asyncio.run(asyncio.wait_for(main(), 20))
    assert result.status is S.ENV_TIMEOUT and result.done
    assert elapsed < min(request_timeout_s, episode_timeout_s) + 1.0  # a step is never sent twice


def test_retries_recover_from_a_server_that_starts_late():
    port = _free_port()
    cmd = [sys.executable, "-m", "environments.serve", "--env=maze", f"--port={port}"]

    async def main(max_retries):
        async with EnvPool(f"http://127.0.0.1:{port}", max_retries=max_retries, backoff_s=0.1, max_backoff_s=1.0) as pool:
            first_try = await asyncio.wait_for(pool.reset(1, 3), 10) if max_retries == 0 else None
            late = await asyncio.create_subprocess_exec(*cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                result = await pool.reset(0, 3)
                step = await pool.step(0, "move up") if result.status is None else None
            finally:
                late.kill()
                await late.wait()
        return first_try, result, step

    without_retries, _, _ = asyncio.run(main(max_retries=0))
    assert without_retries.status is S.INFRA_ERROR  # nothing listening yet: the control case
    _, result, step = asyncio.run(asyncio.wait_for(main(max_retries=10), 30))
    assert result.status is None and "position" in result.observation.lower()
    assert step is not None and step.status is None


def test_4xx_is_not_retried_and_503_is(maze):
    async def main():
        pool, clients = counting_pool(maze.urls["maze"], max_retries=3, backoff_s=0.01)
        async with pool:
            bad = await pool.reset(0, 10**9)  # task id out of range: 400
            resets = clients[0].calls["/reset"]
        return bad, resets

    bad, resets = asyncio.run(asyncio.wait_for(main(), 10))
    assert bad.status is S.INFRA_ERROR and "out of range" in bad.error
    assert resets == 1

    with LocalServers(["maze"], max_sessions=1) as full:
        async def crowd():
            async with aiohttp.ClientSession() as http:
                other = await EnvClient(full.urls["maze"], http).create()  # another client fills the server
                pool, clients = counting_pool(full.urls["maze"], max_retries=2, backoff_s=0.01)
                async with pool:
                    refused = await pool.reset(0, 0)
                    return other, refused, clients[0].calls["/create"]

        other, refused, creates = asyncio.run(asyncio.wait_for(crowd(), 10))
    assert isinstance(other, int)  # a live session (ids are random), which keeps the server full
    assert refused.status is S.INFRA_ERROR and "503" in refused.error
    assert creates == 1 + 2  # the 503 was tried max_retries more times


async def poll_sessions(url: str, seen: list[int], stop: asyncio.Event) -> None:
    """Records the server's live-session count (its /health) every few milliseconds until `stop`,
    and once after it."""
    async with aiohttp.ClientSession() as http:
        client = EnvClient(url, http)
        while True:
            stopped = stop.is_set()
            seen.append((await client.health())["sessions"])
            if stopped:
                return
            await asyncio.sleep(0.002)


async def oracle_episodes_watched(url: str, task_ids: list[int], **pool_kwargs):
    """Plays `task_ids` with the oracle at once (`run_episode` each) while polling the server."""
    seen: list[int] = []
    stop = asyncio.Event()
    poller = asyncio.create_task(poll_sessions(url, seen, stop))
    pool, clients = counting_pool(url, **pool_kwargs)
    try:
        async with pool:
            episodes = await asyncio.gather(*(pool.run_episode(t, pool.oracle_policy) for t in task_ids))
    finally:
        stop.set()
        await poller
    return episodes, clients[0], seen


def test_live_sessions_stay_within_max_sessions_and_every_episode_finishes(maze):
    """24 oracle episodes started at once through a pool bounded to 3 live sessions: each waits
    for a session another one gave back; the server never holds more than 3 of them."""
    url = maze.urls["maze"]
    task_ids = list(range(24))
    episodes, client, seen = asyncio.run(asyncio.wait_for(
        oracle_episodes_watched(url, task_ids, max_sessions=3, max_concurrency=32), 60))
    assert [e.data_idx for e in episodes] == task_ids
    assert {e.status for e in episodes} == {S.SUCCESS}
    assert client.max_open_sessions == 3 and client.open_sessions == 0  # all 3 used, all closed at the end
    assert client.calls["/create"] == 3 and client.calls["/reset"] == 24  # given back and reset, not reopened
    assert seen and max(seen) <= 3 and seen[-1] == 0


def test_pool_waits_for_the_servers_own_cap_instead_of_failing():
    """An unbounded pool (max_sessions=0) over a server capped at 2 sessions reads the cap from
    /health and never asks past it; a second pool, which finds the server full because another
    pool holds a session there, learns the cap from the server's 503 and waits for its own."""
    with LocalServers(["maze"], max_sessions=2) as capped:
        url = capped.urls["maze"]
        episodes, client, seen = asyncio.run(asyncio.wait_for(oracle_episodes_watched(url, list(range(10))), 60))
        assert {e.status for e in episodes} == {S.SUCCESS}
        assert client.calls["/create"] == 2 and not client.statuses and max(seen) <= 2

        async def beside_another_pool():
            async with EnvPool(url) as holder:
                assert (await holder.reset(0, 0)).status is None  # holds one of the two
                return await oracle_episodes_watched(url, list(range(6)), backoff_s=0.01)

        episodes, client, seen = asyncio.run(asyncio.wait_for(beside_another_pool(), 60))
    assert {e.status for e in episodes} == {S.SUCCESS}
    assert client.statuses[503] == 1 and client.max_open_sessions == 1  # refused once, then waited
    assert max(seen) <= 2


def test_max_sessions_is_checked():
    with pytest.raises(ValueError, match="max_sessions must be >= 0.*got -1"):
        EnvPool("http://127.0.0.1:1", max_sessions=-1)


def test_misuse_is_a_clear_error(maze):
    async def main():
        async with EnvPool(maze.urls["maze"]) as pool:
            with pytest.raises(ValueError, match="reset it before stepping"):
                await pool.step(5, "move up")
            episode = await pool.run_episode(0, pool.oracle_policy)
            assert episode.status is S.SUCCESS and episode.turns and episode.reward > 0
            await play_to_end(pool, [3], [0])
            with pytest.raises(ValueError, match="already ended"):
                await pool.step(3, "move up")
        with pytest.raises(RuntimeError, match="not open"):
            await pool.reset(0, 0)

    asyncio.run(asyncio.wait_for(main(), 20))
    with pytest.raises(ValueError, match="at least one"):
        EnvPool([])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_client_raises_typed_errors(maze):
    process = maze.servers[0].process

    async def main():
        async with aiohttp.ClientSession() as http:
            client = EnvClient(maze.urls["maze"], http, request_timeout_s=0.3)
            info = await client.tasks()
            session = await client.create()
            with pytest.raises(EnvServerError) as bad_task:
                await client.reset(session, info.num_tasks)
            with pytest.raises(EnvServerError) as unknown:
                await client.step(session + 10_000, "move up")
            with pytest.raises(EnvConnectionError) as refused:
                await EnvClient(f"http://127.0.0.1:{_free_port()}", http).health()
            os.kill(process.pid, signal.SIGSTOP)
            try:
                with pytest.raises(EnvRequestTimeout):
                    await client.health()
            finally:
                os.kill(process.pid, signal.SIGCONT)
            await client.close(session)
            return info, bad_task.value, unknown.value, refused.value

    info, bad_task, unknown, refused = asyncio.run(asyncio.wait_for(main(), 20))
    assert info.env == "maze" and info.num_tasks > 0
    assert bad_task.status == 400 and bad_task.is_client_error and "out of range" in bad_task.message
    assert unknown.status == 404 and "unknown session" in unknown.message
    assert not isinstance(refused, EnvServerError) and not isinstance(refused, EnvRequestTimeout)


def test_a_named_oracle_is_confirmed_by_the_server_and_an_unknown_one_refused(maze):
    """`oracle_action(slot, "local")` plays Maze's local oracle; a name the environment lacks is a 400."""
    from environments.maze import layouts
    from environments.maze.env import MazeEnv

    async def main():
        async with EnvPool(maze.urls["maze"], max_retries=0) as pool:
            await pool.reset(0, 250)
            local, default = await pool.oracle_action(0, "local"), await pool.oracle_action(0)
            with pytest.raises(EnvServerError) as unknown:
                await pool.oracle_action(0, "shortest")
            return local, default, unknown.value

    local, default, unknown = asyncio.run(asyncio.wait_for(main(), 30))
    layout, start, goal = MazeEnv.task_setup(250)
    assert local == layouts.local_move(layout, start, goal, None)
    assert default == layouts.next_move(layout, layouts.distances_to(layout, goal), start)
    assert unknown.status == 400 and "maze has no oracle 'shortest'; valid: 'local', 'local_thought'" in unknown.message
    with pytest.raises(ValueError, match="AgentGym's servers have no oracles"):
        asyncio.run(DialectClient(maze.urls["maze"], None, dialect="maze").oracle_action("0", "local"))


def test_sft_demonstrations_come_from_the_configured_oracle_and_a_bad_name_stops_the_job(maze):
    """`sft.oracle=local`: the recipe's SFT episodes replay `layouts.local_move`; a name Maze lacks
    is a clear error before any model is built, not an empty SFT set."""
    from configs import cpu
    from environments.maze import layouts
    from environments.maze.env import MazeEnv

    from agentgym_jax.job import play, setup

    config = cpu.get_config("maze")
    config.sft.num_tasks = 6
    episodes = play.oracle_episodes(config, setup.make_pool(config.env, [maze.urls["maze"]]), MazeEnv.task_info())
    assert len(episodes) == 6 and sum(ep.status is S.SUCCESS for ep in episodes) >= 2
    for ep in episodes:  # replayed on an environment of this process
        env = MazeEnv()
        env.reset(ep.data_idx)
        for turn in ep.turns:
            move = layouts.local_move(env.layout, env.position, env.goal, env.last_move)
            assert turn.action == f"Action: {move}"
            env.step(move)
        assert env.verify() == (ep.status is S.SUCCESS)
    config.sft.oracle = "shortest"
    with pytest.raises(RuntimeError, match="every oracle episode failed .*maze has no oracle 'shortest'; valid: 'local', 'local_thought'"):
        play.oracle_episodes(config, setup.make_pool(config.env, [maze.urls["maze"]]), MazeEnv.task_info())


def test_reward_shaping_is_asked_of_every_session_and_refused_where_a_server_has_none(maze):
    """`reward_shaping` goes to every /create; the server confirms it and pays it; success is the same."""
    async def play(url, shaping, task_id):
        async with EnvPool(url, reward_shaping=shaping, max_retries=0) as pool:
            return await pool.run_episode(task_id, pool.oracle_policy)

    plain = asyncio.run(asyncio.wait_for(play(maze.urls["maze"], "", 250), 30))
    shaped = asyncio.run(asyncio.wait_for(play(maze.urls["maze"], "progress", 250), 30))
    assert plain.status is shaped.status is S.SUCCESS and len(plain.turns) == len(shaped.turns) > 3
    assert [t.reward for t in plain.turns] == [0.0] * (len(plain.turns) - 1) + [1.0]
    assert [t.reward for t in shaped.turns[:-1]] == [1 / 32] * (len(shaped.turns) - 1)  # one step of progress each
    assert sum(t.reward for t in shaped.turns) == 1.0
    with LocalServers(["room"]) as room:  # the room's credit is its own reward, not an option: refused, with the valid ones
        refused = asyncio.run(asyncio.wait_for(play(room.urls["room"], "progress", 0), 30))
    assert refused.status is S.INFRA_ERROR and "no reward shaping 'progress'; valid: none" in refused.error
    with pytest.raises(ValueError, match="AgentGym's servers pay their own rewards only"):
        DialectClient(maze.urls["maze"], None, dialect="maze", reward_shaping="progress")
