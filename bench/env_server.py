"""Environment server throughput: steps/s and step latency at 1, 16, 64 and 256 sessions.

    python bench/env_server.py --env=textcraft                # our server, started here
    python bench/env_server.py --env=textcraft --url=http://127.0.0.1:36001 --dialect=textcraft
    python bench/env_server.py --env=bash --sessions=1,16,64  # bash, code: a sandbox a session, 64 at most

Every session replays oracle action sequences recorded beforehand from our own server (so the
timed phase sends exactly one /step per action, to ours and to AgentGym's alike): reset a task,
step through its recorded actions until `done` or the sequence ends, reset the next task, until
`--seconds` have passed. Steps/s counts /step answers over the wall time (resets included in the
time); latency is per /step. Results for the side-by-side runs are in `bench/README.md`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import pathlib
import statistics
import sys
import time
import urllib.parse

import aiohttp

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from agentgym_jax.envs.client import EnvClient, EnvError  # noqa: E402
from agentgym_jax.envs.dialects import dialect_client_factory  # noqa: E402
from agentgym_jax.envs.launcher import LocalServers  # noqa: E402
from agentgym_jax.envs.pool import ClientFactory, EnvPool  # noqa: E402
from agentgym_jax.envs.protocol import EpisodeStatus  # noqa: E402


@dataclasses.dataclass
class Stats:
    sessions: int
    steps: int
    seconds: float
    latencies_s: list[float]
    episodes: int
    solved: int
    errors: int
    server_cpu_s: float | None  # CPU time the server process used during the run (None: not found)

    @property
    def server_cpu_ms_per_step(self) -> float:
        """Load-independent cost: on shared CPUs wall-clock rates move with the neighbours' load."""
        return float("nan") if self.server_cpu_s is None else 1000 * self.server_cpu_s / max(self.steps, 1)

    @property
    def steps_per_s(self) -> float:
        return self.steps / self.seconds

    def latency_ms(self, q: float) -> float:
        return 1000 * statistics.quantiles(self.latencies_s, n=100, method="inclusive")[round(q) - 1]


async def record_oracle(url: str, num_tasks: int) -> dict[int, list[str]]:
    """Task id -> the oracle's actions for it, from our server; only solved episodes are kept."""
    async with EnvPool(url, max_concurrency=16) as pool:
        info = await pool.tasks()
        ids = (info.splits.get("test") or next(iter(info.splits.values())))[:num_tasks]
        episodes = await asyncio.gather(*(pool.run_episode(i, pool.oracle_policy) for i in ids))
    scripts = {e.data_idx: [t.action for t in e.turns] for e in episodes if e.status is EpisodeStatus.SUCCESS}
    if not scripts:
        raise RuntimeError("the oracle solved none of the recorded tasks")
    return scripts


async def drive(url: str, make_client: ClientFactory, scripts: dict[int, list[str]], sessions: int,
                seconds: float) -> Stats:
    """`sessions` concurrent sessions replaying `scripts` for `seconds`; one request in flight each."""
    tasks = sorted(scripts)
    latencies: list[float] = []
    counts = dict(steps=0, episodes=0, solved=0, errors=0)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as http:
        client: EnvClient = make_client(url, http, request_timeout_s=120.0)
        session_ids = await asyncio.gather(*(client.create() for _ in range(sessions)))
        stop_at = time.monotonic() + seconds

        async def play(k: int, session_id) -> None:
            n = k
            while time.monotonic() < stop_at:
                task = tasks[n % len(tasks)]
                n += sessions
                try:
                    await client.reset(session_id, task)
                    for action in scripts[task]:
                        start = time.perf_counter()
                        result = await client.step(session_id, action)
                        latencies.append(time.perf_counter() - start)
                        counts["steps"] += 1
                        if result.done:
                            counts["episodes"] += 1
                            counts["solved"] += bool(result.info.get("success"))
                            break
                        if time.monotonic() >= stop_at:
                            break
                except EnvError:
                    counts["errors"] += 1

        pid = listening_pid(urllib.parse.urlsplit(url).port)
        cpu_before = process_cpu_s(pid)
        start = time.monotonic()
        await asyncio.gather(*(play(k, s) for k, s in enumerate(session_ids)))
        elapsed = time.monotonic() - start
        cpu = process_cpu_s(pid) - cpu_before if pid is not None else None
        await asyncio.gather(*(client.close(s) for s in session_ids), return_exceptions=True)
    return Stats(sessions, counts["steps"], elapsed, latencies, counts["episodes"], counts["solved"],
                 counts["errors"], cpu)


