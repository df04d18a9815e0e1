"""Steps per second of an environment server under N concurrent sessions (not a timed test).

    python bench/server_throughput.py --env=maze --sessions=64 --seconds=10
    python bench/server_throughput.py --url=http://127.0.0.1:36001 --action="inventory"

Without `--url` it starts `python -m environments.serve --env=<env> --port=0` itself. With
`--url` it drives any server that speaks the AgentGym protocol (`/create`, `/reset {id,
data_idx}`, `/step {id, action}`), e.g. AgentGym's own FastAPI servers, for a side-by-side
number (pass `--server_pid` to also get its CPU cost). Each session repeats one valid action (the first of `/available_actions` unless
`--action` is given) and resets when its episode ends. The client shares the CPU with the server,
so on a busy machine compare steps per server CPU-second (read from /proc), which the load
does not change much, rather than steps per wall-clock second.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import pathlib
import subprocess
import sys
import time

import aiohttp

REPO = pathlib.Path(__file__).resolve().parents[1]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (all its threads) from /proc."""
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def local_server(env: str):
    """Starts our server on a free port; yields (URL, pid)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "environments.serve", f"--env={env}", "--port=0", "--max_sessions=4096"],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE, text=True,
    )
    try:
        line = proc.stdout.readline()
        if not line.startswith("serving "):
            raise RuntimeError(f"server did not start: {line!r}")
        yield line.split(" on ", 1)[1].strip(), proc.pid
    finally:
        proc.kill()
        proc.wait()


async def worker(http: aiohttp.ClientSession, url: str, data_idx: int, action: str | None,
                 stop_at: float, counts: list[int]) -> None:
    async with http.post(f"{url}/create", json={}) as answer:
        session = (await answer.json())["id"]

    async def reset() -> None:
        async with http.post(f"{url}/reset", json={"id": session, "data_idx": data_idx}) as answer:
            assert answer.status == 200, await answer.text()

    await reset()
    if action is None:
        async with http.get(f"{url}/available_actions", params={"id": session}) as answer:
            action = (await answer.json())["available_actions"][0]
    while time.perf_counter() < stop_at:
        async with http.post(f"{url}/step", json={"id": session, "action": action}) as answer:
            assert answer.status == 200, await answer.text()
            result = await answer.json()
        counts[0] += 1
        if result["done"]:
            await reset()
    async with http.post(f"{url}/close", json={"id": session}):
        pass


async def measure(url: str, pid: int | None, sessions: int, seconds: float, action: str | None) -> tuple[float, float | None]:
    """(steps per wall-clock second, steps per server CPU-second or None without a pid)."""
    counts = [0]
    connector = aiohttp.TCPConnector(limit=sessions)
    async with aiohttp.ClientSession(connector=connector) as http:
        warm_stop = time.perf_counter() + 1.0
        await asyncio.gather(*(worker(http, url, i, action, warm_stop, [0]) for i in range(sessions)))
        cpu_start = cpu_seconds(pid) if pid else None
        start = time.perf_counter()
        await asyncio.gather(*(worker(http, url, i, action, start + seconds, counts) for i in range(sessions)))
        wall = time.perf_counter() - start
        per_cpu = counts[0] / (cpu_seconds(pid) - cpu_start) if pid else None
        return counts[0] / wall, per_cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env", default="maze")
    parser.add_argument("--url", default=None, help="an already running server (any AgentGym-protocol server)")
    parser.add_argument("--sessions", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--action", default=None)
    parser.add_argument("--server_pid", type=int, default=None, help="pid of the --url server, for its CPU time")
    args = parser.parse_args()
    with contextlib.ExitStack() as stack:
        url, pid = (args.url, args.server_pid) if args.url else stack.enter_context(local_server(args.env))
        rate, per_cpu = asyncio.run(measure(url, pid, args.sessions, args.seconds, args.action))
    cpu = f", {per_cpu:.0f} steps per server CPU-second" if per_cpu else ""
    print(f"{args.url or args.env}: {rate:.0f} steps/s with {args.sessions} concurrent sessions{cpu}")


if __name__ == "__main__":
    main()
