"""ScienceWorld session start-up with and without the warm engine pool.

    python bench/sciworld_pool.py            # pool sizes 0 and 2, 6 sessions one after another

For each pool size a server is started (`SCIWORLD_POOL_SIZE`) and left 30 s to warm; then each
session is timed for /create, its first /reset, and its /step latency over a short fixed script,
and closed before the next one opens (the pattern of a client that opens a session per episode).
"""

from __future__ import annotations

import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from tests.servers import request_json, start_server  # noqa: E402

SCRIPT = ["open door to hallway", "go to hallway", "look around", "inventory", "wait1"]
TASKS = [3201, 3475, 3798, 4071, 2136, 537]  # find-*, test-conductivity, use-thermometer test ids


def timed(url: str, method: str, path: str, body: dict | None = None) -> tuple[float, dict]:
    start = time.perf_counter()
    status, answer = request_json(url, method, path, body, timeout_s=300)
    assert status == 200, answer
    return time.perf_counter() - start, answer


def main() -> None:
    for pool_size in (0, 2):
        with start_server("sciworld", env_vars={"SCIWORLD_POOL_SIZE": str(pool_size)}, timeout_s=120) as url:
            time.sleep(30)
            creates, resets, steps = [], [], []
            for task in TASKS:
                t_create, created = timed(url, "POST", "/create", {})
                t_reset, _ = timed(url, "POST", "/reset", {"id": created["id"], "data_idx": task})
                steps += [timed(url, "POST", "/step", {"id": created["id"], "action": a})[0] for a in SCRIPT]
                creates.append(t_create)
                resets.append(t_reset)
                timed(url, "POST", "/close", {"id": created["id"]})
            print(f"pool={pool_size} create_s median={statistics.median(creates):.2f} max={max(creates):.2f} "
                  f"first_reset_s median={statistics.median(resets):.2f} max={max(resets):.2f} "
                  f"step_ms median={1000 * statistics.median(steps):.1f} p90={1000 * statistics.quantiles(steps, n=10)[-1]:.1f}",
                  flush=True)


if __name__ == "__main__":
    main()
