"""`mode=eval`: a policy on the tasks of one or many environments, with honest accounting.

    python -m agentgym_jax.launch --config=configs/eval.py --config.policy=checkpoint:runs/quickstart

Per environment, every (task, sample) is played (`rollout/collect.py`: batches, retries of
infrastructure errors as new attempts, `trajectories.jsonl` written as it goes, resumable), then
`eval/accounting.py` summarizes the records against the schedule and `eval/report.py` writes
summary.json, summary.md and the PNG plots to `out_dir`. Definitions: docs/evaluation.md.
Servers, policy and pools come from the one job setup (`job/setup.py`); the episodes are played
by the one evaluation every mode uses (`job/play.evaluate`).
With several processes, each plays its share of the tasks into its own `trajectories.p<k>.jsonl`,
and process 0 summarizes every process's records and writes the report once.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Mapping, Sequence

import ml_collections
from absl import logging

from agentgym_jax.config import ConfigError
from agentgym_jax.envs.pool import EnvPool
from agentgym_jax.envs.protocol import TaskInfo
from agentgym_jax.eval import perturbed
from agentgym_jax.eval.accounting import EvalSummary, summarize
from agentgym_jax.eval.report import markdown_table, write_report
from agentgym_jax.eval.schedule import check_run_spec, task_ids
from agentgym_jax.gateway import episodes as agent_episodes
from agentgym_jax.gateway.agents import AgentSpec
from agentgym_jax.job import play, setup
from agentgym_jax.models.chat import ChatFraming
from agentgym_jax.parallel import distributed
from agentgym_jax.parallel.distributed import is_writer
from agentgym_jax.rollout.collect import ModelPolicy, Policy, resume_jsonl
from agentgym_jax.rollout.trajectory import Trajectory

TRAJECTORIES_NAME = "trajectories.jsonl"
SCHEDULE_NAME = "schedule.json"  # what `load_summary` (and `eval/compare.py`) needs to recount a run


def play_schedule(
    policy: Policy,
    pools: Mapping[str, EnvPool],
    infos: Mapping[str, TaskInfo],
    schedule: Mapping[str, Sequence[int]],
    out_dir: pathlib.Path,
    **play_kwargs,
) -> list[Trajectory]:
    """Every environment's scheduled episodes (`job/play.evaluate`, each process its share), one
    environment after the other, into this process's `trajectories.jsonl`; every process's records."""
    return [t for env, pool in pools.items() if schedule[env]
            for t in play.evaluate(policy, pool, infos[env], schedule[env], out_dir / TRAJECTORIES_NAME, **play_kwargs)]


def report(
    policy: Policy,
    pools: Mapping[str, EnvPool],
    infos: Mapping[str, TaskInfo],
    schedule: Mapping[str, Sequence[int]],
    out_dir: str | pathlib.Path,
    *,
    group_size: int,
    horizon: int,
    seed: int,
    max_attempts: int = 1,
    batch_episodes: int = 64,
) -> EvalSummary:
    """Plays the schedule (env -> task ids) with unopened `pools` and accounts for it; process 0
    writes the report of every process's episodes."""
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    thresholds = {env: info.success_threshold for env, info in infos.items()}
    schedule_record = {"group_size": group_size, "thresholds": thresholds,
                       "task_ids": {env: list(map(int, ids)) for env, ids in schedule.items()}}
    if is_writer():
        (out_dir / SCHEDULE_NAME).write_text(json.dumps(schedule_record, indent=1))
    records = play_schedule(policy, pools, infos, schedule, out_dir, group_size=group_size, horizon=horizon, seed=seed,
                            max_attempts=max_attempts, batch_episodes=batch_episodes)
    summary = summarize(records, thresholds, group_size, schedule)
    if is_writer():
        write_report(summary, str(out_dir))
    return summary


