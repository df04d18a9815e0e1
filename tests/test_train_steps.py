"""The jitted update steps: alignment of log-probs, exact micro-batch accumulation, ppo_epochs
honoured, non-finite updates skipped, and the policy moving the way the advantages say."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from agentgym_jax.models.config import ModelConfig
from agentgym_jax.models.decoder import forward, init_params
from agentgym_jax.rollout.batch import TokenBatch
from agentgym_jax.train import steps
from agentgym_jax.train.state import TrainState

MODEL = ModelConfig.small("qwen2", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                          num_heads=4, num_kv_heads=2, head_dim=8)


def _batch(rows=8, seq=12, seed=0, rewards=None):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(6, seq + 1, rows)
    positions = np.where(np.arange(seq)[None] < lengths[:, None], np.arange(seq)[None], -1)
    mask = (rng.random((rows, seq)) < 0.6) & (positions > 0)
    mask[:, 1] = True  # every row has a policy token
    token_rewards = np.zeros((rows, seq), np.float32)
    scores = np.asarray(rewards if rewards is not None else rng.integers(0, 2, rows), np.float32)
    for r in range(rows):
        token_rewards[r, np.nonzero(mask[r])[0].max()] = scores[r]
    return TokenBatch(
        tokens=jnp.asarray(rng.integers(0, 64, (rows, seq)), jnp.int32),
        positions=jnp.asarray(positions, jnp.int32),
        loss_mask=jnp.asarray(mask, jnp.float32),
        old_logprobs=jnp.zeros((rows, seq)),
        token_rewards=jnp.asarray(token_rewards),
        group_ids=jnp.asarray(np.arange(rows) // 4, jnp.int32),
        scores=jnp.asarray(scores),
    )


def _state(lr=1e-2, tx=None):
    params = init_params(MODEL, jax.random.PRNGKey(0))
    return TrainState.create(params, tx or optax.sgd(lr), jax.random.PRNGKey(1))


def test_token_logprobs_line_up_with_the_tokens_they_score():
    batch = _batch()
    config = steps.UpdateConfig(model=MODEL)
    params = _state().params
    logp, entropy, _ = steps.token_logprobs(params, batch.tokens, batch.positions, config)
    logits, _ = forward(params, batch.tokens, batch.positions, None, config=MODEL)
    logits = np.asarray(logits, np.float64)
    tokens = np.asarray(batch.tokens)
    for b, t in [(0, 1), (3, 5), (7, 11)]:
        row = logits[b, t - 1] - logits[b, t - 1].max()
        log_softmax = row - np.log(np.exp(row).sum())
        assert abs(logp[b, t] - log_softmax[tokens[b, t]]) < 1e-5
        assert abs(entropy[b, t] + (np.exp(log_softmax) * log_softmax).sum()) < 1e-4
    assert np.all(np.asarray(logp[:, 0]) == 0)


@pytest.mark.parametrize("agg_mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_micro_batch_accumulation_gives_the_full_batch_gradient(agg_mode):
    batch = _batch()
    full, micro = (steps.UpdateConfig(model=MODEL, agg_mode=agg_mode, num_microbatches=n) for n in (1, 4))
    a, metrics_a = steps.sft_update_jit(_state(), batch, full)
    b, metrics_b = steps.sft_update_jit(_state(), batch, micro)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=2e-4, atol=1e-6), a.params, b.params)
    np.testing.assert_allclose(metrics_a["loss"], metrics_b["loss"], rtol=1e-5)
    np.testing.assert_allclose(metrics_a["grad_norm"], metrics_b["grad_norm"], rtol=1e-4)


def test_ppo_epochs_and_minibatches_are_all_applied():
    batch = _batch()
    config = steps.UpdateConfig(model=MODEL, ppo_epochs=3, num_minibatches=2, num_microbatches=2)
    state = _state()
    rl_batch, _ = steps.prepare_jit(state.params, state.params, batch, config)
    state, metrics = steps.rl_update_jit(state, rl_batch, config)
    assert int(state.step) == 6 and int(state.skipped_updates) == 0
    assert float(metrics["skipped_update"]) == 0


def test_first_update_loss_is_minus_the_mean_advantage_at_ratio_one():
    batch = _batch(rewards=[1, 0, 0, 1, 1, 1, 0, 1])
    config = steps.UpdateConfig(model=MODEL, kl_coef=0.1)
    state = _state()
    rl_batch, _ = steps.prepare_jit(state.params, state.params, batch, config)
    loss, metrics = steps.rl_loss(state.params, rl_batch, config)
    mask = np.asarray(batch.loss_mask, np.float64)
    expected = -(np.asarray(rl_batch.advantages, np.float64) * mask).sum() / mask.sum()
    np.testing.assert_allclose(metrics["pg_loss"], expected, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(metrics["kl"], 0.0, atol=1e-7)  # reference == policy
    # GRPO: group 0 has scores [1, 0, 0, 1] -> +-1/std advantages on every policy token.
    adv = np.asarray(rl_batch.advantages)
    row0 = adv[0][mask[0] > 0]
    np.testing.assert_allclose(row0, np.full_like(row0, 0.5 / np.std([1, 0, 0, 1], ddof=1)), rtol=1e-4)


def test_non_finite_loss_is_skipped_and_counted():
    batch = _batch()
    config = steps.UpdateConfig(model=MODEL)
    state = _state()
    rl_batch, _ = steps.prepare_jit(state.params, state.params, batch, config)
    poisoned = rl_batch.replace(advantages=rl_batch.advantages.at[0, 1].set(jnp.nan))
    before = jax.tree.map(np.asarray, state.params)
    state, metrics = steps.rl_update_jit(state, poisoned, config)
    jax.tree.map(np.testing.assert_array_equal, state.params, before)
    assert int(state.skipped_updates) == 1 and int(state.step) == 0
    assert float(metrics["skipped_update"]) == 1


def test_updates_raise_the_likelihood_of_positive_advantage_rows():
    batch = _batch(rewards=[1, 0, 0, 0, 1, 0, 0, 0])
    config = steps.UpdateConfig(model=MODEL, ppo_epochs=4)
    state = _state(tx=optax.adam(3e-3))
    rl_batch, _ = steps.prepare_jit(state.params, state.params, batch, config)
    state, _ = steps.rl_update_jit(state, rl_batch, config)
    after, _ = steps.prepare_jit(state.params, state.params, batch, config)
    mask = np.asarray(batch.loss_mask)
    delta = ((np.asarray(after.old_logprobs) - np.asarray(rl_batch.old_logprobs)) * mask).sum(1)
    assert delta[0] > 0 and delta[4] > 0  # winners more likely
    assert np.all(delta[[1, 2, 3, 5, 6, 7]] < 0)  # losers less likely


def test_gae_uses_the_value_head_and_trains_it():
    batch = _batch()
    config = steps.UpdateConfig(model=MODEL, advantage="gae", advantage_hparams=(("gamma", 1.0), ("lam", 1.0)))
    params = init_params(MODEL, jax.random.PRNGKey(0), value_head=True)
    state = TrainState.create(params, optax.adam(1e-2), jax.random.PRNGKey(1))
    rl_batch, _ = steps.prepare_jit(state.params, state.params, batch, config)
    _, before = steps.rl_loss(state.params, rl_batch, config)
    for _ in range(5):
        state, _ = steps.rl_update_jit(state, rl_batch, config)
    _, after = steps.rl_loss(state.params, rl_batch, config)
    assert 0 < float(after["value_loss"]) < 0.5 * float(before["value_loss"])
