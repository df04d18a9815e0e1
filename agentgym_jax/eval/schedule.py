"""What an evaluation or collection plays, from its config, and the run folder's memory of it.

- tasks: `split` ("train", "test" or "" for every id) and `task_ids` ("" all of the split,
  "N" its first N, "a:b" the ids a <= id < b, all of which must be in the split);
- `run.json`: an output folder remembers what it was made with; resuming into it with another
  policy or schedule is refused rather than mixing records.
Servers, policy and pools come from the one job setup (`job/setup.py`: `open_job`, `make_policy`).
"""

from __future__ import annotations

import json
import pathlib

import ml_collections

from agentgym_jax.config import ConfigError
from agentgym_jax.envs.protocol import TaskInfo
from agentgym_jax.parallel import distributed

RUN_SPEC_NAME = "run.json"
SCHEDULE_KEYS = (
    "envs", "policy", "checkpoint_step", "split", "task_ids", "group_size", "seed", "temperature", "horizon",
)


def task_ids(config: ml_collections.ConfigDict, info: TaskInfo) -> list[int]:
    """The scheduled task ids of one environment (see the module docstring)."""
    if config.split:
        if config.split not in info.splits:
            raise ConfigError(f"{info.env} has no split {config.split!r}; splits: {sorted(info.splits)}")
        pool = sorted(info.splits[config.split])
    else:
        pool = list(range(info.num_tasks))
    spec = str(config.task_ids).strip()
    if not spec:
        return pool
    low, sep, high = spec.partition(":")
    if not all(x.strip().isdigit() for x in ((low, high) if sep else (low,))):
        raise ConfigError(f"task_ids must be '', 'N' or 'a:b', got {spec!r}")
    if sep:
        ids = list(range(int(low), int(high)))
        outside = sorted(set(ids) - set(pool))
        if not ids:
            raise ConfigError(f"task_ids={spec!r} is an empty range")
        if outside:
            raise ConfigError(
                f"task ids {outside[:10]} ({len(outside)} in all) are not in {info.env}'s split {config.split!r}"
            )
        return ids
    if not 1 <= int(low) <= len(pool):
        raise ConfigError(f"task_ids={low}: {info.env}'s split {config.split!r} has {len(pool)} tasks")
    return pool[: int(low)]


def check_run_spec(config: ml_collections.ConfigDict, out_dir: pathlib.Path) -> None:
    """Writes `run.json` (process 0), or refuses an `out_dir` that holds a run made with other settings."""
    spec = {key: config[key] for key in SCHEDULE_KEYS}
    path = out_dir / RUN_SPEC_NAME
    if path.exists():
        old = json.loads(path.read_text())
        changed = {k: (old.get(k), v) for k, v in spec.items() if old.get(k) != v}
        if changed:
            raise ConfigError(
                f"{out_dir} holds a run with other settings {changed} (old, new); use another out_dir"
            )
    out_dir.mkdir(parents=True, exist_ok=True)
    distributed.barrier("run-spec-checked")  # every process read the old spec before it is replaced
    if distributed.is_writer():
        path.write_text(json.dumps(spec, indent=2))
