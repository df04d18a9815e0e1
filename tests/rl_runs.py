"""Jobs run through the launcher as a user runs them: an RL job read back from its last line, and
the environment of launches that restart one another."""

import dataclasses
import os
import pathlib
import re
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
SUMMARY = re.compile(
    r"^summary: env=(\w+) heldout_tasks=(\d+) success_before=([\d.]+) success_after=([\d.]+) minutes=([\d.]+)$"
)


@dataclasses.dataclass(frozen=True)
class Summary:
    env: str
    tasks: int
    before: float
    after: float


def with_compile_cache(env: dict[str, str], cache: pathlib.Path) -> dict[str, str]:
    """`env` plus a persistent compilation cache in `cache`: a later launch of the same job loads
    what an earlier one compiled, as a restarted job does (an entry a SIGKILL cut short is an
    unreadable entry, which JAX warns about and compiles again)."""
    return {**env, "JAX_COMPILATION_CACHE_DIR": str(cache), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}


def run_rl_job(config_file: str, overrides: dict, timeout: float = 1400) -> Summary:
    """`python -m agentgym_jax.launch --config=<config_file> --config.<k>=<v> ...` on one CPU device
    (no simulated devices, as a user runs it); its summary line, after checking it ended well."""
    command = [sys.executable, "-m", "agentgym_jax.launch", f"--config={config_file}"]
    command += [f"--config.{k}={v}" for k, v in overrides.items()]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = SUMMARY.match(done.stdout.strip().splitlines()[-1])
    assert summary, done.stdout[-2000:]
    return Summary(summary[1], int(summary[2]), float(summary[3]), float(summary[4]))
