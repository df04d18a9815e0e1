"""Local environment servers as child processes, and `mode=serve`.

`LocalServers(["maze", "textcraft"])` starts `python -m environments.serve --env=<name>` per
environment (with `perturbation=...`, each wrapped by `--perturbation`) on a free port of
127.0.0.1, waits until each answers `/health`, and stops them on exit. The children never
outlive the launcher: the context manager and `atexit` stop them on errors and Ctrl-C, and on
Linux `prctl(PR_SET_PDEATHSIG)` kills them even when the launcher is SIGKILLed (the signal fires
when the thread that started them ends, so start them from a thread that lives as long as you
need them). The server sets that itself (`--parent_pid`): a child is
started without running Python between fork and exec, which is safe after JAX has started its
threads (an eval job starts its servers after it has asked JAX for its processes).

A server that refuses to start (an unknown environment, a missing package) says why in one line;
that line is the `ServerRefused` error, a `ConfigError` that the launcher prints as one line.

    python -m agentgym_jax.launch --config=configs/serve.py --config.envs=maze,wordle
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import dataclasses
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Sequence

import ml_collections
from absl import logging

from agentgym_jax.aio import run_sync
from agentgym_jax.config import ConfigError
from agentgym_jax.envs.pool import EnvPool, PlayedEpisode
from agentgym_jax.envs.protocol import EpisodeStatus

_REPO = pathlib.Path(__file__).resolve().parents[2]
_OUTPUT_LINES_KEPT = 50


class ServerRefused(ConfigError):
    """A server that exited at start-up with its own one-line reason (`error: ...`)."""


@dataclasses.dataclass
class ServerProcess:
    """One running server: its environment, URL once known, process and last output lines."""

    env: str
    process: subprocess.Popen
    url: str = ""
    output: collections.deque = dataclasses.field(default_factory=lambda: collections.deque(maxlen=_OUTPUT_LINES_KEPT))
    ready: threading.Event = dataclasses.field(default_factory=threading.Event)
    drained: threading.Event = dataclasses.field(default_factory=threading.Event)  # its output has ended

    def describe_exit(self) -> str:
        return f"{self.env} server exited with code {self.process.returncode}:\n" + "".join(self.output)

    def refusal(self) -> str | None:
        """The server's own reason for not starting: its last line, when it is `error: <reason>`."""
        last = "".join(self.output).strip().splitlines()[-1:]
        return last[0].removeprefix("error: ") if last and last[0].startswith("error: ") else None


class LocalServers:
    """A group of local environment servers; a context manager. `urls` maps env -> base URL."""

    def __init__(
        self,
        envs: Sequence[str],
        *,
        host: str = "127.0.0.1",
        base_port: int = 0,
        max_sessions: int | None = None,  # None: each environment's own default (`Environment.max_sessions`)
        idle_timeout_s: float = 900.0,
        auth_token: str = "",
        startup_timeout_s: float = 120.0,
        perturbation: str = "",  # e.g. "noise=0.05,truncate=400": every server perturbed (environments/perturbation.py)
    ):
        if not envs:
            raise ValueError("no environments to serve")
        if len(set(envs)) != len(envs):
            raise ValueError(f"environments listed twice: {list(envs)}")
        self.envs = list(envs)
        self.host = host
        self.base_port = base_port
        self.max_sessions = max_sessions
        self.idle_timeout_s = idle_timeout_s
        self.auth_token = auth_token
        self.startup_timeout_s = startup_timeout_s
        self.perturbation = perturbation
        self.servers: list[ServerProcess] = []

    @property
    def urls(self) -> dict[str, str]:
        return {s.env: s.url for s in self.servers}

    def __enter__(self) -> LocalServers:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        """Starts every server at once, then waits for each to answer `/health`."""
        atexit.register(self.stop)
        try:
            for i, env in enumerate(self.envs):
                self.servers.append(self._spawn(env, self.base_port + i if self.base_port else 0))
            deadline = time.monotonic() + self.startup_timeout_s
            for server in self.servers:
                self._wait_ready(server, deadline)
        except BaseException:
            self.stop()
            raise

    def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM to every server, SIGKILL to those still up after `grace_s`."""
        atexit.unregister(self.stop)
        for server in self.servers:
            if server.process.poll() is None:
                server.process.terminate()
        deadline = time.monotonic() + grace_s
        for server in self.servers:
            try:
                server.process.wait(max(deadline - time.monotonic(), 0.0))
            except subprocess.TimeoutExpired:
                server.process.kill()
                server.process.wait()
        self.servers = []

    def check_alive(self) -> None:
        """Raises `RuntimeError` with its last output if any server has exited."""
        for server in self.servers:
            if server.process.poll() is not None:
                raise RuntimeError(server.describe_exit())

    def _spawn(self, env: str, port: int) -> ServerProcess:
        cmd = [
            sys.executable, "-m", "environments.serve", f"--env={env}", f"--host={self.host}",
            f"--port={port}", f"--idle_timeout_s={self.idle_timeout_s}", f"--parent_pid={os.getpid()}",
        ]
        if self.max_sessions is not None:
            cmd.append(f"--max_sessions={self.max_sessions}")
        if self.auth_token:
            cmd.append(f"--auth_token={self.auth_token}")
        if self.perturbation:
            cmd.append(f"--perturbation={self.perturbation}")
        env_vars = dict(os.environ)
        env_vars["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_REPO), env_vars.get("PYTHONPATH")]))
        process = subprocess.Popen(  # no preexec_fn: nothing but exec runs in the forked child
            cmd, cwd=_REPO, env=env_vars, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True,
            start_new_session=True,  # Ctrl-C reaches only us; we stop the children in order
        )
        server = ServerProcess(env, process)
        threading.Thread(target=self._drain, args=(server,), daemon=True, name=f"{env}-server-output").start()
        return server

    @staticmethod
    def _drain(server: ServerProcess) -> None:
        """Keeps the child's pipe empty, learns its URL from `serving <env> on <url>`."""
        assert server.process.stdout is not None
        for line in server.process.stdout:
            server.output.append(line)
            if not server.url and line.startswith("serving ") and " on " in line:
                server.url = line.split(" on ", 1)[1].strip()
                server.ready.set()
            elif server.url:
                logging.info("[%s server] %s", server.env, line.rstrip())
        server.ready.set()
        server.drained.set()

    def _wait_ready(self, server: ServerProcess, deadline: float) -> None:
        server.ready.wait(max(deadline - time.monotonic(), 0.0))
        while time.monotonic() < deadline and server.process.poll() is None:
            if server.url and _healthy(server.url):
                return
            time.sleep(0.05)
        if server.process.poll() is not None:
            server.drained.wait(5.0)  # its last lines, the reason among them
            if (reason := server.refusal()) is not None:
                raise ServerRefused(f"the {server.env} server did not start: {reason}")
            raise RuntimeError(f"{server.env} server failed to start: {server.describe_exit()}")
        raise TimeoutError(f"{server.env} server not healthy after {self.startup_timeout_s} s:\n" + "".join(server.output))


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as answer:
            return answer.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


