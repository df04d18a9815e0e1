"""A group's shared prefix computed once (`rollout/packing.py`, `train/scoring.py`).

The prefix tree's layout (each shared run laid out once, each token seeing exactly its own path),
and every update on packed rows equal to the update on the same rows computed plainly: scores,
losses and gradients (relative 1e-5 on every parameter leaf, `assert_close`) for GRPO with a KL
term, PPO with a value head, SFT and DPO; with padding, unequal suffixes, groups cut into several
units and split across micro-batches, length buckets, log-probs only where the loss reads them,
LoRA, and on 8 simulated devices. Rows that share nothing stay plain rows.

Compilation dominates this file's time: XLA optimisations are off (tests/conftest.py) and
each config's steps are built once.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_sharding import assert_close

from agentgym_jax.models import tuning
from agentgym_jax.models.config import ModelConfig
from agentgym_jax.models.decoder import init_params
from agentgym_jax.parallel.mesh import make_mesh
from agentgym_jax.rollout.batch import TokenBatch
from agentgym_jax.rollout.packing import pack, pack_groups, prefix_tree, units_of
from agentgym_jax.train import scoring, steps
from agentgym_jax.train.state import TrainState
from tests.updates import replace
from tests.updates import update as make_update

MODEL = ModelConfig.small("qwen2", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                          num_heads=4, num_kv_heads=2, head_dim=8)
SEQ = 48
# GRPO with a KL term, 4 micro-batches, length buckets, 2 epochs (one mini-batch: shuffles of rows and of
# units give other mini-batches, so only a whole-batch update is the same update both ways).
GRPO = make_update(MODEL, ppo_epochs=2, num_microbatches=4, length_buckets=2, kl_coef=0.1)
# SGD whose state is the last gradient it applied: the update's accumulated float32 gradient, compared
# leaf by leaf (a parameter's change would carry the rounding of the parameter itself).
TX = optax.GradientTransformation(init=lambda params: jax.tree.map(jnp.zeros_like, params),
                                  update=lambda grads, state, params=None: (jax.tree.map(jnp.negative, grads), grads))


def group_rows(groups: int = 4, size: int = 4, seed: int = 0, shared: bool = True) -> TokenBatch:
    """`groups` x `size` rows of `SEQ` (host arrays): each group's rows share a prompt of 8-14
    tokens (`shared`; else every row starts with its own token), two of them also their first
    two sampled tokens, one row repeats another and one ends inside another; suffixes of 2-14
    tokens, policy tokens (loss) on about two thirds of them, a 0/1 outcome on the last."""
    rng = np.random.default_rng(seed)
    rows = []
    for g in range(groups):
        prompt = rng.integers(1, 64, rng.integers(8, 15))
        agreed = rng.integers(1, 64, 2)
        members = []
        for s in range(size):
            head = np.concatenate([prompt, agreed]) if s < 2 else prompt
            members.append(np.concatenate([head, rng.integers(1, 64, rng.integers(2, 15))]))
        if g == 0 and size >= 4:
            members[3] = members[2].copy()  # a duplicate sample
            members[1] = members[0][: len(prompt) + 3]  # a row that ends inside another
        if not shared:
            members = [np.concatenate([[64 - 1 - (g * size + s)], m[1:]]) for s, m in enumerate(members)]
        rows += members
    n = len(rows)
    tokens = np.zeros((n, SEQ), np.int32)
    positions = np.full((n, SEQ), -1, np.int32)
    loss_mask = np.zeros((n, SEQ), np.float32)
    token_rewards = np.zeros((n, SEQ), np.float32)
    scores = rng.integers(0, 2, n).astype(np.float32)
    for r, row in enumerate(rows):
        tokens[r, : len(row)], positions[r, : len(row)] = row, np.arange(len(row))
        policy = (rng.random(len(row)) < 0.66) & (np.arange(len(row)) >= 8)
        policy[len(row) - 1] = True
        loss_mask[r, : len(row)] = policy
        token_rewards[r, len(row) - 1] = scores[r]
    return TokenBatch(tokens=tokens, positions=positions, loss_mask=loss_mask, old_logprobs=np.zeros((n, SEQ), np.float32),
                      token_rewards=token_rewards, group_ids=np.repeat(np.arange(groups), size).astype(np.int32),
                      scores=scores)


def plain(batch: TokenBatch) -> TokenBatch:
    """The same rows in the same order, computed plainly."""
    return batch.replace(layout=None)


@functools.cache
def step_fns(config: steps.UpdateConfig) -> steps.StepFns:
    return steps.make_step_fns(config)


def _state(value_head: bool = False) -> TrainState:
    return TrainState.create(init_params(MODEL, jax.random.PRNGKey(0), value_head=value_head), TX, jax.random.PRNGKey(1))


def _rl_step(config, batch, value_head=False, fns=None, place=lambda x: x):
    """(prepared batch, prepare metrics, the last update's gradient, update metrics) of one RL step."""
    fns = fns or step_fns(config)
    state = place(_state(value_head))
    rl_batch, prep_metrics = fns.prepare(state.params, state.params, batch)
    after, metrics = fns.rl_update(state, rl_batch)
    return rl_batch, prep_metrics, after.opt_state, metrics


def assert_same_step(got, want, mask):
    (got_batch, got_prep, got_grads, got_metrics), (want_batch, want_prep, want_grads, want_metrics) = got, want
    for field in ("old_logprobs", "ref_logprobs", "old_values", "advantages", "returns"):
        g, w = np.asarray(getattr(got_batch, field))[mask], np.asarray(getattr(want_batch, field))[mask]
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6, err_msg=field)
    assert_close(got_grads, want_grads)  # each leaf's gradient to 1e-5 of its size
    for key in ("loss", "pg_loss", "kl", "entropy", "grad_norm"):  # some are ~0 (whitened advantages, a first epoch's KL)
        np.testing.assert_allclose(got_metrics[key], want_metrics[key], rtol=1e-5, atol=1e-6, err_msg=key)
    for key in ("logprob_gap", "entropy_at_rollout", "advantage_abs_mean"):  # the update's where prepare scores no policy
        got_at, want_at = (prep if key in prep else metrics for prep, metrics in ((got_prep, got_metrics), (want_prep, want_metrics)))
        np.testing.assert_allclose(got_at[key], want_at[key], rtol=1e-5, atol=1e-6, err_msg=key)


