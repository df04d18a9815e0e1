"""The parts a training or evaluation job is made of, built from its config.

Environment servers (given URLs, or local ones started for the job), the tokenizer and chat
framing (a Hugging Face folder, or one trained on environment text), the policy (a Hugging Face
folder, or a random small model), the rollout engine and the update config.
"""

from __future__ import annotations

import contextlib
import pathlib
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import ml_collections

from agentgym_jax.aio import run_sync
from agentgym_jax.envs.launcher import LocalServers
from agentgym_jax.envs.pool import EnvPool
from agentgym_jax.envs.protocol import TaskInfo
from agentgym_jax.models import decoder, hf_checkpoint
from agentgym_jax.models.build_tokenizer import build_tokenizer
from agentgym_jax.models.chat import ChatFraming
from agentgym_jax.models.config import ModelConfig, load_config
from agentgym_jax.models.tokenizer import load_tokenizer
from agentgym_jax.parallel import partition
from agentgym_jax.rollout.engine import RolloutConfig, RolloutEngine
from agentgym_jax.sampling.sampler import Sampler
from agentgym_jax.train.steps import UpdateConfig


@contextlib.contextmanager
def environment_urls(env: ml_collections.ConfigDict) -> Iterator[list[str]]:
    """The configured server URLs, or `env.num_servers` local servers for the job's duration
    (requiring `env.auth_token` when it is set, like servers started elsewhere with it)."""
    if env.urls:
        yield [u.strip() for u in env.urls.split(",") if u.strip()]
        return
    with contextlib.ExitStack() as stack:  # one group per server: a group holds each env once
        groups = [stack.enter_context(LocalServers([env.name], auth_token=env.auth_token)) for _ in range(env.num_servers)]
        yield [group.servers[0].url for group in groups]


def make_pool(env: ml_collections.ConfigDict, urls: Sequence[str]) -> EnvPool:
    """A pool over `urls` that sends `env.auth_token` (servers started with `--auth_token`)."""
    return EnvPool(
        urls,
        max_concurrency=env.max_concurrency,
        request_timeout_s=env.request_timeout_s,
        episode_timeout_s=env.episode_timeout_s,
        auth_token=env.auth_token,
    )


def fetch_task_info(env: ml_collections.ConfigDict, urls: Sequence[str]) -> TaskInfo:
    async def ask() -> TaskInfo:
        async with make_pool(env, urls) as pool:
            return await pool.tasks()

    return run_sync(ask())


def tokenizer_dir(config: ml_collections.ConfigDict, workdir: pathlib.Path) -> pathlib.Path:
    """`tokenizer.dir`, else the model folder's tokenizer, else the one the job trains."""
    return pathlib.Path(config.tokenizer.dir or config.model.hf_dir or workdir / "tokenizer")


def tokenizer_and_framing(
    config: ml_collections.ConfigDict, workdir: pathlib.Path, corpus: Sequence[str] | None
) -> ChatFraming:
    """Loads the tokenizer (training it on `corpus` first when the job builds its own)."""
    path = tokenizer_dir(config, workdir)
    if not (path / "tokenizer.json").exists() and path == workdir / "tokenizer":
        if corpus is None:
            raise ValueError("no tokenizer.dir or model.hf_dir given and no text to train a tokenizer on")
        build_tokenizer(path, corpus, config.tokenizer.vocab_size, config.tokenizer.template)
    return ChatFraming(load_tokenizer(path))


def model_config(config: ml_collections.ConfigDict, vocab_size: int) -> ModelConfig:
    """The Hugging Face folder's config, or the small model the config describes."""
    m = config.model
    if m.hf_dir:
        return load_config(m.hf_dir)
    return ModelConfig.small(
        m.family,
        vocab_size=vocab_size,
        hidden_size=m.hidden_size,
        intermediate_size=m.intermediate_size,
        num_layers=m.num_layers,
        num_heads=m.num_heads,
        num_kv_heads=m.num_kv_heads,
        head_dim=m.head_dim,
    )


def initial_params(config: ml_collections.ConfigDict, model: ModelConfig, mesh: jax.sharding.Mesh, rng: jax.Array, value_head: bool):
    """Parameters loaded (or initialised) straight into their shardings over `mesh`."""
    dtype = jnp.dtype(config.model.param_dtype)
    if config.model.hf_dir:
        shapes = hf_checkpoint.param_shapes(model, dtype)
        _, params = hf_checkpoint.load_pretrained(
            config.model.hf_dir, dtype=dtype, shardings=partition.param_shardings(shapes, mesh), config=model
        )
        if value_head:
            params["value_head"] = decoder.init_value_head(model, rng, param_dtype=dtype)
        return params
    init = lambda key: decoder.init_params(model, key, param_dtype=dtype, value_head=value_head)  # noqa: E731
    return partition.sharded_init(init, rng, mesh)


def rollout_config(
    config: ml_collections.ConfigDict, temperature: float | None = None, group_size: int | None = None
) -> RolloutConfig:
    r = config.rollout
    return RolloutConfig(
        group_size=r.group_size if group_size is None else group_size,
        max_tokens_per_turn=r.max_tokens_per_turn,
        max_response_length=r.max_response_length,
        invalid_action_limit=r.invalid_action_limit or None,
        temperature=r.temperature if temperature is None else temperature,
        top_k=r.top_k,
        top_p=r.top_p,
        straggler_wait_s=None if r.lock_step else r.straggler_wait_s,
        num_slots=r.num_slots,
        decode_chunk=r.decode_chunk,
    )


def make_engine(
    config: ml_collections.ConfigDict,
    model: ModelConfig,
    framing: ChatFraming,
    urls: Sequence[str],
    info: TaskInfo,
    rollout: RolloutConfig,
) -> RolloutEngine:
    """A rollout engine with its own sampler and pool (one per sampling setting)."""
    return RolloutEngine(make_sampler(config, model, framing, rollout), framing, make_pool(config.env, urls), info, rollout)


def make_sampler(config: ml_collections.ConfigDict, model: ModelConfig, framing: ChatFraming, rollout: RolloutConfig) -> Sampler:
    return Sampler.for_decoder(
        model,
        rollout.sampling_config(framing),
        max_cache_len=config.rollout.max_cache_len,
        dtype=jnp.dtype(config.model.compute_dtype),
    )


def update_config(config: ml_collections.ConfigDict, model: ModelConfig) -> UpdateConfig:
    a = config.algo
    hparams = tuple(sorted(dict(a.get("advantage_hparams", {})).items()))
    return UpdateConfig(
        model=model,
        advantage=a.advantage,
        advantage_hparams=hparams,
        ppo_epochs=a.ppo_epochs,
        num_minibatches=a.num_minibatches,
        num_microbatches=a.num_microbatches,
        clip_eps_low=a.clip_eps_low,
        clip_eps_high=a.clip_eps_high,
        kl_coef=a.kl_coef,
        kl_estimator=a.kl_estimator,
        kl_in_reward=a.kl_in_reward,
        entropy_coef=a.entropy_coef,
        agg_mode=a.agg_mode,
        compute_dtype=config.model.compute_dtype,
        remat=config.model.remat,
    )
