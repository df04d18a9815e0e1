"""Training at scale: mixed precision (bfloat16 trains, float32 gradient accumulation), log-probs
by chunks of positions equal to the full-vocabulary computation (values and gradients), `prepare`
scoring one micro-batch at a time, remat policies, and micro-batches that must split over the mesh.

Shape checks read the traced program (`jax.make_jaxpr`), so they compile nothing: a
[rows, seq, vocab] or [rows, seq, hidden] intermediate there is one the compiled step would hold.
"""

import collections
import dataclasses
import functools

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import test_train_steps
from test_train_steps import _batch

from agentgym_jax.models.decoder import forward, init_params
from agentgym_jax.parallel.mesh import make_mesh
from agentgym_jax.parallel.partition import batch_sharding
from agentgym_jax.rl.losses import entropy_from_logits
from agentgym_jax.train import scoring, steps
from agentgym_jax.train.state import TrainState, reference_params
from tests.updates import replace
from tests.updates import update as make_update
from configs import babyai_scalinginter, textcraft_grpo

# test_train_steps' model with a vocabulary no other dimension of these programs has (its batches' ids are < 64)
MODEL = dataclasses.replace(test_train_steps.MODEL, vocab_size=96)
VOCAB = MODEL.vocab_size


def intermediate_shapes(jaxpr) -> list[tuple[int, ...]]:
    """Shapes of every value a (closed) jaxpr computes, sub-jaxprs (scan, remat, custom_vjp) included."""
    shapes = []
    for eqn in jaxpr.jaxpr.eqns if hasattr(jaxpr, "jaxpr") else jaxpr.eqns:
        shapes += [tuple(v.aval.shape) for v in eqn.outvars if hasattr(v.aval, "shape")]
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            shapes += intermediate_shapes(sub)
    return shapes


def primitive_counts(jaxpr, counts=None) -> collections.Counter:
    """How often each primitive occurs in a jaxpr, sub-jaxprs included."""
    counts = collections.Counter() if counts is None else counts
    for eqn in jaxpr.eqns:
        counts[eqn.primitive.name] += 1
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            primitive_counts(sub, counts)
    return counts


def _reference_stats(params, tokens, positions):
    """log p and entropy [batch, seq] from the full [batch, seq, vocab] logits, unchunked; 0 where
    nothing predicts the token (a row's first token, padding)."""
    logits, _ = forward(params, tokens, positions, config=MODEL)
    logits = logits[:, :-1]
    logp = jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], axis=-1)[..., 0]
    shift = lambda x: jnp.where(positions > 0, jnp.pad(x, ((0, 0), (1, 0))), 0.0)  # noqa: E731
    return shift(logp), shift(entropy_from_logits(logits))


@pytest.mark.parametrize("chunk", [4, 5])  # 4 divides seq 12; 5 does not (positions padded to 15)
def test_chunked_logprobs_equal_the_full_vocabulary_computation(chunk):
    batch = _batch(rows=4, seq=12)
    params = init_params(MODEL, jax.random.PRNGKey(0))
    config = make_update(MODEL, logprob_chunk=chunk)
    weights = jnp.asarray(np.random.default_rng(0).normal(size=(2, *batch.tokens.shape)), jnp.float32)

    def objective(stats_fn):
        def loss(p):
            logp, entropy = stats_fn(p)
            return jnp.sum(weights[0] * logp) + jnp.sum(weights[1] * entropy), (logp, entropy)
        return jax.jit(jax.value_and_grad(loss, has_aux=True))

    chunked = objective(lambda p: scoring.score(p, batch, config.forward)[:2])
    full = objective(lambda p: _reference_stats(p, batch.tokens, batch.positions))
    (_, got), got_grads = chunked(params)
    (_, want), want_grads = full(params)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, atol=1e-5, rtol=1e-5)
    for path, g in jax.tree_util.tree_leaves_with_path(got_grads):
        w = jax.tree_util.tree_leaves(want_grads)[[p for p, _ in jax.tree_util.tree_leaves_with_path(want_grads)].index(path)]
        scale = max(float(np.max(np.abs(w))), 1e-12)
        assert np.max(np.abs(np.asarray(g) - np.asarray(w))) <= 1e-5 * scale, jax.tree_util.keystr(path)

    # neither pass holds logits for more than one chunk of positions
    shapes = intermediate_shapes(jax.make_jaxpr(jax.grad(
        lambda p: jnp.sum(scoring.score(p, batch, config.forward)[0])))(params))
    vocab_shapes = [s for s in shapes if s and s[-1] == VOCAB and len(s) == 3]
    assert vocab_shapes and all(s[1] == chunk for s in vocab_shapes), vocab_shapes


