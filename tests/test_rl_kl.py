"""KL estimators on hand-computed examples and on an exact categorical KL; the KL loss and the
KL-in-reward penalty vs float64 loop references."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from rl_batches import random_loss_mask, with_garbage

from agentgym_jax.rl import kl

ESTIMATORS = ("k1", "k2", "k3", "low_var_kl")


def test_estimators_on_a_hand_computed_token():
    """p = 0.5 under the policy, q = 0.25 under the reference."""
    p, q = 0.5, 0.25
    want = {
        "k1": math.log(2),  # log p/q
        "k2": 0.5 * math.log(2) ** 2,  # (log p/q)^2 / 2
        "k3": 0.5 - math.log(0.5) - 1,  # q/p - log(q/p) - 1 = 0.19315
        "low_var_kl": 0.5 - math.log(0.5) - 1,  # far from the clamp
    }
    for name in ESTIMATORS:
        got = kl.KL_ESTIMATORS[name](jnp.log(jnp.float32(p)), jnp.log(jnp.float32(q)))
        assert float(got) == pytest.approx(want[name], rel=1e-6), name


def test_low_var_kl_is_k3_clamped_at_10():
    # reference far less likely: k3 = e^-20 + 20 - 1 ~ 19; reference far more likely: e^20 - 21
    logprobs, ref = jnp.asarray([0.0, -20.0, -1.0]), jnp.asarray([-20.0, 0.0, -1.5])
    want_k3 = [math.exp(-20) + 19, math.exp(20) - 21]
    np.testing.assert_allclose(kl.k3(logprobs, ref)[:2], want_k3, rtol=1e-6)
    np.testing.assert_allclose(
        kl.low_var_kl(logprobs, ref), [10.0, 10.0, math.exp(-0.5) + 0.5 - 1], rtol=1e-6
    )


def test_k1_and_k3_average_to_the_exact_kl_under_the_policy():
    """E_{x~p}[k1] = E_{x~p}[k3] = KL(p || q) for categoricals; k2 is biased (larger here)."""
    p = np.array([0.5, 0.2, 0.15, 0.1, 0.05])
    q = np.array([0.1, 0.3, 0.2, 0.25, 0.15])
    exact = sum(pi * math.log(pi / qi) for pi, qi in zip(p, q))
    for name, unbiased in (("k1", True), ("k3", True), ("k2", False)):
        per_token = kl.KL_ESTIMATORS[name](jnp.log(jnp.asarray(p)), jnp.log(jnp.asarray(q)))
        expectation = float(jnp.sum(jnp.asarray(p) * per_token))
        assert (abs(expectation - exact) < 1e-6) == unbiased, name


def ref_kl(logprobs, ref, name):
    d = logprobs - ref
    if name == "k1":
        return d
    if name == "k2":
        return d * d / 2
    k3 = math.exp(-d) + d - 1
    return min(k3, 10.0) if name == "low_var_kl" else k3


def ref_token_mean(x, mask):
    vals = [x[i, t] for i, t in zip(*np.nonzero(mask))]
    return sum(vals) / len(vals)


@jax.jit
def every_estimator(logprobs, ref_logprobs, token_rewards, mask):
    return {
        name: (
            kl.kl_loss(logprobs, ref_logprobs, mask, estimator=name, agg_mode="token-mean"),
            kl.apply_kl_penalty(
                token_rewards, logprobs, ref_logprobs, mask, kl_coef=0.1, estimator=name
            ),
        )
        for name in ESTIMATORS
    }


def test_kl_loss_and_penalty_match_reference():
    rng = np.random.default_rng(0)
    mask = random_loss_mask(rng, 8, 20)
    logprobs = np.asarray(np.log(rng.uniform(0.01, 1, mask.shape)), np.float32).astype(float)
    ref = np.asarray(logprobs + rng.normal(scale=2.0, size=mask.shape), np.float32).astype(float)
    rewards = np.asarray(rng.normal(size=mask.shape), np.float32).astype(float)
    results = every_estimator(
        jnp.asarray(with_garbage(rng, logprobs, mask), jnp.float32),
        jnp.asarray(with_garbage(rng, ref, mask), jnp.float32),
        jnp.asarray(rewards, jnp.float32),
        jnp.asarray(mask),
    )
    for name, (loss, (penalised, per_token)) in results.items():
        want_kl = np.zeros(mask.shape)
        for i, t in zip(*np.nonzero(mask)):
            want_kl[i, t] = ref_kl(logprobs[i, t], ref[i, t], name)
        assert abs(float(loss) - ref_token_mean(want_kl, mask)) < 1e-5 * max(1, abs(float(loss)))
        np.testing.assert_allclose(per_token, want_kl, rtol=1e-5, atol=1e-5)
        # Policy tokens pay kl_coef * kl; environment tokens keep their reward untouched.
        np.testing.assert_allclose(penalised, rewards - 0.1 * want_kl, rtol=1e-5, atol=1e-5)
    assert np.any(np.asarray(results["k3"][1][1]) > 10)  # the clamp of low_var_kl was exercised


def test_kl_loss_gradient_of_k3():
    """d k3 / d logprob = 1 - exp(ref - logprob), averaged over the policy tokens."""
    mask = jnp.asarray([[1, 1, 0], [0, 1, 0]], bool)
    logprobs = jnp.asarray([[-1.0, -2.0, jnp.inf], [0.0, -0.5, 0.0]])
    ref = jnp.asarray([[-1.5, -1.0, 0.0], [-jnp.inf, -0.7, 0.0]])
    grad = jax.grad(
        lambda lp: kl.kl_loss(lp, ref, mask, estimator="k3", agg_mode="token-mean")
    )(logprobs)
    want = np.zeros((2, 3))
    for i, t in ((0, 0), (0, 1), (1, 1)):
        want[i, t] = (1 - math.exp(float(ref[i, t]) - float(logprobs[i, t]))) / 3
    np.testing.assert_allclose(grad, want, rtol=1e-5, atol=1e-7)


def test_bad_requests_are_refused():
    x = jnp.zeros((2, 3))
    with pytest.raises(ValueError, match="estimator 'kl'; valid: k1, k2, k3, low_var_kl"):
        kl.kl_divergence(x, x, x, "kl")
    with pytest.raises(ValueError, match="shape mismatch"):
        kl.kl_loss(x, jnp.zeros((2, 4)), x, estimator="k1", agg_mode="token-mean")
    with pytest.raises(ValueError, match="unknown agg_mode"):
        kl.kl_loss(x, x, x, estimator="k1", agg_mode="sum")