def test_the_prefix_tree_lays_each_shared_run_out_once():
    rows = [np.array(r) for r in ([1, 2, 3, 4], [1, 2, 5], [1, 2, 3, 6], [7], [1, 2, 3, 4])]
    tokens, positions, ends, origins = prefix_tree(rows)
    assert tokens.tolist() == [1, 2, 3, 4, 6, 5, 7]  # depth first, branches in the order their rows come
    assert positions.tolist() == [0, 1, 2, 3, 3, 2, 0]  # each token at its depth
    assert ends.tolist() == [6, 6, 5, 4, 5, 6, 7]  # past each run's subtree
    assert [o.tolist() for o in origins] == [[0, 1, 2, 3], [0, 1, 5], [0, 1, 2, 4], [6], [0, 1, 2, 3]]


@pytest.mark.parametrize("seed", range(3))
def test_each_packed_token_sees_exactly_its_own_path(seed):
    """For random rows with shared prefixes: every row's tokens sit where `origin` says, at their
    depth, and the keys visible to each (j <= i < ends[j]) are exactly the row's tokens up to it."""
    rng = np.random.default_rng(seed)
    stem = rng.integers(0, 3, 6)
    rows = [np.concatenate([stem[: rng.integers(0, 7)], rng.integers(0, 3, rng.integers(1, 6))]) for _ in range(9)]
    tokens, positions, ends, origins = prefix_tree(rows)
    prefixes = {tuple(row[: t + 1]) for row in rows for t in range(len(row))}
    assert len(tokens) == len(prefixes)  # one packed token per distinct prefix: nothing laid out twice
    index = np.arange(len(tokens))
    for row, origin in zip(rows, origins):
        np.testing.assert_array_equal(tokens[origin], row)
        np.testing.assert_array_equal(positions[origin], np.arange(len(row)))
        for t, i in enumerate(origin):
            visible = np.flatnonzero((index <= i) & (i < ends))
            np.testing.assert_array_equal(visible, np.sort(origin[: t + 1]))