def test_prepare_runs_one_micro_batch_at_a_time_and_equals_one_pass():
    rows, seq = 16, 12
    batch = _batch(rows=rows, seq=seq)
    params = init_params(MODEL, jax.random.PRNGKey(0))
    split = make_update(MODEL, num_minibatches=2, num_microbatches=2, kl_coef=0.1)
    whole = replace(split, ppo_epochs=2, num_minibatches=1, num_microbatches=1)  # two updates: the policy's pass runs too
    ref = jax.tree.map(lambda x: x * 1.01, params)
    got, got_metrics = jax.jit(steps.prepare, static_argnames="config")(params, ref, batch, config=split)
    want, want_metrics = jax.jit(steps.prepare, static_argnames="config")(params, ref, batch, config=whole)
    for name in ("old_logprobs", "ref_logprobs", "advantages", "returns"):
        np.testing.assert_allclose(getattr(got, name), getattr(want, name), atol=1e-5, rtol=1e-5, err_msg=name)
    for key in want_metrics:
        np.testing.assert_allclose(got_metrics[key], want_metrics[key], atol=1e-5, rtol=1e-5, err_msg=key)

    program = jax.make_jaxpr(functools.partial(steps.prepare, config=split))(params, ref, batch)
    hidden = [s for s in intermediate_shapes(program)
              if len(s) == 3 and s[1:] == (seq, MODEL.hidden_size)]
    assert hidden and {s[0] for s in hidden} == {rows // 4}  # the trunk only ever sees 4 rows


def _bf16_check(param_dtype, compute_dtype):
    """Three SFT updates (AdamW, two micro-batches) on one fixed batch: (params before, after, losses)."""
    params = init_params(MODEL, jax.random.PRNGKey(0), param_dtype=jnp.dtype(param_dtype))
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-3, weight_decay=0.01))
    state = TrainState.create(params, tx, jax.random.PRNGKey(1))
    config = make_update(MODEL, num_microbatches=2, compute_dtype=compute_dtype)
    update = jax.jit(steps.sft_update, static_argnames="config")
    batch, losses = _batch(rows=8), []
    for _ in range(3):
        state, metrics = update(state, batch, config)
        losses.append(float(metrics["loss"]))
    return params, state, losses


@pytest.mark.parametrize("param_dtype, compute_dtype", [("bfloat16", None), ("float32", "bfloat16")])
def test_bfloat16_training_traces_moves_the_params_and_lowers_the_loss(param_dtype, compute_dtype):
    before, state, losses = _bf16_check(param_dtype, compute_dtype)
    leaves = jax.tree.leaves(state.params)
    assert {x.dtype for x in leaves} == {jnp.dtype(param_dtype)}  # master weights keep their dtype
    adam = state.opt_state[1][0]
    assert {x.dtype for x in jax.tree.leaves((adam.mu, adam.nu))} == {jnp.dtype(param_dtype)}
    moved = [not np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
             for a, b in zip(jax.tree.leaves(before), leaves)]
    assert all(moved)
    assert int(state.step) == 3 and int(state.skipped_updates) == 0
    assert losses[2] < losses[1] < losses[0], losses


