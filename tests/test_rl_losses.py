"""PPO losses, entropy and loss aggregation vs float64 references written here as plain loops."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from rl_batches import random_loss_mask, with_garbage

from agentgym_jax.rl import kl, losses, masked

BATCH, SEQ, VOCAB = 8, 20, 7
SEEDS = range(3)
TOL = dict(rtol=1e-5, atol=1e-5)
MODES = masked.LOSS_AGG_MODES
NORM_LENGTH = 16.0  # the constant of seq-mean-token-sum-norm (Dr. GRPO); the other modes ignore it


def every_mode(fn):
    """`fn` under one `jax.jit` for all aggregation modes at once: `{agg_mode: fn(...)}`."""
    return jax.jit(lambda *args, **kwargs: {m: fn(*args, agg_mode=m, norm_length=NORM_LENGTH, **kwargs) for m in MODES})


PPO = jax.jit(losses.ppo_policy_loss, static_argnames=("agg_mode",))
PPO_MODES = every_mode(losses.ppo_policy_loss)
VALUE_MODES = every_mode(losses.value_loss)
ENTROPY_MODES = every_mode(losses.entropy_bonus)
AGGREGATE_MODES = every_mode(masked.aggregate_loss)


# ---- references (float64, loops) --------------------------------------------------------------


def ref_aggregate(loss, mask, mode):
    rows = []
    for i in range(loss.shape[0]):
        tokens = [loss[i, t] for t in range(loss.shape[1]) if mask[i, t]]
        if tokens:
            rows.append(tokens)
    if not rows:
        return 0.0
    if mode == "token-mean":
        return sum(sum(r) for r in rows) / sum(len(r) for r in rows)
    if mode == "seq-mean-token-sum":
        return sum(sum(r) for r in rows) / len(rows)
    if mode == "seq-mean-token-sum-norm":
        return sum(sum(r) / NORM_LENGTH for r in rows) / len(rows)
    return sum(sum(r) / len(r) for r in rows) / len(rows)


def ref_ppo(logprobs, old, advantages, mask, eps_low, eps_high, dual_c):
    """Per-token loss, clipped / dual-clipped indicators, k3 approx KL, loops."""
    loss, clipped, dual, approx_kl = (np.zeros(mask.shape) for _ in range(4))
    for i, t in zip(*np.nonzero(mask)):
        ratio = math.exp(logprobs[i, t] - old[i, t])
        a = advantages[i, t]
        plain = -a * ratio
        clip = -a * min(max(ratio, 1 - eps_low), 1 + eps_high)
        loss[i, t] = max(plain, clip)
        clipped[i, t] = clip > plain
        if dual_c is not None and a < 0 and loss[i, t] > -a * dual_c:
            loss[i, t], dual[i, t] = -a * dual_c, 1.0
        approx_kl[i, t] = ratio - 1 - math.log(ratio)
    return loss, clipped, dual, approx_kl


def ref_entropy(logits):
    out = np.zeros(logits.shape[:-1])
    for idx in np.ndindex(*logits.shape[:-1]):
        row = logits[idx]
        top = max(row)
        log_z = top + math.log(sum(math.exp(x - top) for x in row))
        out[idx] = -sum(math.exp(x - log_z) * (x - log_z) for x in row)
    return out


def ref_token_mean(x, mask):
    vals = [x[i, t] for i, t in zip(*np.nonzero(mask))]
    return sum(vals) / len(vals)


# ---- inputs -------------------------------------------------------------------------------------


def f32_exact(x):
    """Rounds to float32 so the float64 reference sees exactly the inputs the code sees."""
    return np.asarray(x, np.float32).astype(np.float64)


def ppo_batch(seed):
    rng = np.random.default_rng(seed)
    mask = random_loss_mask(rng, BATCH, SEQ)
    old = f32_exact(np.log(rng.uniform(0.05, 1.0, mask.shape)))
    logprobs = f32_exact(old + rng.normal(scale=0.5, size=mask.shape))
    advantages = f32_exact(rng.normal(size=mask.shape))
    return rng, mask, logprobs, old, advantages


def garbage(rng, x, mask):
    return jnp.asarray(with_garbage(rng, x, mask), jnp.float32)


# ---- aggregation and masked utilities -----------------------------------------------------------


def test_aggregate_loss_matches_reference():
    for seed in SEEDS:
        rng = np.random.default_rng(seed)
        mask = random_loss_mask(rng, BATCH, SEQ)  # row 1 is all-masked
        loss = f32_exact(rng.normal(size=mask.shape))
        got = AGGREGATE_MODES(garbage(rng, loss, mask), jnp.asarray(mask))
        for mode in MODES:
            assert abs(float(got[mode]) - ref_aggregate(loss, mask, mode)) < 1e-5
    # Nothing to average: 0, not NaN.
    nothing = AGGREGATE_MODES(jnp.ones((BATCH, SEQ)), jnp.zeros((BATCH, SEQ), bool))
    assert {m: float(v) for m, v in nothing.items()} == dict.fromkeys(MODES, 0.0)


def test_seq_modes_ignore_all_masked_rows_and_weigh_sequences_equally():
    loss = np.array([[1.0, 1.0, 1.0, 1.0], [4.0, 0.0, 0.0, 0.0], [9.0, 9.0, 9.0, 9.0]])
    mask = np.array([[1, 1, 1, 1], [1, 0, 0, 0], [0, 0, 0, 0]], bool)
    got = {m: float(v) for m, v in AGGREGATE_MODES(jnp.asarray(loss), jnp.asarray(mask)).items()}
    want = {"token-mean": 8 / 5, "seq-mean-token-sum": 8 / 2, "seq-mean-token-mean": 5 / 2,
            "seq-mean-token-sum-norm": (4 / NORM_LENGTH + 4 / NORM_LENGTH) / 2}
    assert got == pytest.approx(want, rel=1e-6)
    with pytest.raises(ValueError, match="unknown agg_mode 'mean'; valid: token-mean"):
        masked.aggregate_loss(jnp.asarray(loss), jnp.asarray(mask), "mean")


def test_masked_whiten_and_var_edge_cases():
    mask = jnp.asarray([[1, 1, 0], [1, 0, 0]], bool)
    constant = jnp.asarray([[0.3, 0.3, 5.0], [0.3, jnp.inf, -1.0]], jnp.float32)
    np.testing.assert_array_equal(masked.masked_whiten(constant, mask), 0.0)  # not 1e-4 residue
    one = jnp.asarray([[0, 0, 1], [0, 0, 0]], bool)
    assert float(masked.masked_var(constant, one)) == 0.0  # ddof=1 with one entry: 0, not NaN
    np.testing.assert_array_equal(masked.masked_whiten(constant, one), 0.0)
    x = np.array([[1.0, 2.0, 7.0], [4.0, 0.0, 0.0]])
    vals = [1.0, 2.0, 4.0]
    mean = sum(vals) / 3
    var = sum((v - mean) ** 2 for v in vals) / 2
    assert abs(float(masked.masked_var(jnp.asarray(x), mask)) - var) < 1e-5
    want = np.where(np.asarray(mask), (x - mean) / math.sqrt(var + 1e-8), 0.0)
    np.testing.assert_allclose(masked.masked_whiten(jnp.asarray(x), mask), want, **TOL)


# ---- PPO policy loss ----------------------------------------------------------------------------


@pytest.mark.parametrize("eps_low,eps_high,dual_c", [(0.2, 0.2, None), (0.2, 0.28, 1.5)])
def test_ppo_policy_loss_matches_reference(eps_low, eps_high, dual_c):
    for seed in SEEDS:
        rng, mask, logprobs, old, advantages = ppo_batch(seed)
        results = PPO_MODES(
            jnp.asarray(logprobs, jnp.float32),
            garbage(rng, old, mask),
            garbage(rng, advantages, mask),
            jnp.asarray(mask),
            clip_eps_low=eps_low,
            clip_eps_high=eps_high,
            dual_clip_c=dual_c,
        )
        tokens, clipped, dual, approx_kl = ref_ppo(
            logprobs, old, advantages, mask, eps_low, eps_high, dual_c
        )
        for mode, (loss, metrics) in results.items():
            assert abs(float(loss) - ref_aggregate(tokens, mask, mode)) < 1e-5
            assert abs(float(metrics["clip_fraction"]) - ref_token_mean(clipped, mask)) < 1e-6
            assert abs(float(metrics["dual_clip_fraction"]) - ref_token_mean(dual, mask)) < 1e-6
            assert abs(float(metrics["approx_kl"]) - ref_token_mean(approx_kl, mask)) < 1e-5
        assert ref_token_mean(clipped, mask) > 0  # the clipped branch was exercised
        assert (dual_c is None) or ref_token_mean(dual, mask) > 0


def test_dual_clip_active_and_inactive_by_hand():
    """One token each: (A, ratio) -> expected per-token loss with eps=0.2 and c=3."""
    cases = [
        (-1.0, 10.0, 10.0, 3.0),  # A<0, huge ratio: plain PPO loss 10, dual clip caps at 3
        (-1.0, 2.0, 2.0, 2.0),  # A<0, ratio 2 < c: dual clip inactive
        (1.0, 10.0, -1.2, -1.2),  # A>0: dual clip never applies (clipped at 1 + eps)
        (-2.0, 0.5, 1.6, 1.6),  # A<0, ratio below 1 - eps: the clipped term is active
    ]
    for c, column in ((None, 2), (3.0, 3)):
        for case in cases:
            a, ratio, want = case[0], case[1], case[column]
            loss, metrics = PPO(
                jnp.log(jnp.full((1, 1), ratio)),
                jnp.zeros((1, 1)),
                jnp.full((1, 1), a),
                jnp.ones((1, 1), bool),
                agg_mode="token-mean",
                dual_clip_c=c,
            )
            assert float(loss) == pytest.approx(want, rel=1e-6)
            assert float(metrics["dual_clip_fraction"]) == float(want != case[2])
            assert float(metrics["clip_fraction"]) == float(case in cases[2:])


def test_ppo_gradient_is_the_surrogate_gradient():
    """d(token-mean loss) / d logprob_t = -A_t ratio_t / N where the unclipped term is active."""
    rng, mask, logprobs, old, advantages = ppo_batch(7)
    old_f32, advantages_f32 = garbage(rng, old, mask), garbage(rng, advantages, mask)

    def loss(lp):
        return PPO(lp, old_f32, advantages_f32, jnp.asarray(mask), agg_mode="token-mean")[0]

    grad = jax.grad(loss)(jnp.asarray(logprobs, jnp.float32))
    n = mask.sum()
    want = np.zeros(mask.shape)
    for i, t in zip(*np.nonzero(mask)):
        ratio = math.exp(logprobs[i, t] - old[i, t])
        a = advantages[i, t]
        if -a * min(max(ratio, 0.8), 1.2) <= -a * ratio:  # unclipped term active
            want[i, t] = -a * ratio / n
    np.testing.assert_allclose(grad, want, **TOL)


def test_bad_clip_settings_are_refused():
    x = jnp.zeros((2, 3))
    with pytest.raises(ValueError, match="dual_clip_c must be > 1, got 1.0"):
        losses.ppo_policy_loss(x, x, x, x, agg_mode="token-mean", dual_clip_c=1.0)
    with pytest.raises(ValueError, match="clip_eps_high must be >= 0, got -0.1"):
        losses.ppo_policy_loss(x, x, x, x, agg_mode="token-mean", clip_eps_high=-0.1)
    with pytest.raises(ValueError, match=r"mismatch: logprobs \(2, 3\), old_logprobs \(2, 4\)"):
        losses.ppo_policy_loss(x, jnp.zeros((2, 4)), x, x, agg_mode="token-mean")
    with pytest.raises(ValueError, match="clip_eps_value must be >= 0"):
        losses.value_loss(x, x, x, x, agg_mode="token-mean", clip_eps_value=-1.0)


# ---- value loss and entropy ---------------------------------------------------------------------


def test_value_loss_matches_reference():
    eps = 0.5
    for seed in SEEDS:
        rng = np.random.default_rng(seed)
        mask = random_loss_mask(rng, BATCH, SEQ)
        old = f32_exact(rng.normal(size=mask.shape))
        values = f32_exact(old + rng.normal(scale=0.8, size=mask.shape))
        returns = f32_exact(rng.normal(size=mask.shape))
        results = VALUE_MODES(
            garbage(rng, values, mask),
            garbage(rng, old, mask),
            garbage(rng, returns, mask),
            jnp.asarray(mask),
            clip_eps_value=eps,
        )
        tokens, clipped = np.zeros(mask.shape), np.zeros(mask.shape)
        for i, t in zip(*np.nonzero(mask)):
            v_clip = min(max(values[i, t], old[i, t] - eps), old[i, t] + eps)
            plain, clip = (values[i, t] - returns[i, t]) ** 2, (v_clip - returns[i, t]) ** 2
            tokens[i, t], clipped[i, t] = 0.5 * max(plain, clip), clip > plain
        for mode, (loss, metrics) in results.items():
            assert abs(float(loss) - ref_aggregate(tokens, mask, mode)) < 1e-5
            assert abs(float(metrics["value_clip_fraction"]) - ref_token_mean(clipped, mask)) < 1e-6
        assert ref_token_mean(clipped, mask) > 0


def test_entropy_bonus_matches_reference():
    rng = np.random.default_rng(0)
    mask = random_loss_mask(rng, BATCH, SEQ)
    logits = f32_exact(rng.normal(scale=3.0, size=(BATCH, SEQ, VOCAB)))
    padded = np.where(mask[..., None], logits, np.inf)  # garbage logits on padding
    got = ENTROPY_MODES(jnp.asarray(padded, jnp.float32), jnp.asarray(mask))
    for mode in MODES:
        assert abs(float(got[mode]) - ref_aggregate(ref_entropy(logits), mask, mode)) < 1e-5
    np.testing.assert_allclose(
        losses.entropy_from_logits(jnp.zeros((VOCAB,))), math.log(VOCAB), rtol=1e-6
    )
    with pytest.raises(ValueError, match="must be loss_mask"):
        losses.entropy_bonus(jnp.zeros((2, 3)), jnp.ones((2, 3)), agg_mode="token-mean")


# ---- gradients with all-masked rows -------------------------------------------------------------


def test_full_loss_gradients_finite_with_all_masked_rows():
    """PPO + value + entropy + KL in every aggregation mode, with all-masked rows and inf / 1e30
    garbage off the mask: gradients are finite, zero off the mask, non-zero on policy tokens; an
    all-masked batch gives loss 0 and zero gradients."""
    rng = np.random.default_rng(3)
    mask = random_loss_mask(rng, BATCH, SEQ)
    mask[5] = False  # a second all-masked row
    labels = rng.integers(0, VOCAB, size=mask.shape)
    logits = jnp.asarray(rng.normal(size=(BATCH, SEQ, VOCAB)), jnp.float32)
    values = jnp.asarray(rng.normal(size=mask.shape), jnp.float32)
    fields = {
        name: garbage(rng, rng.normal(size=mask.shape) - (name.endswith("logprobs") * 2.0), mask)
        for name in ("old_logprobs", "ref_logprobs", "advantages", "old_values", "returns")
    }

    def total_loss(logits, values, m, mode):
        logprobs = jnp.take_along_axis(jax.nn.log_softmax(logits), labels[..., None], -1)[..., 0]
        pg, _ = losses.ppo_policy_loss(
            logprobs,
            fields["old_logprobs"],
            fields["advantages"],
            m,
            agg_mode=mode,
            norm_length=NORM_LENGTH,
            dual_clip_c=3.0,
        )
        vf, _ = losses.value_loss(values, fields["old_values"], fields["returns"], m, agg_mode=mode, norm_length=NORM_LENGTH)
        ent = losses.entropy_bonus(logits, m, agg_mode=mode, norm_length=NORM_LENGTH)
        kl_term = kl.kl_loss(
            logprobs, fields["ref_logprobs"], m, estimator="low_var_kl", agg_mode=mode, norm_length=NORM_LENGTH
        )
        return pg + 0.5 * vf - 0.01 * ent + 0.1 * kl_term

    @jax.jit
    def grads(m):
        grad_fn = jax.value_and_grad(total_loss, argnums=(0, 1))
        return {mode: grad_fn(logits, values, m, mode) for mode in MODES}

    for mode, (loss, (g_logits, g_values)) in grads(jnp.asarray(mask)).items():
        assert np.isfinite(float(loss)), mode
        for g, policy in ((np.asarray(g_logits), mask[..., None]), (np.asarray(g_values), mask)):
            assert np.all(np.isfinite(g)), mode
            assert np.all(np.where(policy, 0.0, g) == 0.0), mode
            assert np.abs(g[mask]).sum() > 0, mode
    for loss, (g_logits, g_values) in grads(jnp.zeros_like(mask)).values():
        assert float(loss) == 0.0
        assert np.all(np.asarray(g_logits) == 0.0) and np.all(np.asarray(g_values) == 0.0)
