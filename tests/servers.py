"""Starts real environment servers (`python -m environments.serve`) for tests.

    from tests.servers import start_server

    with start_server("maze", max_sessions=8) as url:   # url = "http://127.0.0.1:<port>"
        ...

    @pytest.fixture(scope="module")
    def maze_url():
        with start_server("maze") as url:
            yield url

`request_json(url, "POST", "/step", {"id": 0, "action": "move up"})` -> `(status, body)` is a
small synchronous HTTP call for tests; 4xx/5xx answers come back as values, not exceptions.

`server_pid(url)` is the process listening at the URL (to look at its engine children).

`with health_latencies(url) as seconds:` polls `/health` from another process while the block
runs; afterwards `seconds` holds each answer's latency (e.g. to show the server stayed responsive).

Keyword arguments become `--key=value` flags of `environments.serve` (`key=True`: a bare `--key`); `env_vars` adds to the
subprocess environment (e.g. `{"PYTHONHASHSEED": "1"}`). The server binds a free port on
127.0.0.1, the call returns once `/health` answers, and the process is killed on exit.

`uid=N` (from root) runs the server as that unprivileged uid: `setpriv` drops to it keeping only
CAP_DAC_READ_SEARCH, which the interpreter under /root (mode 700 on these machines) needs to
start, and the server clears that from what its children inherit before it serves, so bwrap,
the sandboxes and everything else it starts run as a plain uid.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, Iterator

import psutil

REPO = pathlib.Path(__file__).resolve().parents[1]


# An unprivileged server's start: no ambient capability for its children, then `environments.serve`.
_AS_UID = ("import ctypes, runpy, sys\n"
           "ctypes.CDLL(None).prctl(47, 4, 0, 0, 0)  # PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL\n"
           "runpy.run_module('environments.serve', run_name='__main__', alter_sys=True)\n")


@contextlib.contextmanager
def start_server(env: str, *, env_vars: dict[str, str] | None = None, timeout_s: float = 60.0,
                 uid: int | None = None, **flags: object) -> Iterator[str]:
    """Runs `python -m environments.serve --env=<env> --port=0 ...` (as `uid` if given) and yields its base URL."""
    flags.setdefault("port", 0)
    cmd = [sys.executable, "-m", "environments.serve", f"--env={env}"]
    if uid is not None:
        cmd = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--inh-caps=+dac_read_search",
               "--ambient-caps=+dac_read_search", sys.executable, "-c", _AS_UID, f"--env={env}"]
    cmd += [f"--{key}" if value is True else f"--{key}={value}" for key, value in flags.items()]
    proc_env = {**os.environ, **(env_vars or {})}
    proc_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), proc_env.get("PYTHONPATH")]))
    proc = subprocess.Popen(cmd, cwd=REPO, env=proc_env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    output: list[str] = []
    ready = threading.Event()

    def drain() -> None:  # keeps the pipe empty so the server never blocks on a full buffer
        for line in proc.stdout:
            output.append(line)
            if line.startswith("serving "):
                ready.set()
        ready.set()

    threading.Thread(target=drain, daemon=True).start()
    try:
        url = _wait_ready(proc, ready, output, timeout_s, cmd)
        yield url
    finally:
        proc.kill()
        proc.wait(timeout=30)


def _wait_ready(proc: subprocess.Popen, ready: threading.Event, output: list[str],
                timeout_s: float, cmd: list[str]) -> str:
    deadline = time.monotonic() + timeout_s
    ready.wait(timeout_s)
    line = next((l for l in output if l.startswith("serving ")), None)
    if line is None:
        proc.kill()
        raise RuntimeError(f"server did not start: {' '.join(cmd)}\n{''.join(output)[-4000:]}")
    url = line.split(" on ", 1)[1].strip()
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as answer:
                if answer.status == 200:
                    return url
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(0.05)
    raise RuntimeError(f"server at {url} never answered /health: {' '.join(cmd)}\n{''.join(output)[-4000:]}")


def request_json(url: str, method: str, path: str, body: Any = None, *, data: bytes | None = None,
                 headers: dict[str, str] | None = None, timeout_s: float = 30.0) -> tuple[int, Any]:
    """One HTTP call; `body` is sent as JSON (or `data` as raw bytes). Returns (status, parsed JSON).

    Fails the test when the answer is not JSON: every answer of our servers is.
    """
    if body is not None:
        data = json.dumps(body).encode()
    request = urllib.request.Request(url + path, data=data, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as answer:
            status, raw, kind = answer.status, answer.read(), answer.headers.get_content_type()
    except urllib.error.HTTPError as e:
        status, raw, kind = e.code, e.read(), e.headers.get_content_type()
    assert kind == "application/json", f"{method} {path} -> {status} {kind}: {raw[:200]!r}"
    return status, json.loads(raw)


def server_pid(url: str) -> int:
    port = urllib.parse.urlparse(url).port
    return next(c.pid for c in psutil.net_connections("tcp") if c.laddr and c.laddr.port == port and c.status == "LISTEN")


_HEALTH_PROBE = """
import json, sys, threading, time, urllib.request
url, interval_s, min_probes = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
seconds = []
while not stop.is_set() or len(seconds) < min_probes:
    start = time.monotonic()
    with urllib.request.urlopen(url + "/health", timeout=30) as answer:
        answer.read()
    seconds.append(time.monotonic() - start)
    if len(seconds) == 1:
        print("ready", flush=True)
    time.sleep(interval_s)
print(json.dumps(seconds), flush=True)
"""


@contextlib.contextmanager
def health_latencies(url: str, interval_s: float = 0.005, min_probes: int = 10) -> Iterator[list[float]]:
    """Polls `/health` every `interval_s` from a separate process (so the test's own work, such as
    encoding megabytes of JSON, cannot delay it) while the block runs, and on until it has
    `min_probes` answers (a block that ends quickly still measures something); fills the list on exit."""
    probe = subprocess.Popen([sys.executable, "-c", _HEALTH_PROBE, url, str(interval_s), str(min_probes)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    seconds: list[float] = []
    try:
        assert probe.stdout.readline().strip() == "ready", "the /health probe did not start"
        yield seconds
    finally:
        out, _ = probe.communicate(input="", timeout=60)
        seconds.extend(json.loads(out.splitlines()[-1]) if out.strip() else [])
