"""Off-policy corrections (truncated IS, decoupled PPO's weights) and the sequence-level ratio of
GSPO vs float64 references written here as loops."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from rl_batches import random_loss_mask, with_garbage

from agentgym_jax.rl import correction, losses
from tests.updates import update as make_update

BATCH, SEQ = 8, 20
TOL = dict(rtol=1e-5, atol=1e-6)
WEIGHTS = jax.jit(correction.importance_weights, static_argnames=("level", "mode"))
PPO = jax.jit(losses.ppo_policy_loss, static_argnames=("agg_mode", "ratio_level"))


def f32_exact(x):
    return np.asarray(x, np.float32).astype(np.float64)


def inputs(seed):
    rng = np.random.default_rng(seed)
    mask = random_loss_mask(rng, BATCH, SEQ)  # row 1 all-masked
    behaviour = f32_exact(np.log(rng.uniform(0.05, 1.0, mask.shape)))
    trainer = f32_exact(behaviour + rng.normal(scale=0.4, size=mask.shape))
    advantages = f32_exact(rng.normal(size=mask.shape))
    garbage = lambda x: jnp.asarray(with_garbage(rng, x, mask), jnp.float32)  # noqa: E731
    return mask, trainer, behaviour, advantages, garbage


def ref_weights(trainer, behaviour, mask, level, cap, mode):
    out = np.zeros(mask.shape)
    for i in range(mask.shape[0]):
        seq_log = sum(trainer[i, t] - behaviour[i, t] for t in range(mask.shape[1]) if mask[i, t])
        for t in range(mask.shape[1]):
            if mask[i, t]:
                w = math.exp(trainer[i, t] - behaviour[i, t] if level == "token" else seq_log)
                out[i, t] = min(w, cap) if mode == "truncate" else (0.0 if w > cap else w)
    return out


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("mode", ["truncate", "drop"])
def test_importance_weights_match_reference(level, mode):
    for seed in range(3):
        mask, trainer, behaviour, _, garbage = inputs(seed)
        cap = 1.5
        weights, metrics = WEIGHTS(garbage(trainer), garbage(behaviour), jnp.asarray(mask), level=level, cap=cap, mode=mode)
        np.testing.assert_allclose(weights, ref_weights(trainer, behaviour, mask, level, cap, mode), **TOL)
        raw = ref_weights(trainer, behaviour, mask, level, np.inf, "truncate")
        np.testing.assert_allclose(metrics["is_weight_mean"], raw[mask].mean(), rtol=1e-5)
        np.testing.assert_allclose(metrics["is_weight_max"], raw[mask].max(), rtol=1e-5)
        np.testing.assert_allclose(metrics["is_capped_fraction"], (raw[mask] > cap).mean(), rtol=1e-6)
        assert 0 < float(metrics["is_capped_fraction"]) < 1  # the cap is active on some tokens
        used = ref_weights(trainer, behaviour, mask, level, cap, mode)[mask]
        np.testing.assert_allclose(metrics["is_ess_fraction"], used.sum() ** 2 / (used.size * (used**2).sum()), rtol=1e-5)


def test_equal_policies_give_weight_one_and_bad_options_are_refused():
    mask, trainer, _, _, _ = inputs(0)
    x = jnp.asarray(trainer, jnp.float32)
    weights, metrics = correction.importance_weights(x, x, jnp.asarray(mask), level="sequence", cap=2.0, mode="truncate")
    np.testing.assert_array_equal(weights, mask.astype(np.float32))
    assert float(metrics["is_capped_fraction"]) == 0.0 and float(metrics["is_ess_fraction"]) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="unknown importance-sampling level 'turn'; valid: token, sequence"):
        correction.importance_weights(x, x, mask, level="turn", cap=2.0, mode="truncate")
    with pytest.raises(ValueError, match="cap must be > 0, got 0"):
        correction.importance_weights(x, x, mask, level="token", cap=0.0, mode="truncate")


def ref_policy_loss(logprobs, old, advantages, mask, eps_low, eps_high, weights, sequence):
    """Per-token loss `max(-A r, -A clip(r))`, times the weight; r per token or GSPO's per row."""
    loss = np.zeros(mask.shape)
    for i in range(mask.shape[0]):
        tokens = [t for t in range(mask.shape[1]) if mask[i, t]]
        if not tokens:
            continue
        seq_ratio = math.exp(sum(logprobs[i, t] - old[i, t] for t in tokens) / len(tokens))
        for t in tokens:
            r = seq_ratio if sequence else math.exp(logprobs[i, t] - old[i, t])
            a = advantages[i, t]
            loss[i, t] = max(-a * r, -a * min(max(r, 1 - eps_low), 1 + eps_high)) * weights[i, t]
    return loss


