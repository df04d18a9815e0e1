"""Tuned training (`models/tuning.py`): LoRA adapters and top-layers-only training.

References: the untouched model (a fresh adapter changes nothing), the merged kernel `W + s A B`
(the adapter path computes the same function), float64 NumPy projections of the full gradient onto
the adapters (dL/dA = s G B^T, dL/dB = s A^T G), and the full model's gradient of the top layers.
"""

from __future__ import annotations

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from agentgym_jax.job.checkpoint import Checkpointer
from agentgym_jax.models import tuning
from agentgym_jax.models.config import ModelConfig
from agentgym_jax.models.decoder import forward, hidden_states, init_params
from agentgym_jax.parallel.mesh import make_mesh
from agentgym_jax.rollout.batch import TokenBatch
from agentgym_jax.train import steps
from agentgym_jax.train.state import TrainState
from tests.updates import update as make_update

MODEL = ModelConfig.small("qwen2", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=4,
                          num_heads=4, num_kv_heads=2, head_dim=8)
LORA = tuning.Tuning(lora_rank=4, lora_alpha=8.0)
TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 10)), jnp.int32)
POSITIONS = jnp.broadcast_to(jnp.arange(10, dtype=jnp.int32), (2, 10))
WEIGHTS = jnp.asarray(np.random.default_rng(1).standard_normal((2, 10, 64)), jnp.float32)


@pytest.fixture(scope="module")
def params():
    return init_params(MODEL, jax.random.key(0))


def loss(params, lora_scale=0.0):
    """A scalar that depends on every logit."""
    logits, _ = forward(params, TOKENS, POSITIONS, config=MODEL, lora_scale=lora_scale)
    return jnp.sum(logits * WEIGHTS)


def with_random_b(trainable, seed=2):
    """Adapters whose `b` is not zero (as after training), so the update path is exercised."""
    rng = np.random.default_rng(seed)
    return jax.tree_util.tree_map_with_path(
        lambda kp, x: jnp.asarray(rng.standard_normal(x.shape) * 0.1, x.dtype) if kp[-1].key == "b" else x, trainable)


def test_fresh_adapters_leave_outputs_unchanged(params):
    trainable, frozen = tuning.split(params, LORA, jax.random.key(1))
    bs = [x for kp, x in jax.tree_util.tree_leaves_with_path(trainable) if kp[-1].key == "b"]
    assert bs and all(bool(jnp.all(b == 0)) for b in bs)
    base, _ = forward(params, TOKENS, POSITIONS, config=MODEL)
    tuned, _ = forward(tuning.combine(trainable, frozen), TOKENS, POSITIONS, config=MODEL, lora_scale=LORA.lora_scale)
    np.testing.assert_array_equal(np.asarray(tuned), np.asarray(base))
    assert set(trainable["layers"]["attn"]) == {"q_lora", "k_lora", "v_lora", "o_lora"}
    assert "layers" in frozen and "embed" in frozen  # every base weight is frozen


def test_adapter_path_equals_merged_kernels(params):
    trainable, frozen = tuning.split(params, LORA, jax.random.key(1))
    trainable = with_random_b(trainable)
    tuned, _ = forward(tuning.combine(trainable, frozen), TOKENS, POSITIONS, config=MODEL, lora_scale=LORA.lora_scale)
    merged = tuning.merge(trainable, frozen, LORA.lora_scale)
    assert jax.tree.structure(merged) == jax.tree.structure(params)
    plain, _ = forward(merged, TOKENS, POSITIONS, config=MODEL)
    np.testing.assert_allclose(np.asarray(tuned), np.asarray(plain), atol=1e-5, rtol=0)
    assert np.abs(np.asarray(plain) - np.asarray(forward(params, TOKENS, POSITIONS, config=MODEL)[0])).max() > 1e-3


