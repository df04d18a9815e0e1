"""Steps per second of an environment server under N concurrent sessions (not a timed test).

    python bench/server_throughput.py --env=maze --sessions=64 --seconds=10
    python bench/server_throughput.py --url=http://127.0.0.1:36001 --action="inventory"

Without `--url` it starts `python -m environments.serve --env=<env> --port=0` itself. With
`--url` it drives any server that speaks the AgentGym protocol (`/create`, `/reset {id,
data_idx}`, `/step {id, action}`), e.g. AgentGym's own FastAPI servers, for a side-by-side
number (pass `--server_pid` to also get its CPU cost). Each session, on its own keep-alive
connection, repeats one valid action (the first of `/available_actions` unless
`--action` is given) and resets when its episode ends. The client shares the CPU with the server,
so on a busy machine compare steps per server CPU-second (read from /proc), which the load
does not change much, rather than steps per wall-clock second.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import pathlib
import re
import subprocess
import sys
import time
import urllib.parse

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


class Connection:
    """One keep-alive HTTP/1.1 connection with a minimal JSON client: the client's own CPU cost
    stays small next to the server's (aiohttp's client costs about as much as a server)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, host: str):
        self.reader, self.writer, self.host = reader, writer, host

    @classmethod
    async def open(cls, url: str) -> Connection:
        parts = urllib.parse.urlsplit(url)
        reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
        return cls(reader, writer, parts.netloc)

    async def call(self, method: str, path: str, body: dict | None = None) -> dict:
        data = json.dumps(body).encode() if body is not None else b""
        self.writer.write(
            f"{method} {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n".encode() + data
        )
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        length = int(re.search(rb"(?i)content-length:\s*(\d+)", head).group(1))
        answer = json.loads(await self.reader.readexactly(length))
        if status != 200 or (isinstance(answer, dict) and "error" in answer):  # AgentGym's servers answer errors with HTTP 200
            raise RuntimeError(f"{method} {path} -> {status}: {answer}")
        return answer

    def close(self) -> None:
        self.writer.close()


async def worker(url: str, data_idx: int, action: str | None, stop_at: float, counts: list[int]) -> None:
    conn = await Connection.open(url)
    prefix = urllib.parse.urlsplit(url).path.rstrip("/")
    session = (await conn.call("POST", f"{prefix}/create", {}))["id"]
    await conn.call("POST", f"{prefix}/reset", {"id": session, "data_idx": data_idx})
    if action is None:
        action = (await conn.call("GET", f"{prefix}/available_actions?id={session}"))["available_actions"][0]
    while time.perf_counter() < stop_at:
        result = await conn.call("POST", f"{prefix}/step", {"id": session, "action": action})
        counts[0] += 1
        if result["done"]:
            await conn.call("POST", f"{prefix}/reset", {"id": session, "data_idx": data_idx})
    await conn.call("POST", f"{prefix}/close", {"id": session})
    conn.close()


async def measure(url: str, pid: int | None, sessions: int, seconds: float, action: str | None,
                  task_id: int | None) -> tuple[float, float | None]:
    """(steps per wall-clock second, steps per server CPU-second or None without a pid)."""
    counts = [0]
    warm_stop = time.perf_counter() + 1.0
    await asyncio.gather(*(worker(url, i if task_id is None else task_id, action, warm_stop, [0]) for i in range(sessions)))
    cpu_start = cpu_seconds(pid) if pid else None
    start = time.perf_counter()
    await asyncio.gather(*(worker(url, i if task_id is None else task_id, action, start + seconds, counts)
                           for i in range(sessions)))
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
    parser.add_argument("--task_id", type=int, default=None, help="one task for all sessions (default: session i plays task i)")
    parser.add_argument("--server_pid", type=int, default=None, help="pid of the --url server, for its CPU time")
    args = parser.parse_args()
    with contextlib.ExitStack() as stack:
        url, pid = (args.url, args.server_pid) if args.url else stack.enter_context(local_server(args.env))
        rate, per_cpu = asyncio.run(measure(url, pid, args.sessions, args.seconds, args.action, args.task_id))
    cpu = f", {per_cpu:.0f} steps per server CPU-second" if per_cpu else ""
    print(f"{args.url or args.env}: {rate:.0f} steps/s with {args.sessions} concurrent sessions{cpu}")


if __name__ == "__main__":
    main()
