"""The train states a training job starts from, built once here: the policy's (trainable part
and frozen rest, optimizer, placed on the mesh) with its jitted steps, and PPO's separate
critic. The parts every mode shares (mesh, servers, model, params) come from `job/setup.py`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
import optax

from agentgym_jax.config import ConfigError
from agentgym_jax.job import settings as job_settings
from agentgym_jax.job import setup
from agentgym_jax.models import decoder
from agentgym_jax.train import settings
from agentgym_jax.train.state import TrainState, make_optimizer
from agentgym_jax.train.steps import StepFns, UpdateConfig, make_step_fns, train_state_shardings


def placed_state(params, tx: optax.GradientTransformation, rng: jax.Array, mesh: jax.sharding.Mesh,
                 frozen=None) -> tuple[TrainState, TrainState]:
    """A train state over `params` (and `frozen`), placed on `mesh`, and its shardings (the
    layout its jitted steps and a checkpoint restore use)."""
    state = TrainState.create(params, tx, rng, frozen=frozen)
    shardings = train_state_shardings(state, mesh)
    return jax.device_put(state, shardings), shardings


def policy_state(config: ml_collections.ConfigDict, update: UpdateConfig, params, mesh: jax.sharding.Mesh,
                 tx: optax.GradientTransformation, *critic: TrainState) -> tuple[TrainState, StepFns]:
    """The policy's train state (the parameters `config.model` tunes, the rest frozen:
    `setup.split_params`) placed on `mesh`, and the jitted steps of `update` for it (and for a
    separate `critic`)."""
    params, frozen = setup.split_params(config, params, mesh, jax.random.PRNGKey(config.seed + 6))  # LoRA, top layers
    state, shardings = placed_state(params, tx, jax.random.PRNGKey(config.seed + 2), mesh, frozen)
    return state, make_step_fns(update, mesh, shardings, *(train_state_shardings(c, mesh) for c in critic))


def restart_optimizer(state: TrainState, params, frozen, mesh: jax.sharding.Mesh) -> TrainState:
    """`state` on `params` (and `frozen`) with a fresh optimizer state placed like them: the RL
    phase after its warm start (whose update donated the state's former params)."""
    state = state.replace(params=params, frozen=frozen)
    fresh = jax.jit(state.tx.init, out_shardings=train_state_shardings(state, mesh).opt_state)
    return state.replace(opt_state=fresh(params))


def critic_states(
    config: ml_collections.ConfigDict, update: UpdateConfig, mesh: jax.sharding.Mesh, policy_params, tx=None
) -> list[TrainState]:
    """`[critic_state]` with a separate critic (`update.rl.separate_critic`), else `[]`.

    `tx`: the optimizer of an earlier critic state, to keep (a new one is a new compilation).
    PPO's separate critic, placed on `mesh`: the backbone of `algo.critic_dir` (a Hugging Face
    folder) or a copy of `policy_params`, a new value head, and its own optimizer (`algo.critic_lr`,
    0: `optim.lr`; its schedule spans the RL phase's optimizer updates, like the policy's).
    """
    if not update.rl.separate_critic:
        return []
    if not job_settings.tuning(config).full:
        raise ConfigError("algo.critic=separate copies the whole policy: it does not combine with model.lora_rank or "
                          "model.trainable_layers (use algo.critic=shared)")
    dtype = jnp.dtype(config.model.param_dtype)
    model = update.rl.critic_model or update.forward.model
    if config.algo.critic_dir:
        backbone = setup.pretrained_params(config.algo.critic_dir, model, dtype, mesh)
    else:
        backbone = {name: jax.tree.map(jnp.copy, p) for name, p in policy_params.items() if name != "value_head"}
    head = decoder.init_value_head(model, jax.random.PRNGKey(config.seed + 4), param_dtype=dtype)
    lr = config.algo.critic_lr or config.optim.lr
    tx = tx or make_optimizer(settings.rl_optim(config, update.batching.updates_per_step, lr=lr))
    return [placed_state({**backbone, "value_head": head}, tx, jax.random.PRNGKey(config.seed + 5), mesh)[0]]
