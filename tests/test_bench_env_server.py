"""bench/env_server.py stays runnable: a tiny run against our Maze server."""

import re
import subprocess
import sys

from tests.servers import REPO


def test_bench_replays_solving_oracle_actions_and_prints_the_summary():
    done = subprocess.run(
        [sys.executable, "bench/env_server.py", "--env=maze", "--sessions=1,4", "--seconds=0.5", "--tasks=4"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    rows = [l.split() for l in lines if re.match(r"\s+[14]\s", l)]
    assert [r[0] for r in rows] == ["1", "4"]
    for sessions, steps_per_s, p50, p99, cpu, episodes, solved, errors in rows:
        assert float(steps_per_s) > 0 and float(p50) <= float(p99) and errors == "0"
        assert episodes == solved  # recorded oracle actions solve the same task ids on our server
    assert re.fullmatch(r"summary: env=maze sessions=4 steps_per_s=\d+ p99_ms=[\d.]+", lines[-1])
