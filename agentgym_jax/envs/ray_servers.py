"""Environment servers scaled out over a Ray cluster: one server process per Ray actor.

Each actor runs `LocalServers([env])` (our real `python -m environments.serve` process) on its
node, bound to the node's IP on a free port, and reports the URL. The actors are spread over the
cluster's nodes; the URLs go to a job as `--config.env.urls=<url>,<url>,...`, where `EnvPool`
spreads episodes over them and ends only a dead server's episodes with `infra_error`.

    ray.init(address="auto", runtime_env=SHIPPED_CODE)
    with RayEnvServers("textcraft", num_servers=8) as servers:
        print(servers.urls_flag)

A server never outlives its actor: `stop()` shuts the servers down in order, and an actor killed
any other way takes its server with it (`LocalServers` children die with their parent).
`SHIPPED_CODE`, passed to `ray.init`, ships the driver's `agentgym_jax` and `environments`
packages to every worker (Ray `py_modules`), so all nodes run the same code and need only the
dependencies installed.
"""

from __future__ import annotations

import dataclasses
import pathlib

import ray

from agentgym_jax.envs.launcher import LocalServers

_SOURCE_ROOT = pathlib.Path(__file__).resolve().parents[2]  # holds agentgym_jax/ and environments/
# `ray.init(runtime_env=SHIPPED_CODE)`: every worker imports the driver's copy of both packages.
SHIPPED_CODE = {
    "py_modules": [str(_SOURCE_ROOT / "agentgym_jax"), str(_SOURCE_ROOT / "environments")],
    "excludes": ["__pycache__"],
}


@dataclasses.dataclass(frozen=True)
class RayServer:
    """One server: its URL, the node it runs on and its process id there."""

    url: str
    node_ip: str
    pid: int


class _ServerActor:
    """Holds one environment server process for the actor's lifetime."""

    def __init__(self, env: str, host: str | None, **server_kwargs: object):
        self._node_ip = ray.util.get_node_ip_address()
        self._servers = LocalServers([env], host=host or self._node_ip, **server_kwargs)
        self._servers.start()  # raises with the server's output if it cannot start

    def info(self) -> RayServer:
        server = self._servers.servers[0]
        return RayServer(server.url, self._node_ip, server.process.pid)

    def stop(self) -> None:
        self._servers.stop()


class RayEnvServers:
    """`num_servers` servers of `env` as Ray actors; a context manager. Needs `ray.init()` first.

    `host=None` binds each server to its node's IP so that every node can reach it; pass
    `"127.0.0.1"` on a one-machine cluster. Remaining keyword arguments go to `LocalServers`
    (`max_sessions`, `idle_timeout_s`, `auth_token`, `startup_timeout_s`).
    """

    def __init__(
        self,
        env: str,
        num_servers: int,
        *,
        host: str | None = None,
        num_cpus: float = 1.0,
        startup_timeout_s: float = 120.0,
        **server_kwargs: object,
    ):
        if num_servers < 1:
            raise ValueError(f"num_servers must be >= 1, got {num_servers}")
        self.env = env
        self.num_servers = num_servers
        self.host = host
        self.num_cpus = num_cpus
        self.startup_timeout_s = startup_timeout_s
        self.server_kwargs = {**server_kwargs, "startup_timeout_s": startup_timeout_s}
        self.actors: list[ray.actor.ActorHandle] = []
        self.servers: list[RayServer] = []

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers]

    @property
    def urls_flag(self) -> str:
        """The flag that points a job at these servers."""
        return f"--config.env.urls={','.join(self.urls)}"

    def __enter__(self) -> RayEnvServers:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> list[str]:
        """Starts every actor at once (spread over the nodes); returns the URLs once all are healthy."""
        if not ray.is_initialized():
            raise RuntimeError("Ray is not initialised: call ray.init() (or ray.init(address='auto')) first")
        actor_cls = ray.remote(num_cpus=self.num_cpus, max_restarts=0, scheduling_strategy="SPREAD")(_ServerActor)
        try:
            self.actors = [actor_cls.remote(self.env, self.host, **self.server_kwargs) for _ in range(self.num_servers)]
            self.servers = ray.get([a.info.remote() for a in self.actors], timeout=self.startup_timeout_s + 30)
        except BaseException as e:
            self.stop()
            if isinstance(e, ray.exceptions.RayError):
                hint = "" if "No module named" not in str(e) else " (start Ray with ray.init(runtime_env=SHIPPED_CODE))"
                raise RuntimeError(f"{self.env} servers failed to start on the Ray cluster{hint}: {e}") from e
            raise
        return self.urls

    def stop(self) -> None:
        """Stops each server (SIGTERM, then SIGKILL), then ends its actor; dead actors are skipped."""
        stops = [a.stop.remote() for a in self.actors]
        for stop in stops:
            try:
                ray.get(stop, timeout=30)
            except ray.exceptions.RayError:
                pass  # the actor is already gone, and its server went with it
        for actor in self.actors:
            ray.kill(actor)
        self.actors, self.servers = [], []
