"""Learning-rate schedules count optimizer updates: an RL step makes ppo_epochs x num_minibatches
of them, and the SFT warm start has its own count."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from agentgym_jax.config import load_config_file
from agentgym_jax.models.config import ModelConfig
from agentgym_jax.models.decoder import init_params
from agentgym_jax.rollout.trajectory import Trajectory
from agentgym_jax.train import settings
from agentgym_jax.train.sft import sft_num_updates, sft_train
from agentgym_jax.train.state import TrainState, make_optimizer
from agentgym_jax.train.steps import make_step_fns

MODEL = ModelConfig.small("qwen2", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                          num_heads=4, num_kv_heads=2, head_dim=8)


def learning_rates(tx: optax.GradientTransformation, updates: int) -> list[float]:
    """The rate of each update: with a constant gradient, bias-corrected Adam steps by exactly lr."""
    state = tx.init({"w": jnp.zeros(())})
    rates = []
    for _ in range(updates):
        step, state = tx.update({"w": jnp.ones(())}, state, {"w": jnp.zeros(())})
        rates.append(float(-step["w"]))
    return rates


def quickstart(**overrides):
    config = load_config_file("configs/quickstart.py")
    for key, value in overrides.items():
        section, name = key.split(".")
        config[section][name] = value
    return config


@pytest.mark.parametrize("warmup_steps", [0, 8])
def test_rl_cosine_schedule_lasts_until_the_last_update(warmup_steps):
    config = quickstart(**{"optim.lr_schedule": "cosine", "optim.warmup_steps": warmup_steps, "train.steps": 24,
                           "algo.ppo_epochs": 2, "algo.num_minibatches": 2})
    update_config = settings.update(config, MODEL, objective="rl")
    assert update_config.batching.updates_per_step == 4
    rates = learning_rates(make_optimizer(settings.rl_optim(config, update_config.batching.updates_per_step)), 24 * 4 + 1)
    assert min(rates[:96]) > 0 and rates[95] < 1e-3 * config.optim.lr  # > 0 until the last update ...
    assert rates[96] == 0.0  # ... and 0 after it
    if warmup_steps:
        np.testing.assert_allclose(rates[:warmup_steps], config.optim.lr * np.arange(1, 9) / 8, rtol=1e-3)


def test_an_rl_step_makes_the_updates_the_schedule_counts():
    from test_train_steps import _batch  # a small random RL batch

    config = quickstart(**{"algo.ppo_epochs": 2, "algo.num_minibatches": 2, "algo.kl_coef": 0.0})
    update_config = settings.update(config, MODEL, objective="rl")
    tx = make_optimizer(settings.rl_optim(config, update_config.batching.updates_per_step))
    state = TrainState.create(init_params(MODEL, jax.random.PRNGKey(0)), tx, jax.random.PRNGKey(1))
    fns = make_step_fns(update_config)
    rl_batch, _ = fns.prepare(state.params, state.params, _batch())
    state, _ = fns.rl_update(state, rl_batch)
    assert int(state.step) == update_config.batching.updates_per_step == 4


def test_sft_warm_start_schedule_spans_its_own_updates():
    demos = [Trajectory(task_id=i, env="room", group_id=i, token_ids=[1, 2, 3, 4 + i], loss_mask=[0, 0, 1, 1],
                        logprobs=[0.0] * 4, turn_spans=[(2, 4)], turn_rewards=[1.0], reward=1.0, status="success")
             for i in range(5)]
    config = quickstart(**{"optim.lr_schedule": "cosine", "sft.epochs": 3, "sft.batch_size": 2})
    updates = sft_num_updates(len(demos), config.sft.batch_size, config.sft.epochs)
    assert updates == 9  # 3 epochs x ceil(5 / 2) batches
    tx = make_optimizer(settings.optim(config, updates, lr=config.sft.lr))
    rates = learning_rates(tx, updates + 1)
    assert min(rates[:updates]) > 0 and rates[updates] == 0.0
    update_config = settings.update(config, MODEL)
    state = TrainState.create(init_params(MODEL, jax.random.PRNGKey(0)), tx, jax.random.PRNGKey(1))
    state, history = sft_train(state, demos, update_config, batch_size=2, epochs=3, seed=0, progress=False)
    assert len(history) == int(state.step) == updates
