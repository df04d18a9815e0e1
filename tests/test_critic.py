"""PPO's separate critic: its own parameters (a copy of the policy or a Hugging Face folder, plus a
value head) and its own optimizer, beside the shared-trunk value head."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_train_steps import MODEL, _batch

from agentgym_jax.config import load_config_file
from agentgym_jax.models import hf_checkpoint
from agentgym_jax.models.decoder import forward, init_params, init_value_head
from agentgym_jax.parallel.mesh import make_mesh
from agentgym_jax.rl.advantages import gae
from agentgym_jax.train import build, settings, steps
from agentgym_jax.train.state import TrainState
from tests.updates import update as make_update

CONFIG = make_update(MODEL, advantage="gae", critic="separate", gamma=1.0, lam=0.95, num_minibatches=2)


def states():
    policy = init_params(MODEL, jax.random.PRNGKey(0))  # no value head
    critic = {**jax.tree.map(jnp.copy, policy), "value_head": init_value_head(MODEL, jax.random.PRNGKey(3))}
    critic["value_head"]["bias"] = jnp.asarray(0.7)  # values visibly off the returns
    return (TrainState.create(policy, optax.adam(1e-3), jax.random.PRNGKey(1)),
            TrainState.create(critic, optax.adam(1e-2), jax.random.PRNGKey(2)))


@pytest.mark.slow
def test_separate_critic_gives_the_values_and_trains_alone():
    policy, critic = states()
    fns = steps.make_step_fns(CONFIG)
    batch = _batch()
    rl_batch, _ = fns.prepare(policy.params, policy.params, batch, critic.params)
    # Values: the critic's head on its final hidden state of the token's prefix, in float64
    # (0 where nothing predicts the token: a row's first token and its padding).
    _, _, hidden = forward(critic.params, batch.tokens, batch.positions, config=MODEL, return_hidden=True)
    head = critic.params["value_head"]
    want = np.asarray(hidden, np.float64) @ np.asarray(head["kernel"], np.float64) + float(head["bias"])
    want = np.where(np.asarray(batch.positions) > 0, np.pad(want[:, :-1], ((0, 0), (1, 0))), 0.0)  # padding: 0
    np.testing.assert_allclose(rl_batch.old_values, want, rtol=1e-5, atol=1e-5)
    advantages, returns = gae(batch.token_rewards, rl_batch.old_values, batch.loss_mask, gamma=1.0, lam=0.95)
    np.testing.assert_allclose(rl_batch.advantages, advantages, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(rl_batch.returns, returns, rtol=1e-6, atol=1e-6)

    _, before = jax.jit(steps.critic_loss, static_argnames="config")(critic.params, rl_batch, CONFIG)
    policy_before = jax.tree.map(np.asarray, policy.params)
    new_policy, metrics = fns.rl_update(policy, rl_batch)
    assert "value_loss" not in metrics and "value_head" not in new_policy.params  # the policy loss has no value term
    for _ in range(4):
        critic, critic_metrics = fns.critic_update(critic, rl_batch)
    assert int(critic.step) == 4 * CONFIG.batching.updates_per_step
    _, after = jax.jit(steps.critic_loss, static_argnames="config")(critic.params, rl_batch, CONFIG)
    assert float(after["value_loss"]) < 0.5 * float(before["value_loss"])
    assert "critic/value_loss" in critic_metrics
    moved = jax.tree.map(lambda a, b: bool(np.any(np.asarray(a) != b)), new_policy.params, policy_before)
    assert any(jax.tree.leaves(moved))  # the policy trained on its own optimizer


def test_prepare_refuses_a_missing_or_unexpected_critic():
    policy, critic = states()
    with pytest.raises(ValueError, match="critic_params must be given"):
        steps.prepare(policy.params, policy.params, _batch(), config=CONFIG)
    with pytest.raises(ValueError, match="critic_params must be None"):
        steps.prepare(policy.params, policy.params, _batch(), critic.params, config=make_update(MODEL))


@pytest.mark.parametrize("source", ["policy", "folder"])
def test_critic_state_starts_from_the_policy_or_a_folder(source, tmp_path):
    config = load_config_file("configs/quickstart.py")
    config.algo.advantage, config.algo.critic, config.algo.critic_lr = "gae", "separate", 5e-5
    policy = init_params(MODEL, jax.random.PRNGKey(0))
    source_params = policy
    if source == "folder":
        source_params = init_params(MODEL, jax.random.PRNGKey(9))
        hf_checkpoint.save_pretrained(source_params, MODEL, tmp_path)
        config.algo.critic_dir = str(tmp_path)
    update = settings.update(config, MODEL, objective="rl")
    assert update.rl.separate_critic and not update.rl.shared_value_head
    assert (update.rl.critic_model is None) == (source == "policy")
    [critic] = build.critic_states(config, update, make_mesh(1, -1, 1), policy)
    assert set(critic.params) == set(policy) | {"value_head"}
    for name in policy:
        jax.tree.map(np.testing.assert_array_equal, critic.params[name], source_params[name])
    assert build.critic_states(load_config_file("configs/quickstart.py"), settings.update(
        load_config_file("configs/quickstart.py"), MODEL, objective="rl"), make_mesh(1, -1, 1), policy) == []