@pytest.mark.parametrize("target,module,proj", [("q", "attn", "q_proj"), ("o", "attn", "o_proj"), ("down", "mlp", "down_proj")])
def test_adapter_gradient_is_the_projection_of_the_full_gradient(params, target, module, proj):
    spec = tuning.Tuning(lora_rank=3, lora_alpha=6.0, lora_targets=(target,))
    trainable, frozen = tuning.split(params, spec, jax.random.key(3))
    trainable = with_random_b(trainable)
    adapter_grads = jax.grad(lambda t: loss(tuning.combine(t, frozen), spec.lora_scale))(trainable)
    merged = tuning.merge(trainable, frozen, spec.lora_scale)
    full = np.asarray(jax.grad(loss)(merged)["layers"][module][proj]["kernel"], np.float64)  # G [L, *in, *out]
    lora = trainable["layers"][module][f"{target}_lora"]
    a, b = (np.asarray(lora[k], np.float64) for k in ("a", "b"))
    layers, rank = a.shape[0], a.shape[-1]
    g = full.reshape(layers, a[0].size // rank, -1)  # [L, in, out]
    a2, b2 = a.reshape(layers, -1, rank), b.reshape(layers, rank, -1)
    expected_a = spec.lora_scale * np.einsum("lio,lro->lir", g, b2)
    expected_b = spec.lora_scale * np.einsum("lir,lio->lro", a2, g)
    got = adapter_grads["layers"][module][f"{target}_lora"]
    scale = np.abs(expected_a).max()
    np.testing.assert_allclose(np.asarray(got["a"]).reshape(expected_a.shape), expected_a, atol=1e-5 * scale, rtol=0)
    np.testing.assert_allclose(np.asarray(got["b"]).reshape(expected_b.shape), expected_b,
                               atol=1e-5 * np.abs(expected_b).max(), rtol=0)


def test_top_layers_get_the_full_models_gradient_and_nothing_below(params):
    spec = tuning.Tuning(trainable_layers=1)
    trainable, frozen = tuning.split(params, spec, jax.random.key(0))
    assert jax.tree.leaves(frozen["frozen_layers"])[0].shape[0] == 3 and jax.tree.leaves(trainable["layers"])[0].shape[0] == 1
    split_logits, _ = forward(tuning.combine(trainable, frozen), TOKENS, POSITIONS, config=MODEL)
    np.testing.assert_allclose(np.asarray(split_logits), np.asarray(forward(params, TOKENS, POSITIONS, config=MODEL)[0]),
                               atol=1e-6, rtol=0)
    top = jax.grad(lambda t: loss(tuning.combine(t, frozen)))(trainable)
    full = jax.grad(loss)(params)
    for got, want in zip(jax.tree.leaves(top["layers"]), jax.tree.leaves(jax.tree.map(lambda x: x[3:], full["layers"]))):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5 * float(jnp.abs(want).max()), rtol=0)
    want = np.asarray(full["final_norm"]["scale"])
    np.testing.assert_allclose(np.asarray(top["final_norm"]["scale"]), want, atol=1e-5 * np.abs(want).max(), rtol=0)

    def hidden_loss(t, frozen):  # the trunk only: the vocabulary projection is the same in both
        return jnp.sum(hidden_states(tuning.combine(t, frozen), TOKENS, POSITIONS, config=MODEL))

    def scan_lengths(t, frozen) -> list[int]:
        """The lengths of every scan in the gradient's program: each layer stack's forward, its
        backward where one runs, and attention's tile loops (length 1 here)."""
        def walk(jaxpr):
            for eqn in jaxpr.eqns:
                if eqn.primitive.name == "scan":
                    yield eqn.params["length"]
                for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                    yield from walk(sub)
        return sorted(walk(jax.make_jaxpr(jax.grad(hidden_loss))(t, frozen).jaxpr))

    assert scan_lengths(trainable, frozen).count(3) == 1  # the 3 frozen layers run forward once, never backward
    assert scan_lengths(*tuning.split(params, tuning.Tuning(), jax.random.key(0))).count(4) == 2  # untuned: both


