"""mode=dpo: the jitted DPO objective against a float64 reference on an independent (PyTorch)
forward pass, one update raises the chosen-vs-rejected margin, and the job runs and resumes."""

import json

import jax
import numpy as np
import optax
import pytest

from tests.markers import long_test
import tiny_hf

from agentgym_jax.envs.protocol import EpisodeStatus
from agentgym_jax.models.hf_checkpoint import load_pretrained
from agentgym_jax.rollout.batch import make_token_batch
from agentgym_jax.rollout.trajectory import Trajectory, write_jsonl
from agentgym_jax.train import dpo_job
from agentgym_jax.train.dpo_pairs import build_pairs
from agentgym_jax.train.state import TrainState
from agentgym_jax.train.steps import UpdateConfig
from configs import dpo as dpo_config

VOCAB = tiny_hf.TINY["vocab_size"]
BETA = 0.5


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
    fns = dpo_job.make_dpo_step_fns(UpdateConfig(model=model), BETA)
    loss, metrics = fns.objective(params, dpo_job.DPOBatch(chosen, rejected, ref_c, ref_r))

    delta_c = _logprob_sums_f64(hf_model, chosen) - (ref_c * np.asarray(chosen.loss_mask)).sum(1)
    delta_r = _logprob_sums_f64(hf_model, rejected) - (ref_r * np.asarray(rejected.loss_mask)).sum(1)
    margin = BETA * (delta_c - delta_r)
    assert float(loss) == pytest.approx(np.mean(np.logaddexp(0.0, -margin)), rel=1e-5)
    assert float(metrics["reward_margin"]) == pytest.approx(margin.mean(), rel=1e-4, abs=1e-4)

    # Reference = the starting policy: margin 0, then one update makes chosen likelier than rejected.
    ref_c, ref_r = fns.reference(params, chosen, rejected)
    batch = dpo_job.DPOBatch(chosen, rejected, ref_c, ref_r)
    state = TrainState.create(jax.tree.map(lambda x: x.copy(), params), optax.adam(1e-3), jax.random.PRNGKey(0))
    _, before = fns.objective(state.params, batch)
    state, update_metrics = fns.update(state, batch)
    loss_after, after = fns.objective(state.params, batch)
    assert abs(float(before["reward_margin"])) < 1e-5 and float(update_metrics["loss"]) == pytest.approx(np.log(2), rel=1e-5)
    assert float(after["reward_margin"]) > 1e-3
    assert float(loss_after) < np.log(2)


@long_test
@pytest.mark.xfail(reason="known bug: mode=dpo logs a NaN loss from step 1 (the jitted steps alone are finite); not found yet", strict=True)
def test_dpo_job_trains_and_resumes(hf_dir, tmp_path):
    folder, _ = hf_dir
    data = tmp_path / "collected.jsonl"
    write_jsonl(str(data), _trajectories(seed=2, tasks=8), append=False)
    config = dpo_config.get_config()
    config.workdir = str(tmp_path / "run")
    config.model.hf_dir = str(folder)
    config.data.trajectories = str(data)
    config.dpo.beta = BETA
    config.optim.lr = 1e-3
    config.train.batch_size = 4
    config.train.checkpoint_every = 1
    config.train.steps = 3
    dpo_job.run(config)
    config.train.steps = 5  # the same run, longer: continues after step 3
    final = dpo_job.run(config)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    assert records[0]["reward_margin"] == pytest.approx(0.0, abs=1e-5)  # reference = starting policy
    assert final["reward_margin"] > 0 and final["reward_accuracy"] > 0.5
    assert (tmp_path / "run" / "checkpoints" / "5").is_dir() and (tmp_path / "run" / "tokenizer").is_dir()


def test_dpo_job_without_pairs_is_a_clear_error(tmp_path):
    data = tmp_path / "only_successes.jsonl"
    write_jsonl(str(data), [t for t in _trajectories() if t.success], append=False)
    config = dpo_config.get_config()
    config.workdir = str(tmp_path / "run")
    config.data.trajectories = str(data)
    with pytest.raises(ValueError, match="no preference pairs"):
        dpo_job.run(config)
