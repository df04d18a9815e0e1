"""The jitted update steps: alignment of log-probs, exact micro-batch accumulation, ppo_epochs
honoured, non-finite updates skipped, the policy moving the way the advantages say, the sharded
update equal to the single-device one, and no recompilation after the first step.

Compilation dominates this file's time (each update step is seconds of XLA CPU compilation), so
tests share compiled steps: one `StepFns` per config (`step_fns`), one optimizer object (`TX`: the
optimizer is a static field of `TrainState`, and a new one means a new compilation) and one
reference update (`single_device_update`). XLA optimisations are off, as in the whole suite
(tests/conftest.py): every comparison is with numpy or with a step compiled the same way.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P
from test_sampler import count_compilations
from test_sharding import assert_close

from agentgym_jax.models.config import ModelConfig
from agentgym_jax.models.decoder import forward, init_params
from agentgym_jax.models.kernels import AttentionKernels
from agentgym_jax.parallel.mesh import make_mesh
from agentgym_jax.rollout.batch import TokenBatch
from agentgym_jax.train import microbatch, scoring, steps
from agentgym_jax.train.state import TrainState
from tests.updates import replace
from tests.updates import update as make_update

MODEL = ModelConfig.small("qwen2", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                          num_heads=4, num_kv_heads=2, head_dim=8)
TX = optax.sgd(1e-2, momentum=0.9)  # momentum: an optimizer state that mirrors the params
# Epochs x mini-batches x micro-batches and a KL term: the shared config of most tests below, on
# EPOCH_ROWS rows: 4 per micro-batch, one per batch shard of the largest mesh below (data 2 x fsdp 2).
EPOCHS = make_update(MODEL, ppo_epochs=3, num_minibatches=2, num_microbatches=2, kl_coef=0.1)
EPOCH_ROWS = 16
rl_loss_jit = jax.jit(steps.rl_loss, static_argnames="config")


@functools.cache
def step_fns(config: steps.UpdateConfig) -> steps.StepFns:
    """Single-device steps, one per config for the whole module."""
    return steps.make_step_fns(config)


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


def _state(tx=TX, value_head=False):
    params = init_params(MODEL, jax.random.PRNGKey(0), value_head=value_head)
    return TrainState.create(params, tx, jax.random.PRNGKey(1))


@pytest.fixture(scope="module")
def single_device_update():
    """`EPOCHS` on one device from `_state()` on `_batch()`: (state, prepare metrics, update metrics)."""
    fns = step_fns(EPOCHS)
    state = _state()
    rl_batch, prep_metrics = fns.prepare(state.params, state.params, _batch(EPOCH_ROWS))
    state, metrics = fns.rl_update(state, rl_batch)
    return state, prep_metrics, metrics


def test_token_logprobs_line_up_with_the_tokens_they_score():
    batch = _batch()
    config = make_update(MODEL)
    params = _state().params
    logp, entropy, _ = jax.jit(scoring.score, static_argnames="forward")(params, batch, config.forward)
    logits, _ = jax.jit(forward, static_argnames="config")(params, batch.tokens, batch.positions, config=MODEL)
    logits = np.asarray(logits, np.float64)
    tokens = np.asarray(batch.tokens)
    for b, t in [(0, 1), (3, 5), (7, 5)]:
        row = logits[b, t - 1] - logits[b, t - 1].max()
        log_softmax = row - np.log(np.exp(row).sum())
        assert abs(logp[b, t] - log_softmax[tokens[b, t]]) < 1e-5
        assert abs(entropy[b, t] + (np.exp(log_softmax) * log_softmax).sum()) < 1e-4
    unpredicted = (np.arange(tokens.shape[1]) == 0) | (np.asarray(batch.positions) < 0)  # a row's first token, padding
    assert np.all(np.asarray(logp)[unpredicted] == 0) and np.all(np.asarray(entropy)[unpredicted] == 0)


@pytest.mark.parametrize("agg_mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_micro_batch_accumulation_gives_the_full_batch_gradient(agg_mode):
    batch = _batch()
    full, micro = (make_update(MODEL, agg_mode=agg_mode, num_microbatches=n) for n in (1, 4))
    a, metrics_a = step_fns(full).sft_update(_state(), batch)
    b, metrics_b = step_fns(micro).sft_update(_state(), batch)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=2e-4, atol=1e-6), a.params, b.params)
    np.testing.assert_allclose(metrics_a["loss"], metrics_b["loss"], rtol=1e-5)
    np.testing.assert_allclose(metrics_a["grad_norm"], metrics_b["grad_norm"], rtol=1e-4)


def test_length_buckets_are_the_sequence_and_its_halvings():
    assert microbatch.length_buckets(3072, 4) == (3072, 1536, 768, 384)
    assert microbatch.length_buckets(128, 4) == (128, 64)  # never below one multiple
    assert microbatch.length_buckets(3072, 1) == (3072,)
    with pytest.raises(ValueError, match="length_buckets must be >= 1, got 0"):
        make_update(MODEL, length_buckets=0)


def test_evenly_spaced_length_buckets_split_the_sequence_in_equal_steps():
    assert microbatch.length_buckets(1536, 4, spacing="even") == (1536, 1152, 768, 384)
    assert microbatch.length_buckets(1000, 3, spacing="even") == (1000, 704, 384)  # 667, 334 rounded up to 64
    assert microbatch.length_buckets(128, 4, spacing="even") == (128, 64)
    with pytest.raises(ValueError, match="length_spacing='linear' is not one of halving, even"):
        make_update(MODEL, length_spacing="linear")


def _ragged_batch(rows: int, seq: int, lengths: np.ndarray) -> TokenBatch:
    """`_batch` with the given row lengths (right-padded), every row with some policy tokens."""
    batch = _batch(rows, seq, seed=3)
    positions = np.where(np.arange(seq)[None] < lengths[:, None], np.arange(seq)[None], -1)
    mask = np.asarray(batch.loss_mask) * (positions > 0)
    mask[np.arange(rows), lengths - 1] = 1
    rewards = np.zeros((rows, seq), np.float32)
    rewards[np.arange(rows), lengths - 1] = np.asarray(batch.scores)
    return batch.replace(positions=jnp.asarray(positions, jnp.int32), loss_mask=jnp.asarray(mask, jnp.float32),
                         token_rewards=jnp.asarray(rewards))


RAGGED_LENGTHS = np.array([200, 14, 60, 256, 24, 120, 18, 66, 40, 128, 10, 180, 30, 80, 50, 22])
PADDED = replace(EPOCHS, num_minibatches=1, num_microbatches=4)  # 4 rows per micro-batch
GROUPED = replace(PADDED, length_buckets=3)  # 256 / 128 / 64
# Rows of 200, 256, 120 and 180 tokens that train nothing (a group dynamic sampling left out): they
# need no position, and grouped, they fill a micro-batch that is not run at all.
DROPPED = np.array([0, 3, 5, 11])


def _run_lengths(needed: np.ndarray) -> list[int]:
    """What a grouped pass over 4 micro-batches of 4 runs: each at the shortest of 256 / 128 / 64
    holding its longest row, and a micro-batch of rows that need no position not at all."""
    groups = np.sort(needed).reshape(4, 4).max(axis=1)
    return [0 if g == 0 else min(length for length in (256, 128, 64) if length >= g) for g in groups]


@pytest.fixture(scope="module")
def ragged_updates():
    """`PADDED` and `GROUPED` on one device, on 16 rows of `RAGGED_LENGTHS` tokens padded to 256
    (the `DROPPED` rows without a policy token): each config's prepared batch, prepare metrics,
    and update."""
    batch = _ragged_batch(16, 256, RAGGED_LENGTHS)
    batch = batch.replace(loss_mask=batch.loss_mask.at[DROPPED].set(0))  # rows a batch filter dropped
    results = {}
    for config in (PADDED, GROUPED):
        fns = step_fns(config)
        state = _state()
        rl_batch, prep_metrics = fns.prepare(state.params, state.params, batch)
        results[config.batching.length_buckets] = (rl_batch, prep_metrics, *fns.rl_update(state, rl_batch))
    return batch, results


def test_length_grouped_micro_batches_give_the_padded_update_on_fewer_positions(ragged_updates):
    """Micro-batches grouped by length and cut to their own bucket: the same params and loss as
    the update over the padded rows, and the share of positions run is what the row lengths give
    (sorted, 4 per micro-batch, each at the shortest of 256 / 128 / 64 holding its longest row;
    a row that trains nothing needs no position, a micro-batch of such rows runs nothing)."""
    _, results = ragged_updates
    (_, _, a, metrics_a), (_, _, b, metrics_b) = results[1], results[3]
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=2e-4, atol=1e-6), a.params, b.params)
    np.testing.assert_allclose(metrics_a["loss"], metrics_b["loss"], rtol=1e-5)
    needed = RAGGED_LENGTHS.copy()
    needed[DROPPED] = 0
    run = _run_lengths(needed)
    assert run == [0, 64, 64, 128]
    assert float(metrics_a["length_fraction"]) == 1.0
    np.testing.assert_allclose(metrics_b["length_fraction"], np.mean(run) / 256)  # 0.25


def test_evenly_spaced_lengths_give_the_padded_update_on_the_positions_they_name():
    """Parts needing 40, 100, 150 and 250 of 256 positions run at 64, 128, 192 and 256 with 4
    evenly spaced lengths (halvings: 64, 128, 256, 256): the padded update's params and scores."""
    lengths = np.array([40, 12, 30, 20, 100, 70, 90, 80, 150, 130, 140, 110, 250, 200, 180, 160])
    batch = _ragged_batch(16, 256, lengths)
    even = replace(PADDED, length_buckets=4, length_spacing="even")
    runs = []
    for config in (PADDED, even):
        fns, state = step_fns(config), _state()
        rl_batch, prep_metrics = fns.prepare(state.params, state.params, batch)
        runs.append((rl_batch, prep_metrics, *fns.rl_update(state, rl_batch)))
    (want, _, a, metrics_a), (got, got_prep, b, metrics_b) = runs
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=2e-4, atol=1e-6), a.params, b.params)
    np.testing.assert_allclose(metrics_a["loss"], metrics_b["loss"], rtol=1e-5)
    mask = np.asarray(batch.loss_mask) > 0
    np.testing.assert_allclose(np.asarray(got.old_logprobs)[mask], np.asarray(want.old_logprobs)[mask], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(metrics_b["length_fraction"], (64 + 128 + 192 + 256) / 1024)
    np.testing.assert_allclose(got_prep["score_length_fraction"], (64 + 128 + 192 + 256) / 1024)


def test_length_grouped_scoring_gives_the_padded_scores_on_fewer_positions(ragged_updates):
    """`prepare` scores parts of like lengths, each at its own and the dropped rows' part not at
    all, then puts the rows back in order: log-probs, reference log-probs and advantages on every
    policy token as the padded scoring gives them, on a quarter of the positions."""
    batch, results = ragged_updates
    (want, want_metrics, *_), (got, got_metrics, *_) = results[1], results[3]
    mask = np.asarray(batch.loss_mask) > 0
    for field in ("old_logprobs", "ref_logprobs", "advantages"):
        np.testing.assert_allclose(np.asarray(getattr(got, field))[mask], np.asarray(getattr(want, field))[mask],
                                   rtol=1e-5, atol=1e-5, err_msg=field)
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(batch.tokens))  # the batch's own row order
    assert not np.any(np.asarray(got.old_logprobs)[DROPPED])  # never scored
    assert float(want_metrics["score_length_fraction"]) == 1.0
    needed = RAGGED_LENGTHS.copy()
    needed[DROPPED] = 0
    np.testing.assert_allclose(got_metrics["score_length_fraction"], np.mean(_run_lengths(needed)) / 256)
    np.testing.assert_allclose(got_metrics["logprob_gap"], want_metrics["logprob_gap"], rtol=1e-4)


