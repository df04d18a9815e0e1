"""mode=dpo: the jitted DPO objective against a float64 reference on an independent (PyTorch)
forward pass, one update raises the chosen-vs-rejected margin, padding that cannot turn into NaN
(the job's former NaN loss), and the job end to end: finite loss, rising margin, exact resume."""

import functools
import shutil

import jax
import numpy as np
import optax
import pytest

import tiny_hf

from agentgym_jax.envs.protocol import EpisodeStatus
from agentgym_jax.models.hf_checkpoint import load_pretrained
from agentgym_jax.models.tokenizer import load_tokenizer
from agentgym_jax.rollout.batch import make_token_batch
from agentgym_jax.rollout.trajectory import Trajectory, write_jsonl
from agentgym_jax.train import dpo_job
from agentgym_jax.train.dpo_pairs import build_pairs, pair_batches
from agentgym_jax.train.metrics import read_metrics
from agentgym_jax.train.state import TrainState
from agentgym_jax.train import steps
from agentgym_jax.train.scoring import Forward
from agentgym_jax.train.steps import Batching, DPOSpec, UpdateConfig
from configs import dpo as dpo_config

VOCAB = tiny_hf.TINY["vocab_size"]
BETA = 0.5
STEPS, KILLED_AFTER = 4, 2  # checkpoints at steps 2 and 4


def _trajectory(rng, task_id, success, sample_idx):
    n = int(rng.integers(12, 30))
    mask = (rng.random(n) < 0.5).astype(int).tolist()
    mask[0] = 0
    mask[-1] = 1
    return Trajectory(
        task_id=task_id, env="room", group_id=task_id, token_ids=rng.integers(3, VOCAB, n).tolist(), loss_mask=mask,
        logprobs=[0.0] * n, turn_spans=[(n - 1, n)], turn_rewards=[float(success)], reward=float(success),
        status=EpisodeStatus.SUCCESS if success else EpisodeStatus.FAILURE, sample_idx=sample_idx,
    )


def _trajectories(seed=0, tasks=6):
    rng = np.random.default_rng(seed)
    return [_trajectory(rng, task, success, s) for task in range(tasks) for s, success in enumerate((True, False))]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_qwen2")
    model = tiny_hf.save("qwen2", folder)
    tiny_hf.save_tokenizer(folder, VOCAB)
    return folder, model


def _logprob_sums_f64(hf_model, batch):
    """Sum over policy tokens of log p(token | prefix), in float64 from the PyTorch logits, [rows]."""
    tokens, mask = np.asarray(batch.tokens), np.asarray(batch.loss_mask)
    lengths = (np.asarray(batch.positions) >= 0).sum(1)
    logits = tiny_hf.logits(hf_model, tokens, lengths).astype(np.float64)[:, :-1]
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - logits.max(-1, keepdims=True)
    picked = np.take_along_axis(logp, tokens[:, 1:, None], -1)[..., 0]
    return (picked * mask[:, 1:]).sum(1)


def test_jitted_objective_matches_float64_reference_and_one_update_raises_the_margin(hf_dir):
    folder, hf_model = hf_dir
    model, params = load_pretrained(folder)
    pairs = build_pairs(_trajectories())
    chosen = make_token_batch([p.chosen for p in pairs], 32)
    rejected = make_token_batch([p.rejected for p in pairs], 32)
    rng = np.random.default_rng(1)
    ref_c = rng.normal(-4.0, 1.0, chosen.tokens.shape).astype(np.float32)  # any frozen reference
    ref_r = rng.normal(-4.0, 1.0, rejected.tokens.shape).astype(np.float32)
    update = UpdateConfig(Forward(model), dpo=DPOSpec(BETA))
    fns = steps.make_step_fns(update)
    objective = jax.jit(functools.partial(steps.dpo_objective, config=update))
    loss, metrics = objective(params, steps.DPOBatch(chosen, rejected, ref_c, ref_r))

    delta_c = _logprob_sums_f64(hf_model, chosen) - (ref_c * np.asarray(chosen.loss_mask)).sum(1)
    delta_r = _logprob_sums_f64(hf_model, rejected) - (ref_r * np.asarray(rejected.loss_mask)).sum(1)
    margin = BETA * (delta_c - delta_r)
    assert float(loss) == pytest.approx(np.mean(np.logaddexp(0.0, -margin)), rel=1e-5)
    assert float(metrics["reward_margin"]) == pytest.approx(margin.mean(), rel=1e-4, abs=1e-4)

    # Reference = the starting policy: margin 0, then one update makes chosen likelier than rejected.
    ref_c, ref_r = fns.dpo_reference(params, chosen, rejected)
    batch = steps.DPOBatch(chosen, rejected, ref_c, ref_r)
    state = TrainState.create(jax.tree.map(lambda x: x.copy(), params), optax.adam(1e-3), jax.random.PRNGKey(0))
    _, before = objective(state.params, batch)
    state, update_metrics = fns.dpo_update(state, batch)
    loss_after, after = objective(state.params, batch)
    assert abs(float(before["reward_margin"])) < 1e-5 and float(update_metrics["loss"]) == pytest.approx(np.log(2), rel=1e-5)
    assert float(after["reward_margin"]) > 1e-3
    assert float(loss_after) < np.log(2)