def _batch(rows: int = 8, seq: int = 12) -> TokenBatch:
    rng = np.random.default_rng(5)
    lengths = rng.integers(6, seq + 1, rows)
    positions = np.where(np.arange(seq)[None] < lengths[:, None], np.arange(seq)[None], -1)
    loss_mask = ((np.arange(seq)[None] >= 3) & (positions >= 0)).astype(np.float32)
    return TokenBatch(
        tokens=jnp.asarray(rng.integers(0, 64, (rows, seq)) * (positions >= 0), jnp.int32),
        positions=jnp.asarray(positions, jnp.int32), loss_mask=jnp.asarray(loss_mask),
        old_logprobs=jnp.zeros((rows, seq)), token_rewards=jnp.zeros((rows, seq)),
        group_ids=jnp.asarray(np.arange(rows) // 4, jnp.int32), scores=jnp.zeros((rows,)),
    )


@pytest.mark.parametrize("spec", [LORA, tuning.Tuning(trainable_layers=2), tuning.Tuning(lora_rank=2, trainable_layers=2)],
                         ids=["lora", "top2", "lora-top2"])
def test_updates_train_only_the_trainable_part_and_shard(params, spec):
    tx = optax.sgd(0.1, momentum=0.9)  # Adam's first steps are sign(g): rounding noise would decide them
    trainable, frozen = tuning.split(params, spec, jax.random.key(1), frozen_dtype=jnp.bfloat16)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(frozen))  # frozen in the compute dtype
    state = TrainState.create(trainable, tx, jax.random.PRNGKey(2), frozen=frozen)
    assert jax.tree.structure(state.opt_state[0].trace) == jax.tree.structure(trainable)  # only what trains is optimised
    config = make_update(MODEL, num_microbatches=2, lora_scale=spec.lora_scale, compute_dtype="float32")
    batch = _batch()
    one = steps.make_step_fns(config).sft_update
    updated, metrics = one(jax.tree.map(jnp.copy, state), batch)
    updated, _ = one(updated, batch)
    for before, after in zip(jax.tree.leaves(frozen), jax.tree.leaves(updated.frozen)):
        np.testing.assert_array_equal(np.asarray(before), np.asarray(after))  # bitwise unchanged
    moved = [float(jnp.abs(a - b).max()) for a, b in zip(jax.tree.leaves(trainable), jax.tree.leaves(updated.params))]
    assert min(moved) > 0, moved

    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    shardings = steps.train_state_shardings(state, mesh)
    sharded = steps.make_step_fns(config, mesh, shardings).sft_update
    placed, _ = sharded(jax.device_put(jax.tree.map(jnp.copy, state), shardings), batch)  # donated: a copy
    for want, got in zip(jax.tree.leaves(one(jax.tree.map(jnp.copy, state), batch)[0].params), jax.tree.leaves(placed.params)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6, rtol=1e-5)


def test_checkpoints_hold_what_trains(params, tmp_path):
    trainable, frozen = tuning.split(params, LORA, jax.random.key(1))
    state = TrainState.create(with_random_b(trainable), optax.adam(1e-3), jax.random.PRNGKey(2), frozen=frozen)
    ckpt = Checkpointer(str(tmp_path), every=1)
    ckpt.save(1, (state, trainable), {"step": 1}, force=True)
    raw, _ = ckpt.restore_raw(1)
    assert set(raw["params"]) == {"layers"} and not raw.get("frozen")  # adapters only, no base weights
    restored, _ = ckpt.restore((state, trainable))
    ckpt.close()
    for want, got in zip(jax.tree.leaves(state), jax.tree.leaves(restored[0])):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert restored[0].frozen is not None and jax.tree.structure(restored[0].frozen) == jax.tree.structure(frozen)


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match=r"unknown \['qq'\]; valid: q, k, v, o, gate, up, down"):
        tuning.Tuning(lora_rank=4, lora_targets=("qq",))
    with pytest.raises(ValueError, match="trainable_layers=9 but the model has 4 layers"):
        tuning.split(init_params(MODEL, jax.random.key(0)), tuning.Tuning(trainable_layers=9), jax.random.key(0))
    trainable, frozen = tuning.split(init_params(MODEL, jax.random.key(0)), LORA, jax.random.key(1))
    with pytest.raises(ValueError, match="carry LoRA adapters .* but lora_scale is 0"):
        forward(tuning.combine(trainable, frozen), TOKENS, POSITIONS, config=MODEL)


def test_a_tuned_rl_job_trains_adapters_and_exports_the_merged_policy(tmp_path):
    """The smallest RL job with LoRA on its top layer: SFT and RL train only adapters, checkpoints
    hold them alone, and the merged policy is exported as a Hugging Face folder."""
    from agentgym_jax.models.hf_checkpoint import load_pretrained
    from tests.rl_runs import TINY_RL_JOB, run_rl_job

    overrides = {**TINY_RL_JOB, "workdir": tmp_path, "train.steps": 2, "train.checkpoint_every": 1,
                 "horizon_schedule.steps_per_stage": 1, "model.lora_rank": 2, "model.trainable_layers": 1}
    summary = run_rl_job("configs/quickstart.py", overrides)
    assert summary.env == "room"
    state, _ = Checkpointer(str(tmp_path / "checkpoints"), every=1).restore_raw(2)  # (train state, reference)
    assert set(state["params"]) == {"layers"} and set(state["params"]["layers"]) == {"attn", "mlp"}
    assert all(name.endswith("_lora") for module in state["params"]["layers"].values() for name in module)
    assert not state["frozen"]
    config, params = load_pretrained(tmp_path / "hf")
    assert config.num_layers == 2 and "lora" not in str(jax.tree_util.tree_structure(params))