def ref_seq_mean_token_mean(loss, mask):
    rows = [loss[i][mask[i]].mean() for i in range(mask.shape[0]) if mask[i].any()]
    return sum(rows) / len(rows)


@pytest.mark.parametrize("ratio_level", ["token", "sequence"])
def test_weighted_and_sequence_level_policy_loss_match_reference(ratio_level):
    for seed in range(3):
        mask, logprobs, old, advantages, garbage = inputs(seed)
        weights = f32_exact(np.random.default_rng(seed).uniform(0.2, 2.0, mask.shape))
        loss, _ = PPO(garbage(logprobs), garbage(old), garbage(advantages), jnp.asarray(mask),
                      agg_mode="seq-mean-token-mean", clip_eps_low=0.1, clip_eps_high=0.28,
                      ratio_level=ratio_level, token_weights=garbage(weights))
        per_token = ref_policy_loss(logprobs, old, advantages, mask, 0.1, 0.28, weights, ratio_level == "sequence")
        np.testing.assert_allclose(loss, ref_seq_mean_token_mean(per_token, mask), **TOL)


def test_gspo_gradient_is_the_sequence_ratios():
    """GSPO: d loss / d logprob_t is the same for every token of a row (unclipped region):
    `-A_i s_i / |y_i|` over the row's token count, for seq-mean-token-mean."""
    mask, logprobs, old, advantages, _ = inputs(1)
    advantages = np.repeat(advantages[:, :1], SEQ, axis=1)  # a sequence-level advantage, as GRPO gives
    close = f32_exact(old + 0.01 * np.random.default_rng(0).normal(size=mask.shape))  # ratios inside the clip
    grad = jax.grad(lambda lp: losses.ppo_policy_loss(
        lp, jnp.asarray(old, jnp.float32), jnp.asarray(advantages, jnp.float32), jnp.asarray(mask),
        agg_mode="seq-mean-token-mean", ratio_level="sequence", clip_eps_low=0.2)[0])(jnp.asarray(close, jnp.float32))
    rows = [i for i in range(BATCH) if mask[i].any()]
    for i in rows:
        n = mask[i].sum()
        s = math.exp(sum(close[i, t] - old[i, t] for t in range(SEQ) if mask[i, t]) / n)
        want = np.where(mask[i], -advantages[i, 0] * s / n / len(rows), 0.0)
        np.testing.assert_allclose(grad[i], want, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("options, level, mode", [
    (dict(is_correction="token"), "token", "truncate"),
    (dict(is_correction="sequence"), "sequence", "truncate"),
    (dict(decoupled_ppo=True), "token", "drop"),
])
def test_update_weights_the_policy_loss_by_trainer_over_sampler(options, level, mode):
    """Through `prepare` and `rl_loss`: the weights of the trainer's recomputed log-probs against the
    batch's sampler log-probs, and at ratio 1 the policy loss `-Σ w A m / Σ m`."""
    from test_train_steps import MODEL, _batch

    from agentgym_jax.models.decoder import init_params
    from agentgym_jax.train import scoring, steps

    config = make_update(MODEL, is_cap=1.2, **options)
    params = init_params(MODEL, jax.random.PRNGKey(0))
    batch = _batch(rewards=[1, 0, 0, 1, 1, 1, 0, 1])
    trainer, _, _ = jax.jit(scoring.score, static_argnames="forward")(params, batch, config.forward)
    mask = np.asarray(batch.loss_mask) > 0
    sampler = np.asarray(trainer) + np.random.default_rng(0).normal(scale=0.2, size=mask.shape).astype(np.float32)
    batch = batch.replace(old_logprobs=jnp.asarray(sampler))
    rl_batch, metrics = jax.jit(steps.prepare, static_argnames="config")(params, params, batch, config=config)
    want = ref_weights(np.asarray(rl_batch.old_logprobs, np.float64), sampler.astype(np.float64), mask, level, 1.2, mode)
    np.testing.assert_allclose(rl_batch.is_weights, want, rtol=1e-5, atol=1e-6)
    assert 0 < float(metrics["is_capped_fraction"]) < 1
    _, loss_metrics = jax.jit(steps.rl_loss, static_argnames="config")(params, rl_batch, config)
    advantages = np.asarray(rl_batch.advantages, np.float64)
    np.testing.assert_allclose(loss_metrics["pg_loss"], -(want * advantages)[mask].sum() / mask.sum(), rtol=1e-5, atol=1e-7)