def test_dpo_update_accumulated_over_micro_batches_is_the_whole_batch_update(hf_dir):
    """DPO on the update path every mode shares: 2 micro-batches (2 and 1 valid pairs, and an
    empty padding row) give the one-pass reference log-probs, loss, metrics and parameters."""
    folder, _ = hf_dir
    model, params = load_pretrained(folder)
    chosen, rejected = pair_batches(build_pairs(_trajectories(seed=4, tasks=3)), 32, 4)
    results = []
    for micro in (1, 2):
        fns = steps.make_step_fns(UpdateConfig(Forward(model), Batching(num_microbatches=micro), dpo=DPOSpec(BETA)))
        reference = fns.dpo_reference(params, chosen, rejected)
        state = TrainState.create(jax.tree.map(lambda x: x.copy(), params), optax.sgd(1.0), jax.random.PRNGKey(0))
        state, metrics = fns.dpo_update(state, steps.DPOBatch(chosen, rejected, *reference))
        results.append((reference, state.params, metrics))
    (ref_a, params_a, metrics_a), (ref_b, params_b, metrics_b) = results
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5), ref_a, ref_b)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=2e-4, atol=1e-6), params_a, params_b)
    for key in ("loss", "reward_margin", "reward_accuracy", "grad_norm"):
        np.testing.assert_allclose(metrics_a[key], metrics_b[key], rtol=1e-4, atol=1e-6, err_msg=key)
    assert not np.allclose(jax.tree.leaves(params_a)[0], jax.tree.leaves(params)[0])  # the update moved them


def test_job_batches_pad_inside_the_vocabulary_and_score_like_unpadded_rows(hf_dir):
    """The NaN of mode=dpo: its batches were padded with the tokenizer's pad id, which transformers
    puts at id len(vocab) (here 96 = the model's vocab_size) for a tokenizer without one. Its
    embedding is NaN, and attention's 0 * NaN on masked keys spreads it to every row."""
    folder, hf_model = hf_dir
    model, params = load_pretrained(folder)
    pad = load_tokenizer(folder).pad_token_id
    assert pad is None or pad >= VOCAB  # the trap: a tokenizer pad id the model cannot embed
    pairs = build_pairs(_trajectories(seed=3, tasks=3))
    fns = steps.make_step_fns(UpdateConfig(Forward(model), dpo=DPOSpec(BETA)))

    # The cause: rows padded with an out-of-vocabulary id score NaN, padding rows and real rows alike.
    bad_c = make_token_batch([p.chosen for p in pairs], 32, 4, pad_id=VOCAB)
    bad_r = make_token_batch([p.rejected for p in pairs], 32, 4, pad_id=VOCAB)
    scored = np.asarray(bad_c.positions)[: len(pairs)] > 0  # what is predicted: real tokens after the first
    assert not np.isfinite(np.asarray(fns.dpo_reference(params, bad_c, bad_r)[0])[: len(pairs)][scored]).any()

    # The job's batches (padding rows included): only in-vocabulary ids, and every row scores as
    # the float64 PyTorch forward whose attention mask hides the padding.
    chosen, rejected = pair_batches(pairs, 32, 4)
    assert int(np.max(chosen.tokens)) < VOCAB and int(np.max(rejected.tokens)) < VOCAB
    for batch, logprobs in zip((chosen, rejected), fns.dpo_reference(params, chosen, rejected)):
        sums = (np.asarray(logprobs) * np.asarray(batch.loss_mask)).sum(1)
        np.testing.assert_allclose(sums[: len(pairs)], _logprob_sums_f64(hf_model, batch)[: len(pairs)], rtol=1e-5, atol=1e-4)
        assert np.isfinite(np.asarray(logprobs)).all()


