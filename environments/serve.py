"""Runs one environment server: `python -m environments.serve --env=maze --port=8000`.

`--env` is a registered name (`environments/registry.py`) or `package.module:Class` for an
`Environment` subclass of your own; `--perturbation` wraps it (`environments/perturbation.py`). Binds 127.0.0.1 unless told otherwise; `--port=0` takes a
free port. Prints `serving <env> on http://<host>:<port>` once it accepts connections.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import ctypes.util
import importlib
import logging
import os
import signal
import socket
import sys

from aiohttp import web

from environments import registry
from environments.base import Environment
from environments.perturbation import Perturbation, perturbed
from environments.server import DEFAULT_MAX_ACTION_CHARS, DEFAULT_MAX_BODY_BYTES, make_app

_PR_SET_PDEATHSIG = 1


def resolve_environment(spec: str) -> type[Environment]:
    """A registered name or `module:Class` -> the environment class; a clear error otherwise."""
    if ":" in spec:
        module, _, name = spec.partition(":")
        try:
            loaded = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name != module.split(".")[0]:
                raise  # a module the user's module imports
            raise ValueError(f"--env={spec}: no module named {module!r} here; run from the folder that holds it, "
                             "or add that folder to PYTHONPATH") from None
        cls = getattr(loaded, name, None)
        if not (isinstance(cls, type) and issubclass(cls, Environment)):
            raise ValueError(f"{spec!r} is not an Environment subclass")
        return cls
    return registry.get_environment(spec)


class MissingPackage(Exception):
    """An environment whose engine or data package is not installed."""


def missing_package(env: str, error: ModuleNotFoundError) -> str | None:
    """One line for a registered environment whose package is missing, naming the install that
    brings every environment's; None for anything else (a module of the project's own missing is
    a bug, a `module:Class` of the user's is theirs)."""
    package = (error.name or "").split(".")[0]
    if env not in registry.ENVIRONMENTS or not package or package in ("environments", "agentgym_jax"):
        return None
    return (f"the {env} environment needs the Python package {package!r}, which is not installed: "
            f'pip install -e ".[envs]" installs every environment\'s packages')


def _exit_with_parent(parent_pid: int) -> None:
    """Linux: SIGKILL this server when the process that started it dies (PR_SET_PDEATHSIG);
    exits at once if it is gone already. Set here, after exec, so the parent starts us without
    running Python between fork and exec (which JAX's threads make unsafe)."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        sys.exit(f"error: the process that started this server ({parent_pid}) is gone")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m environments.serve", description=__doc__.splitlines()[0])
    parser.add_argument("--env", required=True, help=f"one of {', '.join(sorted(registry.ENVIRONMENTS))}, or module:Class")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    parser.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    parser.add_argument("--auth_token", default=None, help="require `Authorization: Bearer <token>` (all but /health)")
    parser.add_argument("--max_sessions", type=int, default=None,
                        help="past it /create answers 503 (default: the environment's own, 1024; for sciworld "
                             "and miniwob what half the machine's memory holds; /health names it)")
    parser.add_argument("--idle_timeout_s", type=float, default=900.0, help="sessions idle this long are closed")
    parser.add_argument("--max_body_bytes", type=int, default=DEFAULT_MAX_BODY_BYTES, help="larger bodies get 413")
    parser.add_argument("--max_action_chars", type=int, default=DEFAULT_MAX_ACTION_CHARS,
                        help="a longer /step action is an invalid turn the environment never sees")
    parser.add_argument("--threads", type=int, default=None, help="thread pool size for blocking environments")
    parser.add_argument("--perturbation", default="",
                        help="perturb every session, e.g. noise=0.05,truncate=300,tool_failure=0.1,schema_change=3,"
                             "hidden_tools=2 (environments/perturbation.py); /tasks names it in metadata")
    parser.add_argument("--agentgym_errors", action="store_true",
                        help="answer refusals and environment failures as HTTP 200 {\"error\"} (AgentGym's "
                             "servers' way, for their unchanged clients); default: real HTTP statuses")
    parser.add_argument("--parent_pid", type=int, default=None,
                        help="die with this process (Linux), as a launcher's child server does")
    return parser.parse_args(argv)


async def serve(args: argparse.Namespace, env_cls: type[Environment]) -> None:
    try:  # the environment loads its engine and task data here
        app = make_app(
            env_cls,
            max_sessions=args.max_sessions,
            idle_timeout_s=args.idle_timeout_s,
            auth_token=args.auth_token,
            max_body_bytes=args.max_body_bytes,
            max_action_chars=args.max_action_chars,
            threads=args.threads,
            agentgym_errors=args.agentgym_errors,
        )
    except ModuleNotFoundError as e:
        message = missing_package(args.env, e)
        if message is None:
            raise
        raise MissingPackage(message) from e
    runner = web.AppRunner(app, access_log=None)  # no per-request logging on the hot path
    await runner.setup()
    sock = socket.create_server((args.host, args.port), backlog=1024, reuse_port=False)
    site = web.SockSite(runner, sock)
    await site.start()
    host, port = sock.getsockname()[:2]
    host = f"[{host}]" if ":" in host else host  # IPv6 literal
    print(f"serving {env_cls.name} on http://{host}:{port}", flush=True)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()  # closes every open session


def main(argv: list[str] | None = None) -> None:
    """Serves until SIGINT or SIGTERM. A server that cannot start says why in one line,
    `error: ...`, and exits 1 (a launcher passes that line on)."""
    args = parse_args(argv)
    if args.parent_pid is not None:
        _exit_with_parent(args.parent_pid)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        env_cls = perturbed(resolve_environment(args.env), Perturbation.parse(args.perturbation))
    except ModuleNotFoundError as e:
        sys.exit(f"error: {missing_package(args.env, e) or e}")
    except (KeyError, ValueError, ImportError) as e:
        sys.exit(f"error: {e.args[0] if isinstance(e, KeyError) else e}")
    try:
        asyncio.run(serve(args, env_cls))
    except MissingPackage as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
