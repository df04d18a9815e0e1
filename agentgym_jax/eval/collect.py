"""`mode=collect`: a dataset of episodes of the oracle or of a model, resumable.

    python -m agentgym_jax.launch --config=configs/collect.py --config.envs=textcraft --config.task_ids=0:500

Writes to `out_dir`:
- `trajectories.jsonl`: our token-exact records, one per (env, task, sample, attempt), appended
  batch by batch with a progress bar; an interrupted collection restarted with the same command
  plays only what is missing (`rollout/collect.py`), never a duplicate;
- `agentgym.json`: AgentGym's conversation format (`item_id` like `textcraft_12`,
  `conversations` of `from`/`value`/`loss`, plus `reward`, `success`, `status`) of the record that
  counts for every (task, sample), infrastructure failures left out (`only_successful`: keep
  successes only, as AgentTraj does).
With several processes, each plays its share into its own `trajectories.p<k>.jsonl`; process 0
writes `agentgym.json` from every process's records.
"""

from __future__ import annotations

import pathlib

import ml_collections
from absl import logging

from agentgym_jax.eval.runner import TRAJECTORIES_NAME, play_schedule
from agentgym_jax.eval.schedule import check_run_spec, task_ids
from agentgym_jax.job import setup
from agentgym_jax.parallel import distributed
from agentgym_jax.parallel.distributed import is_writer
from agentgym_jax.rollout import agentgym_format
from agentgym_jax.rollout.collect import last_attempts
from agentgym_jax.rollout.trajectory import Trajectory

AGENTGYM_NAME = "agentgym.json"


def dataset_records(records: list[Trajectory], envs: list[str], only_successful: bool) -> list[Trajectory]:
    """The counted record of each (env, task, sample), sorted; scored ones (or successes) only."""
    out = []
    for env in envs:
        for _, t in sorted(last_attempts(records, env).items()):
            if t.status.is_scored and (t.success or not only_successful):
                out.append(t)
    return out


def run(config: ml_collections.ConfigDict) -> list[Trajectory]:
    out_dir = pathlib.Path(config.out_dir)
    distributed.initialize_distributed()
    check_run_spec(config, out_dir)
    with setup.open_job(config) as job:
        infos = job.infos
        policy, framing = setup.make_policy(config, infos, out_dir)
        records = play_schedule(
            policy, {env: job.pool(env) for env in infos}, infos, {env: task_ids(config, info) for env, info in infos.items()},
            out_dir, group_size=config.group_size, horizon=config.horizon, seed=config.seed,
            max_attempts=config.max_attempts, batch_episodes=config.batch_episodes,
        )
    dataset = dataset_records(records, list(infos), config.only_successful)
    if not is_writer():
        return dataset
    agentgym_format.export_file(out_dir / AGENTGYM_NAME, dataset, framing)
    successes = sum(t.success for t in dataset)
    logging.info("collected %d records into %s", len(records), out_dir)
    print(f"summary: envs={','.join(infos)} records={len(records)} dataset_items={len(dataset)} "
          f"successes={successes} out_dir={out_dir} files={TRAJECTORIES_NAME},{AGENTGYM_NAME}")
    return dataset