def _dpo_config(folder, data, workdir):
    config = dpo_config.get_config()
    config.workdir = str(workdir)
    config.model.hf_dir = str(folder)
    config.data.trajectories = str(data)
    config.dpo.beta = BETA
    config.optim.lr = 1e-3
    config.train.batch_size = 4
    config.train.steps = STEPS
    config.train.checkpoint_every = KILLED_AFTER
    config.train.keep_checkpoints = STEPS
    return config


@pytest.mark.slow
def test_dpo_job_loss_is_finite_margin_rises_and_an_interrupted_run_resumes_exactly(hf_dir, tmp_path):
    folder, _ = hf_dir
    data = tmp_path / "collected.jsonl"
    write_jsonl(str(data), _trajectories(seed=2, tasks=4), append=False)  # 4 pairs: one batch each step
    config = _dpo_config(folder, data, tmp_path / "run")
    dpo_job.run(config)
    straight = read_metrics(str(tmp_path / "run" / "metrics.jsonl"))
    assert [r["step"] for r in straight] == list(range(1, STEPS + 1))
    assert all(np.isfinite(r[k]) for r in straight for k in ("loss", "reward_margin", "grad_norm"))
    assert straight[0]["reward_margin"] == pytest.approx(0.0, abs=1e-5)  # reference = starting policy
    assert straight[0]["loss"] == pytest.approx(np.log(2), abs=1e-5)
    margins = [r["reward_margin"] for r in straight]
    assert all(b > a for a, b in zip(margins, margins[1:])), margins  # the same 4 pairs every step
    assert straight[-1]["reward_accuracy"] == 1.0 and straight[-1]["loss"] < straight[0]["loss"]
    assert (tmp_path / "run" / "tokenizer").is_dir()

    # A kill after checkpoint KILLED_AFTER leaves that checkpoint and the metrics logged so far:
    # the same command continues from it and takes exactly the uninterrupted run's later steps.
    shutil.rmtree(tmp_path / "run" / "checkpoints" / str(STEPS))
    dpo_job.run(config)
    records = read_metrics(str(tmp_path / "run" / "metrics.jsonl"))  # cut back to the checkpoint, then replayed
    assert [r["step"] for r in records] == list(range(1, STEPS + 1)) and records[:KILLED_AFTER] == straight[:KILLED_AFTER]
    for a, b in zip(straight[KILLED_AFTER:], records[KILLED_AFTER:]):
        assert a == pytest.approx(b, rel=1e-6, abs=1e-7)
    assert (tmp_path / "run" / "checkpoints" / str(STEPS)).is_dir()


def test_trajectories_from_another_tokenizer_are_a_clear_error(hf_dir, tmp_path):
    folder, _ = hf_dir
    data = tmp_path / "collected.jsonl"
    trajectories = _trajectories(tasks=2)
    trajectories[1].token_ids[-1] = VOCAB + 5  # a token the model has no embedding for
    write_jsonl(str(data), trajectories, append=False)
    with pytest.raises(ValueError, match=f"token id {VOCAB + 5} >= the model's vocab_size {VOCAB}"):
        dpo_job.run(_dpo_config(folder, data, tmp_path / "run"))


def test_dpo_job_without_pairs_is_a_clear_error(tmp_path):
    data = tmp_path / "only_successes.jsonl"
    write_jsonl(str(data), [t for t in _trajectories() if t.success], append=False)
    config = dpo_config.get_config()
    config.workdir = str(tmp_path / "run")
    config.data.trajectories = str(data)
    with pytest.raises(ValueError, match="no preference pairs"):
        dpo_job.run(config)
