"""What `mode=eval` and `mode=collect` build from their config: servers, tasks and the policy.

- servers: `env.urls` as `name=url` pairs (a name may repeat: several servers of one
  environment), or `env.num_servers` local servers per environment for the job's duration;
- tasks: `split` ("train", "test" or "" for every id) and `task_ids` ("" all of the split,
  "N" its first N, "a:b" the ids a <= id < b, all of which must be in the split);
- policy: "oracle", "checkpoint:<RL workdir>" (the params of its latest orbax checkpoint, or
  `checkpoint_step`; its `config.json` and `tokenizer/`), or "hf:<folder>" (safetensors,
  config.json and tokenizer of a Hugging Face folder).
An output folder remembers what it was made with (`run.json`); resuming into it with another
policy or schedule is refused rather than mixing records. With several processes, each plays
its contiguous share of every environment's tasks (`shares`) on its own servers and devices.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import pathlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections

from agentgym_jax.config import ConfigError
from agentgym_jax.envs.protocol import TaskInfo
from agentgym_jax.job import settings, setup
from agentgym_jax.models import fetch
from agentgym_jax.models.chat import ChatFraming
from agentgym_jax.models.config import load_config
from agentgym_jax.parallel import distributed
from agentgym_jax.rollout.collect import ModelPolicy, OraclePolicy, Policy

RUN_SPEC_NAME = "run.json"
SCHEDULE_KEYS = (
    "envs", "policy", "checkpoint_step", "split", "task_ids", "group_size", "seed", "temperature", "horizon",
)


def env_names(config: ml_collections.ConfigDict) -> list[str]:
    names = [n.strip() for n in config.envs.split(",") if n.strip()]
    if not names or len(set(names)) != len(names):
        raise ConfigError(f"envs must list distinct environment names, got {config.envs!r}")
    return names


def parse_urls(spec: str, envs: Sequence[str]) -> dict[str, list[str]]:
    """`"maze=http://a,maze=http://b,room=http://c"` -> {env: [urls]} (a bare URL if one env)."""
    out: dict[str, list[str]] = {}
    for item in (x.strip() for x in spec.split(",")):
        if not item:
            continue
        env, sep, url = item.partition("=")
        if not sep:
            if len(envs) != 1:
                raise ConfigError(f"env.urls: {item!r} needs a name, as in 'maze={item}' (envs: {list(envs)})")
            env, url = envs[0], item
        if env not in envs:
            raise ConfigError(f"env.urls names {env!r}, which is not in envs {list(envs)}")
        out.setdefault(env, []).append(url)
    return out


@contextlib.contextmanager
def server_urls(config: ml_collections.ConfigDict) -> Iterator[dict[str, list[str]]]:
    """env -> this process's server URLs: its share of the given ones, else local servers started for the job."""
    envs = env_names(config)
    given = parse_urls(config.env.urls, envs)
    with contextlib.ExitStack() as stack:
        urls = {}
        for env in envs:
            one = ml_collections.ConfigDict(dict(  # this process's share of the given URLs, or its own servers
                name=env, urls=",".join(given.get(env, [])), num_servers=config.env.num_servers,
                auth_token=config.env.auth_token,
            ))
            urls[env] = stack.enter_context(setup.environment_urls(one))
        yield urls


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


def make_policy(
    config: ml_collections.ConfigDict, infos: Mapping[str, TaskInfo], out_dir: pathlib.Path
) -> tuple[Policy, ChatFraming]:
    """The configured policy and the chat framing its trajectories are tokenized with; a model
    runs on this process's devices (`setup.sampler_mesh`)."""
    kind, _, where = config.policy.partition(":")
    if kind == "oracle" and not where:
        corpus = [info.instruction for info in infos.values()]
        framing = setup.tokenizer_and_framing(config, out_dir, corpus)
        return OraclePolicy(framing, config.rollout.action_format), framing
    if kind not in ("checkpoint", "hf", "pretrained") or not where:
        raise ConfigError(f"policy must be 'oracle', 'checkpoint:<dir>', 'hf:<dir>', 'hf:<org>/<name>' (the Hugging "
                          f"Face cache) or 'pretrained:<name>', got {config.policy!r}")
    folder = pathlib.Path(where)
    if kind == "pretrained" or (kind == "hf" and not folder.exists()):
        try:
            folder, kind = pathlib.Path(fetch.resolve(config.policy)), "hf"
        except fetch.FetchError as e:
            raise ConfigError(f"policy {config.policy!r}: {e}") from e
    if not (folder / "config.json").exists():
        raise ConfigError(f"policy {config.policy!r}: no config.json in {folder}")
    config = ml_collections.ConfigDict(config.to_dict())  # an unlocked copy
    if kind == "hf":
        config.model.hf_dir = str(folder)
    framing = setup.tokenizer_and_framing(config, folder, None)  # tokenizer.dir, the HF folder's, <workdir>/tokenizer
    model = load_config(folder)
    mesh = setup.sampler_mesh(config)
    if kind == "hf":
        params = setup.initial_params(config, model, mesh, jax.random.key(0), value_head=False)
    else:
        dtype = jnp.dtype(config.model.param_dtype)
        params = setup.checkpoint_params(folder / "checkpoints", config.checkpoint_step, model, mesh, dtype)
    rollout = settings.rollout(config, temperature=config.temperature, group_size=1)
    sampler = setup.make_sampler(config, model, framing, rollout)
    return ModelPolicy(sampler, framing, params, rollout), framing


@dataclasses.dataclass
class Job:
    """What an eval or collect run plays: per environment its task info, task ids (`schedule`,
    all processes'; `shares`, this process's) and this process's pool."""

    infos: dict[str, TaskInfo]
    schedule: dict[str, list[int]]
    shares: dict[str, list[int]]
    policy: Policy
    framing: ChatFraming | None
    pools: dict[str, Any]


@contextlib.contextmanager
def open_job(config: ml_collections.ConfigDict, out_dir: pathlib.Path) -> Iterator[Job]:
    """Joins the processes, checks the run folder, reaches (or starts) this process's servers
    and builds the policy and pools. The task info is process 0's, so all agree on the ids."""
    distributed.initialize_distributed()
    check_run_spec(config, out_dir)
    with server_urls(config) as urls:
        infos = {}
        for env, env_urls in urls.items():
            body = setup.fetch_task_info(config.env, env_urls).to_json() if distributed.is_writer() else None
            infos[env] = TaskInfo.from_json(distributed.broadcast_object(body))
        schedule = {env: task_ids(config, info) for env, info in infos.items()}
        shares = {env: distributed.process_share(ids, f"{env} tasks", even=False)[0] for env, ids in schedule.items()}
        policy, framing = make_policy(config, infos, out_dir)
        pools = {env: setup.make_pool(config.env, env_urls) for env, env_urls in urls.items()}
        yield Job(infos, schedule, shares, policy, framing, pools)