async def play_oracle_episode(url: str, auth_token: str = "", horizon: int = 500) -> PlayedEpisode:
    """Plays the first test task (or the first task) of the server's environment with its oracle."""
    async with EnvPool(url, auth_token=auth_token, max_concurrency=4) as pool:
        info = await pool.tasks()
        split = info.splits.get("test") or next(ids for ids in info.splits.values() if ids)
        return await pool.run_episode(split[0], pool.oracle_policy, horizon=horizon)


async def _gather(*episodes: Awaitable[PlayedEpisode]) -> list[PlayedEpisode]:
    return list(await asyncio.gather(*episodes))


def _raise_system_exit(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def run(config: ml_collections.ConfigDict) -> None:
    """`mode=serve`: start the servers, play one oracle episode per environment, serve until Ctrl-C."""
    envs = [name.strip() for name in config.envs.split(",") if name.strip()]
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _raise_system_exit)  # `kill` stops the children in order too
        # Ctrl-C stops them in order even when SIGINT came in ignored (e.g. started from a
        # non-interactive shell's background job), where Python installs no handler of its own.
        signal.signal(signal.SIGINT, signal.default_int_handler)
    servers = LocalServers(
        envs, host=config.host, base_port=config.base_port, max_sessions=config.max_sessions or None,
        idle_timeout_s=config.session_idle_timeout_s, auth_token=config.auth_token,
        perturbation=config.perturbation,
    )
    with servers:
        for env, url in servers.urls.items():
            logging.info("%s server on %s", env, url)
            print(f"{env}: {url}", flush=True)
        if config.play_oracle_episode:
            urls = servers.urls
            episodes = run_sync(_gather(*(play_oracle_episode(url, config.auth_token) for url in urls.values())))
            for env, episode in zip(urls, episodes):
                success = episode.status is EpisodeStatus.SUCCESS
                print(
                    f"oracle episode: env={env} task={episode.data_idx} turns={len(episode.turns)} "
                    f"reward={episode.reward:.3g} success={success} status={episode.status.value}",
                    flush=True,
                )
                if not success:
                    raise RuntimeError(f"{env}'s oracle failed task {episode.data_idx}: {episode.status.value} "
                                       f"{episode.error or ''}; last turn: {episode.turns[-1:]}")
        if not config.serve_forever:
            return
        try:
            print("serving until Ctrl-C", flush=True)
            while True:
                servers.check_alive()
                time.sleep(0.5)
        except KeyboardInterrupt:
            logging.info("Ctrl-C: stopping the servers")
