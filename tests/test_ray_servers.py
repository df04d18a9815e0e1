"""Environment servers as Ray actors on a local Ray: real room servers, real episodes through
`EnvPool`, one actor killed (only its episodes end `infra_error`), nothing left running after.

The library test is one test, so that the ~12 s of `ray.init` is paid once (pytest-xdist would
split tests of a module over workers, each starting its own Ray); the command-line script starts
a Ray of its own."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys
import time
import urllib.request

import psutil
import pytest
import ray

from agentgym_jax.envs.pool import EnvPool
from agentgym_jax.envs.protocol import EpisodeStatus
from agentgym_jax.envs.ray_servers import SHIPPED_CODE, RayEnvServers
from tests.servers import REPO
from tests.test_launcher import port_open, wait_closed

SLOTS = 4  # slots 0, 2 on the first server, 1, 3 on the second (`EnvPool`: slot % len(urls))


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_gone(pid: int, within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while not gone(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return gone(pid)


def ray_children() -> list[psutil.Process]:
    """Ray's processes started by this test process (raylet, GCS, workers)."""
    out = []
    for child in psutil.Process().children(recursive=True):
        try:
            if "ray" in " ".join(child.cmdline()).lower() and not gone(child.pid):
                out.append(child)
        except psutil.NoSuchProcess:
            pass
    return out


async def _play(urls: list[str], kill_first) -> tuple[list, dict[int, EpisodeStatus]]:
    """Oracle episodes on both servers; `kill_first()` after one step; the rest played out."""
    async with EnvPool(urls, max_retries=2, backoff_s=0.05, request_timeout_s=10.0) as pool:
        info = await pool.tasks()
        assert info.env == "room"
        full = await asyncio.gather(*(pool.run_episode(i, pool.oracle_policy, horizon=30) for i in info.splits["test"][:2]))

        await pool.reset_many([(slot, info.splits["test"][slot]) for slot in range(SLOTS)])
        first = await pool.step_many([(s, await pool.oracle_action(s)) for s in range(SLOTS)])
        assert all(r.status is None for r in first), first  # every room task needs >= 2 moves
        actions = [(s, await pool.oracle_action(s)) for s in range(SLOTS)]
        kill_first()
        statuses = {r.slot: r.status for r in await pool.step_many(actions)}
        for slot in (1, 3):  # the live server's episodes go on to the end
            while statuses[slot] is None:
                statuses[slot] = (await pool.step(slot, await pool.oracle_action(slot))).status
        return full, statuses


@pytest.mark.slow
def test_room_servers_as_ray_actors():
    with pytest.raises(RuntimeError, match="ray.init"):
        RayEnvServers("room", 1).start()

    # No PYTHONPATH for the workers: they get the code shipped, as on a cluster.
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env=SHIPPED_CODE)
    try:
        with pytest.raises(RuntimeError, match=r"unknown environment 'roomm'.*room"):
            RayEnvServers("roomm", 1, host="127.0.0.1", num_cpus=0.5).start()

        servers = RayEnvServers("room", 2, host="127.0.0.1", num_cpus=0.5)
        urls = servers.start()
        try:
            pids = [s.pid for s in servers.servers]
            assert len(set(urls)) == 2 and all(u.startswith("http://127.0.0.1:") for u in urls)
            assert servers.urls_flag == f"--config.env.urls={urls[0]},{urls[1]}"
            assert all(port_open(u) for u in urls) and not any(gone(p) for p in pids)

            def kill_first():
                ray.kill(servers.actors[0])  # SIGKILL to the actor's worker: its server must go too
                assert wait_closed(urls[0], within_s=10.0) and wait_gone(pids[0])

            full, statuses = asyncio.run(_play(urls, kill_first))
            assert [e.status for e in full] == [EpisodeStatus.SUCCESS] * 2
            assert statuses[0] is statuses[2] is EpisodeStatus.INFRA_ERROR
            assert statuses[1] is statuses[3] is EpisodeStatus.SUCCESS
            assert port_open(urls[1])
        finally:
            servers.stop()  # the killed actor is skipped; the live one stops its server in order
        assert servers.urls == [] and all(wait_gone(p) for p in pids)
        assert not any(port_open(u) for u in urls)
    finally:
        ray.shutdown()
    deadline = time.monotonic() + 15
    while ray_children() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray_children() == []


@pytest.mark.slow
def test_cli_prints_the_urls_flag_and_stops_everything_on_sigterm():
    """`launch/ray_env_servers.py --address=local`: its own one-machine Ray, gone after SIGTERM."""
    process = subprocess.Popen(
        [sys.executable, str(REPO / "launch" / "ray_env_servers.py"), "--env=room", "--num_servers=1",
         "--address=local", "--host=127.0.0.1", "--num_cpus=0.5"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    try:
        lines = []
        for line in process.stdout:
            lines.append(line)
            if line.startswith("serving until Ctrl-C"):
                break
        flag = next((x.strip() for x in lines if x.startswith("--config.env.urls=")), None)
        assert flag, "".join(lines) + f"exit code {process.poll()}"
        url = flag.split("=", 1)[1]
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+", url)
        with urllib.request.urlopen(f"{url}/health", timeout=5) as answer:
            assert json.load(answer)["env"] == "room"
        descendants = [p.pid for p in psutil.Process(process.pid).children(recursive=True)]
        assert descendants  # Ray's processes and the server

        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
        assert not port_open(url)
        assert all(wait_gone(pid, within_s=15) for pid in descendants)
    finally:
        process.kill()
        process.wait()
        process.stdout.close()