def test_reference_params_are_a_separate_copy_in_the_compute_dtype():
    params = init_params(MODEL, jax.random.PRNGKey(0))
    ref = reference_params(params, "bfloat16")
    assert {x.dtype for x in jax.tree.leaves(ref)} == {jnp.dtype(jnp.bfloat16)}
    np.testing.assert_allclose(np.asarray(ref["embed"]["embedding"], np.float32), params["embed"]["embedding"],
                               rtol=1e-2)
    same = reference_params(params, None)
    assert all(a.dtype == b.dtype and a.unsafe_buffer_pointer() != b.unsafe_buffer_pointer()
               for a, b in zip(jax.tree.leaves(same), jax.tree.leaves(params)))


def test_remat_policies_give_the_same_gradient_and_recompute_what_they_say():
    """"full" recomputes every projection in the backward pass, "dots" keeps them; True is "full"."""
    batch = _batch(rows=4)
    params = init_params(MODEL, jax.random.PRNGKey(0))

    def grad(policy):
        config = make_update(MODEL, remat=policy)
        loss = lambda p: jnp.sum(scoring.score(p, batch, config.forward)[0])  # noqa: E731
        return jax.jit(jax.grad(loss))(params), primitive_counts(jax.make_jaxpr(jax.grad(loss))(params).jaxpr)

    (want, plain), *others = (grad(policy) for policy in ("none", "full", "dots", True))
    for got, _ in others:
        jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, atol=1e-6, rtol=1e-5), got, want)
    (_, full), (_, dots), (_, flag) = others
    assert full["remat2"] == dots["remat2"] == plain["remat2"] + 1  # the layer (the log-prob chunks always)
    assert plain["dot_general"] < dots["dot_general"] < full["dot_general"]  # dots recomputes only attention's
    assert flag == full


def test_unknown_remat_policy_and_bad_chunk_are_clear_errors():
    with pytest.raises(ValueError, match="unknown remat policy 'some'; valid: none, full, dots"):
        make_update(MODEL, remat="some")
    with pytest.raises(ValueError, match="logprob_chunk must be >= 1.*got 0"):
        make_update(MODEL, logprob_chunk=0)


def test_micro_batch_smaller_than_the_batch_shards_is_a_clear_error():
    mesh = make_mesh(1, 8, 1)
    config = make_update(MODEL, num_minibatches=2, num_microbatches=8, activation_sharding=batch_sharding(mesh))
    steps.check_microbatches(128, config)  # 8 rows per micro-batch: one per shard
    message = (r"mini-batch of 64 rows / num_microbatches=16 = 4 rows per micro-batch, but the mesh has 8 batch "
               r"shards \(data x fsdp\).*set num_microbatches to a divisor of 8")
    with pytest.raises(ValueError, match=message):
        steps.check_microbatches(128, replace(config, num_microbatches=16))
    with pytest.raises(ValueError, match="no num_microbatches fits"):
        steps.check_microbatches(12, replace(config, num_minibatches=1, num_microbatches=1))
    # the steps themselves refuse such a batch when they are traced
    fns = steps.make_step_fns(replace(config, activation_sharding=None, num_microbatches=16), mesh,
                              steps.train_state_shardings(jax.eval_shape(
                                  lambda: TrainState.create(init_params(MODEL, jax.random.PRNGKey(0)),
                                                            optax.sgd(0.1), jax.random.PRNGKey(1))), mesh))
    params = init_params(MODEL, jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match="4 rows per micro-batch, but the mesh has 8 batch shards"):
        fns.prepare(params, params, _batch(rows=128))


@pytest.mark.parametrize("module", [textcraft_grpo, babyai_scalinginter])
def test_large_model_configs_split_their_micro_batches_over_8_devices(module):
    config = module.get_config()
    assert (config.model.param_dtype, config.model.compute_dtype) == ("float32", "bfloat16")
    rows = config.rollout.batch_tasks * config.rollout.group_size
    update = make_update(
        MODEL, num_minibatches=config.algo.num_minibatches, num_microbatches=config.algo.num_microbatches,
        remat=config.model.remat, logprob_chunk=config.model.logprob_chunk,
        activation_sharding=batch_sharding(make_mesh(1, 8, 1)),
    )
    steps.check_microbatches(rows, update)
    assert rows // (update.batching.num_minibatches * update.batching.num_microbatches) == 8  # rows per micro-batch
