"""Train state: updates apply, non-finite gradients are skipped and counted, schedules are right."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from agentgym_jax.train.state import TrainState, make_optimizer


def _config(**overrides):
    config = ml_collections.ConfigDict(
        dict(lr=0.1, warmup_steps=0, total_updates=10, lr_schedule="constant",
             weight_decay=0.0, grad_clip=1e9, b1=0.9, b2=0.999)
    )
    config.update(overrides)
    return config


def test_non_finite_gradients_are_skipped_and_counted():
    params = {"w": jnp.ones(3)}
    state = TrainState.create(params, make_optimizer(_config()), jax.random.PRNGKey(0))
    apply = jax.jit(TrainState.apply_gradients)
    state = apply(state, {"w": jnp.array([1.0, -1.0, 0.5])})
    moved = np.asarray(state.params["w"])
    assert not np.allclose(moved, 1.0) and int(state.step) == 1
    bad = apply(state, {"w": jnp.array([1.0, jnp.nan, 0.0])})
    np.testing.assert_array_equal(bad.params["w"], moved)
    jax.tree.map(np.testing.assert_array_equal, bad.opt_state, state.opt_state)
    assert int(bad.step) == 1 and int(bad.skipped_updates) == 1


def test_first_adam_step_moves_each_weight_by_lr():
    # Adam's first update is lr * sign(g) (bias-corrected m/sqrt(v)), independent of |g|.
    state = TrainState.create({"w": jnp.zeros(2)}, make_optimizer(_config()), jax.random.PRNGKey(0))
    state = state.apply_gradients({"w": jnp.array([3.0, -0.01])})
    np.testing.assert_allclose(state.params["w"], [-0.1, 0.1], rtol=1e-4)


def test_warmup_then_cosine_schedule_values():
    tx = make_optimizer(_config(lr=1.0, warmup_steps=4, total_updates=12, lr_schedule="cosine"))
    state = tx.init({"w": jnp.zeros(())})
    lrs = []
    for _ in range(12):
        # A constant gradient makes bias-corrected Adam step by exactly lr: read the lr back.
        updates, state = tx.update({"w": jnp.ones(())}, state, {"w": jnp.zeros(())})
        lrs.append(float(-updates["w"]))
    np.testing.assert_allclose(lrs[:4], [0.25, 0.5, 0.75, 1.0], rtol=1e-3)
    expected_decay = [0.5 * (1 + np.cos(np.pi * k / 8)) for k in range(8)]
    np.testing.assert_allclose(lrs[4:], expected_decay, rtol=1e-3, atol=1e-6)


def test_unknown_schedule_is_rejected():
    with pytest.raises(ValueError, match="lr_schedule"):
        make_optimizer(_config(lr_schedule="linear"))