def trajectory_files(out_dir: pathlib.Path) -> list[pathlib.Path]:
    """The run's trajectory files: `trajectories.jsonl`, or one per process (`trajectories.p<k>.jsonl`)."""
    paths = [out_dir / TRAJECTORIES_NAME, *sorted(out_dir.glob(TRAJECTORIES_NAME.replace(".jsonl", ".p*.jsonl")))]
    return [p for p in paths if p.exists()]


def load_summary(out_dir: str | pathlib.Path) -> EvalSummary:
    """Recounts a finished (or interrupted: missing episodes count) run from its files."""
    out_dir = pathlib.Path(out_dir)
    schedule = json.loads((out_dir / SCHEDULE_NAME).read_text())
    records: list[Trajectory] = [t for path in trajectory_files(out_dir) for t in resume_jsonl(path)]
    return summarize(records, schedule["thresholds"], schedule["group_size"], schedule["task_ids"])


def run(config: ml_collections.ConfigDict) -> EvalSummary:
    """`mode=eval`; with `perturbations`, one evaluation per setting and their gap (`eval/perturbed.py`)."""
    out_dir = pathlib.Path(config.out_dir)
    distributed.initialize_distributed()
    settings = perturbed.settings(config.get("perturbations", ""))
    if len(settings) == 1:
        return run_setting(config, out_dir)[0]
    if config.env.urls or config.env.get("perturbation", ""):
        raise ConfigError("perturbations start local servers per setting: leave env.urls and env.perturbation empty "
                          "(for servers of your own, evaluate each into its own out_dir and use eval.compare)")
    summaries, policy = {}, None
    for setting in settings:
        one = ml_collections.ConfigDict(config.to_dict())
        one.env.perturbation = setting
        one.out_dir = str(out_dir / perturbed.folder(setting))
        summaries[setting], policy = run_setting(one, pathlib.Path(one.out_dir), policy)
    if is_writer():
        record, markdown = perturbed.gap_report(summaries, out_dir)
        print(markdown)
        print(perturbed.summary_line(record, setup.env_names(config), out_dir))
    return summaries[perturbed.CLEAN]


def run_setting(
    config: ml_collections.ConfigDict, out_dir: pathlib.Path, policy: tuple[Policy, ChatFraming] | None = None
) -> tuple[EvalSummary, tuple[Policy, ChatFraming]]:
    """One evaluation into `out_dir` (with `policy` when given: the one an earlier setting built);
    its servers must confirm `env.perturbation`."""
    check_run_spec(config, out_dir)
    with setup.open_job(config) as job:
        infos = job.infos
        for info in infos.values():
            perturbed.check_confirmed(info, config.env.get("perturbation", ""))
        agent = AgentSpec.of(config.env)  # an agent program plays each episode through the policy
        play_with = ModelPolicy if agent is None else agent_episodes.agent_policy(config, agent, out_dir)
        policy = policy or setup.make_policy(config, infos, out_dir, play_with)
        summary = report(
            policy[0], {env: job.pool(env) for env in infos}, infos,
            {env: task_ids(config, info) for env, info in infos.items()},
            out_dir, group_size=config.group_size, horizon=config.horizon, seed=config.seed,
            max_attempts=config.max_attempts, batch_episodes=config.batch_episodes,
        )
    if is_writer():
        logging.info("evaluation report in %s", out_dir)
        print(markdown_table(summary))
        print(summary_line(summary, list(infos), out_dir))
    return summary, policy


def summary_line(summary: EvalSummary, envs: Sequence[str], out_dir: pathlib.Path) -> str:
    """The run's last line: `summary: envs=... scheduled=... success=... conditional_success=...
    infra_rate=... out_dir=...` (overall numbers; conditional success n/a when nothing was scored)."""
    o = summary.overall
    conditional = "n/a" if o.conditional_success.value is None else f"{o.conditional_success.value:.3f}"
    return (f"summary: envs={','.join(envs)} scheduled={o.scheduled} success={o.success.value:.3f} "
            f"conditional_success={conditional} infra_rate={o.infra_rate.value:.3f} out_dir={out_dir}")
