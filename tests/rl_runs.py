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


# XLA's optimisations back on for a launched job (tests/conftest.py turns them off for the suite, whose
# jobs compile more than they run): for a job that runs more than it compiles, or whose assertion
# rests on the rounding a user's run has.
OPTIMISED = {"JAX_DISABLE_MOST_OPTIMIZATIONS": "0"}


# The smallest RL job the code path allows: a 2-layer, hidden-32 policy, 4 demonstrations, 2 tasks
# x 2 samples a step, 2 held-out tasks; add `workdir`, `train.*` and `horizon_schedule.steps_per_stage`.
TINY_RL_JOB = {
    "sft.num_tasks": 4, "sft.epochs": 2, "sft.batch_size": 4,
    "eval.num_tasks": 2, "eval.horizon": 2,
    "rollout.batch_tasks": 2, "rollout.group_size": 2, "rollout.lock_step": True,
    "algo.num_minibatches": 1,  # the 4 rows, padded to 8, are one row per device of 8 simulated ones
    "rollout.max_tokens_per_turn": 8, "rollout.max_cache_len": 512,
    "horizon_schedule.horizons": "(1,2)",
    "model.hidden_size": 32, "model.intermediate_size": 64, "model.head_dim": 8,
    "tokenizer.vocab_size": 320,
}

# Runs the launcher as a machine without PyTorch would (transformers looks for it with find_spec,
# which answers None for a module set to None in sys.modules).
_WITHOUT_TORCH = ("import runpy, sys; sys.modules['torch'] = None; "
                  "runpy.run_module('agentgym_jax.launch', run_name='__main__', alter_sys=True)")


def launch_command(config_file: str, overrides: dict, without_torch: bool = False) -> list[str]:
    """`python -m agentgym_jax.launch --config=<config_file> --config.<k>=<v> ...`."""
    start = [sys.executable, "-c", _WITHOUT_TORCH] if without_torch else [sys.executable, "-m", "agentgym_jax.launch"]
    return start + [f"--config={config_file}"] + [f"--config.{k}={v}" for k, v in overrides.items()]


def launch(config_file: str, overrides: dict, timeout: float = 1400, without_torch: bool = False,
           extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """The launcher on one CPU device (no simulated devices, as a user runs it), its output
    captured (stderr is not a terminal: progress comes as plain lines)."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "TRANSFORMERS_NO_ADVISORY_WARNINGS")}
    return subprocess.run(launch_command(config_file, overrides, without_torch), cwd=REPO, env={**env, **(extra_env or {})},
                          capture_output=True, text=True, timeout=timeout)


def run_rl_job(config_file: str, overrides: dict, timeout: float = 1400,
               extra_env: dict[str, str] | None = None) -> Summary:
    """`launch` an RL job; its summary line, after checking it ended well."""
    done = launch(config_file, overrides, timeout, extra_env=extra_env)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = SUMMARY.match(done.stdout.strip().splitlines()[-1])
    assert summary, done.stdout[-2000:]
    return Summary(summary[1], int(summary[2]), float(summary[3]), float(summary[4]))