def listening_pid(port: int | None) -> int | None:
    """The local process listening on TCP `port` (Linux /proc), or None."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as f:
            for line in list(f)[1:]:
                fields = line.split()
                if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "0A":  # 0A: LISTEN
                    inodes.add(f"socket:[{fields[9]}]")
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            if any(os.readlink(f"/proc/{pid}/fd/{fd}") in inodes for fd in os.listdir(f"/proc/{pid}/fd")):
                return int(pid)
    return None


def process_cpu_s(pid: int | None) -> float:
    """User + system CPU seconds of `pid` (all its threads)."""
    if pid is None:
        return 0.0
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env", required=True, help="environment name (our server records the oracle actions)")
    parser.add_argument("--url", default="", help="server to measure (default: our server, started here)")
    parser.add_argument("--dialect", default="", help="speak this AgentGym dialect (see docs/dialects.md)")
    parser.add_argument("--sessions", default="1,16,64,256", help="comma-separated concurrency levels")
    parser.add_argument("--seconds", type=float, default=4.0, help="timed run per level")
    parser.add_argument("--tasks", type=int, default=64, help="task ids to record and replay")
    parser.add_argument("--actions", default="", help="comma-separated actions to replay on every task "
                        "instead of recorded oracle actions (for servers whose task ids mean other tasks)")
    args = parser.parse_args()
    levels = [int(s) for s in args.sessions.split(",")]
    make_client = dialect_client_factory(args.dialect) if args.dialect else EnvClient

    def measure(url: str) -> list[Stats]:
        return [asyncio.run(drive(url, make_client, scripts, n, args.seconds)) for n in levels]

    if args.actions:
        scripts = {i: [a.strip() for a in args.actions.split(",")] for i in range(args.tasks)}
    if args.url and args.actions:
        rows = measure(args.url)
    else:
        with LocalServers([args.env]) as ours:  # records the oracle; stopped before timing a --url server
            if not args.actions:
                scripts = asyncio.run(record_oracle(ours.urls[args.env], args.tasks))
            if not args.url:
                rows = measure(ours.urls[args.env])
        if args.url:
            rows = measure(args.url)

    target = args.url or f"our {args.env} server"
    print(f"env={args.env} server={target} dialect={args.dialect or 'native'} "
          f"recorded_tasks={len(scripts)} mean_actions={statistics.mean(map(len, scripts.values())):.1f}")
    print(f"{'sessions':>8} {'steps/s':>9} {'p50_ms':>8} {'p99_ms':>8} {'server_cpu_ms/step':>18} "
          f"{'episodes':>8} {'solved':>7} {'errors':>6}")
    for r in rows:
        print(f"{r.sessions:>8} {r.steps_per_s:>9.0f} {r.latency_ms(50):>8.2f} {r.latency_ms(99):>8.2f} "
              f"{r.server_cpu_ms_per_step:>18.3f} {r.episodes:>8} {r.solved:>7} {r.errors:>6}")
    at64 = next((r for r in rows if r.sessions == 64), rows[-1])
    print(f"summary: env={args.env} sessions={at64.sessions} steps_per_s={at64.steps_per_s:.0f} "
          f"p99_ms={at64.latency_ms(99):.2f}")


if __name__ == "__main__":
    main()