def test_groups_pack_into_units_and_rows_that_share_nothing_stay_plain():
    batch = group_rows()
    packed = pack_groups(batch, rows_per_unit=4)
    layout = packed.layout
    assert layout.tokens.shape[0] == 4 and layout.sources.shape == (4, 4, SEQ)
    real = np.asarray(batch.positions) >= 0
    assert (layout.positions >= 0).sum() < 0.6 * real.sum()  # each prompt once, not four times
    np.testing.assert_array_equal(packed.tokens, batch.tokens)  # rows already in unit order
    # A group larger than a unit is cut into several (each with its own copy of the prompt); groups that
    # fit share one (two trees in one row); what trains nothing is left out.
    halves = pack_groups(batch, rows_per_unit=2)
    assert halves.layout.tokens.shape[0] == 8
    groups = np.asarray(batch.group_ids)
    assert units_of(groups, 2, np.ones(16, bool))[:2] == [[0, 1], [2, 3]]
    assert units_of(groups, 8, np.ones(16, bool)) == [list(range(8)), list(range(8, 16))]
    assert units_of(groups, 6, np.arange(16) % 4 != 0) == [[1, 2, 3, 5, 6, 7], [9, 10, 11, 13, 14, 15]]
    # Rows with no token in common: the plain batch itself.
    unshared = group_rows(shared=False)
    assert pack_groups(unshared, rows_per_unit=4) is unshared
    # Rows that train nothing are left out; units beyond the groups are empty.
    masked = batch.replace(loss_mask=np.where(np.asarray(batch.group_ids)[:, None] == 1, 0.0, batch.loss_mask))
    padded = pack_groups(masked, rows_per_unit=4, num_units=8)
    assert padded.tokens.shape == (32, SEQ) and padded.layout.tokens.shape[0] == 8
    assert np.all(padded.loss_mask[12:] == 0) and np.all(padded.positions[12:] == -1)
    assert len(set(padded.group_ids[12:].tolist())) == 20  # each empty row a group of its own
    with pytest.raises(ValueError, match="a unit has more than rows_per_unit=2 rows"):
        pack(batch, [[0, 1, 2]], rows_per_unit=2)


@pytest.mark.parametrize("logprobs_at", ["all", "loss"])
def test_packed_scores_equal_the_plain_rows_scores(logprobs_at):
    batch = pack_groups(group_rows(), rows_per_unit=4)
    config = make_update(MODEL, logprobs_at=logprobs_at, logprob_chunk=16)
    params = init_params(MODEL, jax.random.PRNGKey(0), value_head=True)
    run = jax.jit(scoring.score, static_argnames=("forward", "value_head"))
    got = run(params, batch, config.forward, 0.7, value_head=True)
    want = run(params, plain(batch), replace(config, logprobs_at="all").forward, 0.7, value_head=True)
    mask = np.asarray(batch.loss_mask) > 0
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g)[mask], np.asarray(w)[mask], rtol=1e-5, atol=1e-6)
    if logprobs_at == "loss":  # nothing projected where the loss does not read
        assert np.all(np.asarray(got[0])[~mask] == 0)


@pytest.fixture(scope="module")
def grpo_steps():
    """GRPO on 4 groups of 4, packed 2 rows a unit (each group cut in two, in different
    micro-batches), head at the loss's tokens: packed and plain, same rows."""
    batch = pack_groups(group_rows(), rows_per_unit=2)
    packed = replace(GRPO, logprobs_at="loss")
    return batch, _rl_step(packed, batch), _rl_step(GRPO, plain(batch))


def test_grpo_on_packed_rows_equals_the_plain_update(grpo_steps):
    batch, got, want = grpo_steps
    assert_same_step(got, want, np.asarray(batch.loss_mask) > 0)
    assert float(got[3]["kl"]) > 0  # the reference pass ran (and moved apart over the epochs)


def test_packed_rows_compute_fewer_positions(grpo_steps):
    _, (_, got_prep, _, got_metrics), (_, want_prep, _, want_metrics) = grpo_steps
    assert got_metrics["positions"] < 0.75 * want_metrics["positions"]
    assert got_prep["score_positions"] < 0.75 * want_prep["score_positions"]


def test_ppo_with_a_value_head_on_packed_rows_equals_the_plain_update():
    """Two groups' trees in one packed row, every layer rematerialised in the backward pass."""
    config = make_update(MODEL, advantage="gae", num_microbatches=2, kl_coef=0.05, vf_coef=0.5, logprobs_at="loss",
                         remat="full")
    batch = pack_groups(group_rows(seed=1), rows_per_unit=8)
    assert batch.layout.tokens.shape[0] == 2
    got = _rl_step(config, batch, value_head=True)
    want = _rl_step(replace(config, logprobs_at="all"), plain(batch), value_head=True)
    assert_same_step(got, want, np.asarray(batch.loss_mask) > 0)
    assert float(np.abs(np.asarray(got[0].old_values)).max()) > 0