def test_sharded_length_grouped_update_matches_the_padded_one(ragged_updates):
    """The grouping's row gather and the per-length branches on a 2x2x2 mesh (one row of each
    micro-batch per batch shard) against one device's padded update."""
    batch, results = ragged_updates
    _, _, want_state, want_metrics = results[1]
    mesh = make_mesh(2, 2, 2)
    state = _state()
    shardings = steps.train_state_shardings(state, mesh)
    fns = steps.make_step_fns(GROUPED, mesh, shardings)
    state = jax.device_put(state, shardings)
    rl_batch, prep_metrics = fns.prepare(state.params, state.params, batch)
    state, metrics = fns.rl_update(state, rl_batch)
    assert_close(state.params, want_state.params)
    assert_close(metrics["loss"], want_metrics["loss"])
    np.testing.assert_allclose(metrics["length_fraction"], 0.25)
    np.testing.assert_allclose(prep_metrics["score_length_fraction"], 0.25)


def test_ppo_epochs_and_minibatches_are_all_applied(single_device_update):
    state, _, metrics = single_device_update
    assert int(state.step) == 6 and int(state.skipped_updates) == 0
    assert float(metrics["skipped_update"]) == 0


def test_first_update_loss_is_minus_the_mean_advantage_at_ratio_one():
    batch = _batch(rewards=[1, 0, 0, 1, 1, 1, 0, 1])
    state = _state()
    rl_batch, _ = step_fns(EPOCHS).prepare(state.params, state.params, batch)
    loss, metrics = rl_loss_jit(state.params, rl_batch, EPOCHS)
    mask = np.asarray(batch.loss_mask, np.float64)
    expected = -(np.asarray(rl_batch.advantages, np.float64) * mask).sum() / mask.sum()
    np.testing.assert_allclose(metrics["pg_loss"], expected, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(metrics["kl"], 0.0, atol=1e-7)  # reference == policy
    # GRPO: group 0 has scores [1, 0, 0, 1] -> +-1/std advantages on every policy token.
    adv = np.asarray(rl_batch.advantages)
    row0 = adv[0][mask[0] > 0]
    np.testing.assert_allclose(row0, np.full_like(row0, 0.5 / np.std([1, 0, 0, 1], ddof=1)), rtol=1e-4)


def test_non_finite_loss_is_skipped_and_counted():
    fns = step_fns(EPOCHS)
    state = _state()
    rl_batch, _ = fns.prepare(state.params, state.params, _batch())
    advantages = np.asarray(rl_batch.advantages)
    before = jax.tree.map(np.asarray, state.params)
    # A NaN on every row: all 3 epochs x 2 mini-batches are skipped and the params stay put.
    state, metrics = fns.rl_update(state, rl_batch.replace(advantages=np.where(np.arange(12) == 1, np.nan, advantages)))
    jax.tree.map(np.testing.assert_array_equal, state.params, before)
    assert int(state.skipped_updates) == 6 and int(state.step) == 0
    assert float(metrics["skipped_update"]) == 6
    # A NaN on one row spoils only the mini-batch holding it, once per epoch.
    one_row = advantages.copy()
    one_row[0, 1] = np.nan
    state, metrics = fns.rl_update(_state(), rl_batch.replace(advantages=one_row))
    assert int(state.skipped_updates) == 3 and int(state.step) == 3
    assert float(metrics["skipped_update"]) == 3


def test_a_mini_batch_that_trains_no_token_leaves_params_and_optimizer_state_alone():
    """The optimizer has momentum after a first update; a batch whose rows are all masked out
    (a step whose groups all scored alike) must not move the params along it."""
    fns = step_fns(EPOCHS)
    state, _ = fns.rl_update(_state(), fns.prepare(_state().params, _state().params, _batch())[0])
    assert float(jnp.abs(state.opt_state[0].trace["embed"]["embedding"]).max()) > 0  # momentum to drift on
    rl_batch, _ = fns.prepare(state.params, state.params, _batch(seed=1))
    before = jax.tree.map(np.asarray, (state.params, state.opt_state, state.step))
    after, metrics = fns.rl_update(state, rl_batch.replace(loss_mask=jnp.zeros_like(rl_batch.loss_mask)))
    jax.tree.map(np.testing.assert_array_equal, (after.params, after.opt_state, after.step), before)
    assert float(metrics["empty_update"]) == 6 and float(metrics["skipped_update"]) == 0
    # Rows masked out of one mini-batch only: that mini-batch's updates are left out, once per epoch.
    rows = np.arange(rl_batch.loss_mask.shape[0])
    state, metrics = fns.rl_update(_state(), rl_batch.replace(loss_mask=rl_batch.loss_mask * (rows[:, None] < 1)))
    assert 0 < float(metrics["empty_update"]) < 6 and int(state.step) == 6 - float(metrics["empty_update"])


def test_updates_raise_the_likelihood_of_positive_advantage_rows():
    batch = _batch(rewards=[1, 0, 0, 0, 1, 0, 0, 0])
    fns = step_fns(EPOCHS)
    state = _state()
    rl_batch, _ = fns.prepare(state.params, state.params, batch)
    state, _ = fns.rl_update(state, rl_batch)
    after, _ = fns.prepare(state.params, state.params, batch)
    mask = np.asarray(batch.loss_mask)
    delta = ((np.asarray(after.old_logprobs) - np.asarray(rl_batch.old_logprobs)) * mask).sum(1)
    assert delta[0] > 0 and delta[4] > 0  # winners more likely
    assert np.all(delta[[1, 2, 3, 5, 6, 7]] < 0)  # losers less likely


def test_gae_uses_the_value_head_and_trains_it():
    batch = _batch()
    config = make_update(MODEL, advantage="gae", gamma=1.0, lam=1.0)
    fns = step_fns(config)
    state = _state(optax.adam(1e-2), value_head=True)
    rl_batch, _ = fns.prepare(state.params, state.params, batch)
    _, before = rl_loss_jit(state.params, rl_batch, config)
    for _ in range(5):
        state, _ = fns.rl_update(state, rl_batch)
    _, after = rl_loss_jit(state.params, rl_batch, config)
    assert 0 < float(after["value_loss"]) < 0.5 * float(before["value_loss"])


def test_later_steps_of_the_same_shape_compile_nothing(single_device_update):
    """Counted as XLA backend compilations (`jax.monitoring` events, see `count_compilations`),
    after `single_device_update` compiled the steps: new batches, a fresh and a stepped state."""
    fns = step_fns(EPOCHS)
    state, batches = _state(), [_batch(EPOCH_ROWS, seed=seed) for seed in (1, 2)]
    with count_compilations() as compiled:
        for batch in batches:
            rl_batch, _ = fns.prepare(state.params, state.params, batch)
            state, _ = fns.rl_update(state, rl_batch)
        jax.block_until_ready(state)
    assert compiled == []
    assert int(state.step) == 12


SPLASH = AttentionKernels(training="splash", interpret=True)  # TPU splash attention, interpreted here


@pytest.mark.parametrize("shape, kernels", [((2, 2, 2), AttentionKernels()), ((1, 2, 4), AttentionKernels()),
                                            ((2, 2, 2), SPLASH)], ids=["2x2x2", "1x2x4", "2x2x2-splash"])
def test_sharded_update_matches_single_device_and_compiles_once(shape, kernels, single_device_update):
    """The XLA attention path, and splash attention per shard, against one device's XLA path."""
    want_state, want_prep, want_metrics = single_device_update
    mesh = make_mesh(*shape)
    state = _state()
    shardings = steps.train_state_shardings(state, mesh)
    fns = steps.make_step_fns(replace(EPOCHS, kernels=kernels), mesh, shardings)
    state = jax.device_put(state, shardings)
    rl_batch, prep_metrics = fns.prepare(state.params, state.params, _batch(EPOCH_ROWS))
    state, metrics = fns.rl_update(state, rl_batch)
    assert_close(state.params, want_state.params)
    assert_close(state.opt_state, want_state.opt_state)
    for key in want_metrics:  # each metric to 1e-5 of its own size
        assert_close(metrics[key], want_metrics[key])
    for key in want_prep:
        assert_close(prep_metrics[key], want_prep[key])
    assert int(state.step) == 6
    q_proj = P(None, "fsdp", "tensor", None)
    assert state.params["layers"]["attn"]["q_proj"]["kernel"].sharding.spec == q_proj
    assert state.opt_state[0].trace["layers"]["attn"]["q_proj"]["kernel"].sharding.spec == q_proj  # momentum
    assert rl_batch.advantages.sharding.spec == P(("data", "fsdp"))
    assert metrics["loss"].sharding.is_fully_replicated
    assert fns.row_shards == shape[0] * shape[1] and fns.padded_rows(5) == -(-5 // fns.row_shards) * fns.row_shards

    with count_compilations() as compiled:  # the outputs are already where the next step wants them
        rl_batch, _ = fns.prepare(state.params, state.params, _batch(EPOCH_ROWS, seed=1))
        state, _ = fns.rl_update(state, rl_batch)
        jax.block_until_ready(state)
    assert compiled == []


def test_state_shardings_mirror_the_params_in_the_optimizer_state():
    """AdamW behind clipping (the job's optimizer): mu and nu like the params, counts replicated."""
    mesh = make_mesh(1, 2, 4)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    abstract = jax.eval_shape(lambda: _state(tx))
    shardings = steps.train_state_shardings(abstract, mesh)
    adam = shardings.opt_state[1][0]
    for moments in (adam.mu, adam.nu):
        assert jax.tree.map(lambda s: s.spec, moments) == jax.tree.map(lambda s: s.spec, shardings.params)
    assert moments["layers"]["mlp"]["down_proj"]["kernel"].spec == P(None, "tensor", "fsdp")
    assert adam.count.spec == P() and shardings.step.spec == P() and shardings.rng.spec == P()


def test_a_mesh_without_state_shardings_is_a_clear_error():
    with pytest.raises(ValueError, match="needs state_shardings"):
        steps.make_step_fns(EPOCHS, make_mesh(1, 2, 4))


ON_POLICY = make_update(MODEL, num_microbatches=2)  # one update, no reference, critic or correction


def test_a_single_on_policy_update_skips_scoring_and_steps_along_the_policy_gradient():
    """One update and nothing else reading the trainer's scores: `prepare` runs no model (no matmul
    in its program) and the update is one optimizer step along the policy gradient at ratio 1,
    d/dθ -mean(A · log π_θ) over policy tokens (token-mean), computed here by hand with jax.grad."""
    assert not ON_POLICY.scores_rollouts and EPOCHS.scores_rollouts
    batch, state = _batch(rewards=[1, 0, 0, 1, 1, 1, 0, 0]), _state()

    def matmuls(config):
        jaxpr = jax.make_jaxpr(functools.partial(steps.prepare, config=config))(state.params, state.params, batch)
        return str(jaxpr).count("dot_general")

    assert matmuls(ON_POLICY) == 0 < matmuls(replace(ON_POLICY, ppo_epochs=2))

    fns = step_fns(ON_POLICY)
    rl_batch, _ = fns.prepare(state.params, state.params, batch)
    mask = np.asarray(batch.loss_mask, np.float64)

    def surrogate(params):
        logp = scoring.score(params, batch, ON_POLICY.forward)[0]
        return -(rl_batch.advantages * logp * batch.loss_mask).sum() / batch.loss_mask.sum()

    grads = jax.grad(surrogate)(state.params)
    updates, _ = TX.update(grads, TX.init(state.params), state.params)
    expected = jax.tree.map(np.asarray, optax.apply_updates(state.params, updates))
    logp = np.asarray(scoring.score(state.params, batch, ON_POLICY.forward)[0])
    after, metrics = fns.rl_update(state, rl_batch)  # donates `state`
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-4, atol=1e-6), after.params, expected)
    # The sampler-vs-trainer gap comes from the update's own log-probs (the batch's are zeros),
    # averaged over the two micro-batches rather than over all tokens at once.
    np.testing.assert_allclose(metrics["logprob_gap"], (np.abs(logp) * mask).sum() / mask.sum(), rtol=0.05)


