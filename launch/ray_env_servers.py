"""Starts environment servers across a Ray cluster and keeps them up until Ctrl-C (or SIGTERM).

    ray start --head                      # on one node; `ray start --address=<head>:6379` on the others
    python launch/ray_env_servers.py --env=textcraft --num_servers=16
    # prints: --config.env.urls=http://10.0.0.5:40123,http://10.0.0.6:38011,...
    python -m agentgym_jax.launch --config=configs/textcraft_grpo.py --config.env.urls=...

Each server is one Ray actor (`agentgym_jax/envs/ray_servers.py`, which also ships this
checkout's code to the nodes) bound to its node's IP on a free port, reachable from every node of the cluster (and from anything else on that network:
use `--auth_token` where that matters). Without a cluster, `--address=local` starts a
one-machine Ray.
"""

from __future__ import annotations

import argparse
import pathlib
import signal
import sys
import threading

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # run from a checkout

import ray  # noqa: E402

from agentgym_jax.envs.ray_servers import SHIPPED_CODE, RayEnvServers  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env", required=True, help="an environment name from environments/registry.py")
    parser.add_argument("--num_servers", type=int, default=2, help="server processes (Ray actors), spread over the nodes")
    parser.add_argument("--address", default="auto", help="Ray cluster address; 'local' starts a one-machine Ray")
    parser.add_argument("--host", default=None, help="address to bind (default: each node's IP)")
    parser.add_argument("--num_cpus", type=float, default=1.0, help="CPUs Ray reserves per server")
    parser.add_argument("--max_sessions", type=int, default=1024, help="per server; past it /create answers 503")
    parser.add_argument("--idle_timeout_s", type=float, default=900.0, help="sessions idle this long are closed")
    parser.add_argument("--auth_token", default="", help="require `Authorization: Bearer <token>`")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    ray.init(address=None if args.address == "local" else args.address, runtime_env=SHIPPED_CODE)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    servers = RayEnvServers(
        args.env, args.num_servers, host=args.host, num_cpus=args.num_cpus,
        max_sessions=args.max_sessions, idle_timeout_s=args.idle_timeout_s, auth_token=args.auth_token,
    )
    with servers:
        for server in servers.servers:
            print(f"{args.env} server on {server.url} (node {server.node_ip}, pid {server.pid})", flush=True)
        print(servers.urls_flag, flush=True)
        print("serving until Ctrl-C", flush=True)
        stop.wait()
    ray.shutdown()


if __name__ == "__main__":
    main()