def test_gigpo_on_packed_rows_equals_the_plain_update():
    """GiGPO's anchor states travel with their rows into the units (here two groups a unit, one
    group's rows masked out and left out of the packing) and give the plain rows' step."""
    rows = group_rows(seed=3)
    mask = np.asarray(rows.loss_mask) * (np.asarray(rows.group_ids) != 1)[:, None]  # group 1 trains nothing
    positions, groups = np.asarray(rows.positions), np.asarray(rows.group_ids)
    anchors = np.where(mask > 0, groups[:, None] * 4 + positions // 12, -1).astype(np.int32)  # shared within groups
    rows = rows.replace(loss_mask=mask.astype(np.float32), step_groups=anchors)
    batch = pack_groups(rows, rows_per_unit=8, num_units=2)
    kept = np.asarray(rows.group_ids) != 1
    np.testing.assert_array_equal(np.asarray(batch.step_groups)[:12], anchors[kept])  # each row's own, in its unit
    assert np.all(np.asarray(batch.step_groups)[12:] == -1)
    config = make_update(MODEL, advantage="gigpo", gamma=0.9, num_microbatches=2, kl_coef=0.05, logprobs_at="loss")
    got = _rl_step(config, batch)
    want = _rl_step(replace(config, logprobs_at="all"), plain(batch))
    assert_same_step(got, want, np.asarray(batch.loss_mask) > 0)
    grpo = _rl_step(make_update(MODEL, num_microbatches=2, kl_coef=0.05, logprobs_at="loss"), batch)  # the step's part
    assert np.abs(np.asarray(grpo[0].advantages) - np.asarray(got[0].advantages)).max() > 0.1


def test_sft_and_lora_on_packed_rows_equal_the_plain_update():
    batch = pack_groups(group_rows(seed=2), rows_per_unit=4)
    spec = tuning.Tuning(lora_rank=2, lora_alpha=4.0, trainable_layers=1)
    trainable, frozen = tuning.split(init_params(MODEL, jax.random.PRNGKey(0)), spec, jax.random.key(1))
    trainable = jax.tree_util.tree_map_with_path(  # adapters as after training, so they carry gradient both ways
        lambda kp, x: x + 0.1 if kp[-1].key == "b" else x, trainable)
    config = make_update(MODEL, rl=False, num_microbatches=2, lora_scale=spec.lora_scale, logprobs_at="loss")
    results = []
    for cfg, rows in ((config, batch), (replace(config, logprobs_at="all"), plain(batch))):
        state = TrainState.create(jax.tree.map(jnp.copy, trainable), TX, jax.random.PRNGKey(1),
                                  frozen=jax.tree.map(jnp.copy, frozen))  # the update donates its state
        updated, metrics = steps.make_step_fns(cfg).sft_update(state, rows)
        results.append((updated.opt_state, metrics))
    (got, got_metrics), (want, want_metrics) = results
    assert_close(got, want)
    np.testing.assert_allclose(got_metrics["loss"], want_metrics["loss"], rtol=1e-5)


def test_dpo_pairs_packed_together_equal_the_plain_update():
    rows = group_rows(groups=4, size=2, seed=3)  # pairs: (chosen, rejected) share their prompt
    packed = pack(rows, [[2 * i, 2 * i + 1] for i in range(4)], rows_per_unit=2)
    chosen, rejected = (jax.tree.map(lambda x: x[i::2], plain(packed)) for i in (0, 1))
    config = make_update(MODEL, rl=False, num_microbatches=2, logprobs_at="loss")
    config = steps.UpdateConfig(config.forward, config.batching, dpo=steps.DPOSpec(beta=0.5))
    results = []
    for cfg, layout in ((config, packed.layout), (replace(config, logprobs_at="all"), None)):
        fns = steps.make_step_fns(cfg)
        state = _state()
        ref = fns.dpo_reference(state.params, chosen, rejected, layout)
        after, metrics = fns.dpo_update(state, steps.DPOBatch(chosen, rejected, *ref, layout=layout))
        results.append((after.opt_state, metrics))
    (got, got_metrics), (want, want_metrics) = results
    assert_close(got, want)
    for key in ("loss", "chosen_reward", "reward_margin"):
        np.testing.assert_allclose(got_metrics[key], want_metrics[key], rtol=1e-5, atol=1e-6, err_msg=key)


def test_packed_update_on_8_devices_equals_one_device():
    """8 units over the 8 batch shards of a (1, 8, 1) mesh: each unit's tree on one device."""
    mesh = make_mesh(1, 8, 1)
    batch = pack_groups(group_rows(groups=8, size=2, seed=4), rows_per_unit=2)
    config = make_update(MODEL, kl_coef=0.1, logprobs_at="loss")
    state = _state()
    shardings = steps.train_state_shardings(state, mesh)
    sharded = _rl_step(config, batch, fns=steps.make_step_fns(config, mesh, shardings),
                       place=lambda s: jax.device_put(s, shardings))
    assert sharded[0].layout.tokens.sharding.spec[0] == ("data", "fsdp")
    assert_same_step(sharded, _rl_step(replace(config, logprobs_at="all"), plain(batch)), np.asarray(batch.loss_mask) > 0)