KL_ON_POLICY = make_update(MODEL, num_microbatches=2, kl_coef=0.1, kl_estimator="low_var_kl")  # the SmolLM2 recipes'


def test_a_single_on_policy_update_with_a_kl_term_scores_the_reference_only():
    """One update with a KL term in the loss: `prepare` runs the reference's pass and not the
    policy's (half the matmuls of a config that reads both), and the update is one optimizer
    step along d/dθ [-mean(A · log π_θ) + β · mean(k3(log π_θ, log π_ref))] at ratio 1, computed
    here by hand with jax.grad against a reference that differs from the policy."""
    assert not KL_ON_POLICY.scores_policy and KL_ON_POLICY.scores_rollouts
    assert replace(KL_ON_POLICY, kl_in_reward=True).scores_policy  # the reward's penalty reads the old log-probs
    batch, state = _batch(rewards=[1, 0, 0, 1, 1, 1, 0, 0]), _state()
    ref_params = init_params(MODEL, jax.random.PRNGKey(7))

    def matmuls(config):
        jaxpr = jax.make_jaxpr(functools.partial(steps.prepare, config=config))(state.params, ref_params, batch)
        return str(jaxpr).count("dot_general")

    assert 0 < 2 * matmuls(KL_ON_POLICY) == matmuls(replace(KL_ON_POLICY, ppo_epochs=2))

    rl_batch, _ = step_fns(KL_ON_POLICY).prepare(state.params, ref_params, batch)
    ref_logp = scoring.score(ref_params, batch, KL_ON_POLICY.forward)[0]
    np.testing.assert_allclose(rl_batch.ref_logprobs * batch.loss_mask, ref_logp * batch.loss_mask, rtol=1e-5, atol=1e-6)

    def surrogate(params):
        logp = scoring.score(params, batch, KL_ON_POLICY.forward)[0]
        k3 = jnp.exp(ref_logp - logp) - (ref_logp - logp) - 1.0
        return (-(rl_batch.advantages * logp * batch.loss_mask).sum() + 0.1 * (k3 * batch.loss_mask).sum()) / batch.loss_mask.sum()

    grads = jax.grad(surrogate)(state.params)
    updates, _ = TX.update(grads, TX.init(state.params), state.params)
    expected = jax.tree.map(np.asarray, optax.apply_updates(state.params, updates))
    after, metrics = step_fns(KL_ON_POLICY).rl_update(state, rl_batch)  # donates `state`
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-4, atol=1e-6), after.params, expected)
    assert float(metrics["kl"]) > 1e-3 and "logprob_gap" in metrics  # a real KL term; the gap from the update
