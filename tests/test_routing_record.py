"""A mixture of experts' routing kept from the sampler to the trainer (`rollout.record_experts`).

The experts the sampler chose for every policy token reach the trajectory (the turn-batched and
the slot engine, against a real Maze server), its JSON lines and the `TokenBatch`; the update's
`routing_mismatch` is 0 in float32 where the trainer routes every token as the sampler did, and
equals a hand count where the test alters the record, for plain rows and rows packed as prefix
trees alike, from `prepare`'s scoring pass and from the update's own forward pass. A tiny
Qwen3-MoE built here (routers spread, so no top-k is a near tie), no download.
"""

from __future__ import annotations

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentgym_jax.config import ConfigError
from agentgym_jax.envs.pool import EnvPool
from agentgym_jax.models import build_tokenizer as bt
from agentgym_jax.models import decoder
from agentgym_jax.models.chat import ChatFraming
from agentgym_jax.models.config import ModelConfig
from agentgym_jax.models.tokenizer import load_tokenizer
from agentgym_jax.rollout.batch import make_token_batch
from agentgym_jax.rollout.engine import RolloutConfig, RolloutEngine
from agentgym_jax.rollout.packing import pack_groups
from agentgym_jax.rollout.trajectory import expert_array, expert_record, read_jsonl, write_jsonl
from agentgym_jax.rollout.transcript import Transcript
from agentgym_jax.sampling.config import SamplingConfig
from agentgym_jax.sampling.sampler import Sampler, Turn, decode
from agentgym_jax.sampling.step import decoder_step
from agentgym_jax.train import settings, steps
from agentgym_jax.train.scoring import Forward, score
from configs import quickstart
from environments.maze import env as maze
from tests.servers import start_server
from tests.test_shared_prefix import group_rows
from tests.test_rollout import RecordingSampler, random_params
from tests.updates import update

MAX_NEW = 6  # tokens per turn


def moe(vocab_size: int) -> tuple[ModelConfig, dict]:
    """A 2-layer Qwen3-MoE (8 experts, top 2) and its weights: matrices N(0, 0.08), routers
    N(0, 0.6) (logits far apart: float32 paths of other shapes pick the same top k)."""
    config = ModelConfig.small("qwen3_moe", vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_heads=4,
                               num_kv_heads=2, head_dim=8, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16)
    params = random_params(config, 0.08)
    params["layers"]["moe"]["router"]["kernel"] = params["layers"]["moe"]["router"]["kernel"] * (0.6 / 0.08)
    return config, params


def test_experts_are_kept_token_aligned_in_jsonl_and_the_token_batch(tmp_path):
    """A policy token's experts [layers, k] as one short string per token ("" off the loss mask),
    through the transcript, the JSON lines and back, into `TokenBatch.experts` (-1 where none) and
    with each row when packing reorders rows; what breaks the alignment is refused."""
    first, second = np.array([[[3, 5], [1, 7]], [[0, 2], [6, 4]]]), np.array([[[7, 6], [5, 4]]])  # [tokens, layers, k]
    assert expert_record(first[0]) == "3,5 1,7"
    np.testing.assert_array_equal(expert_array([expert_record(e) for e in first]), first)
    framing = ChatFraming(load_tokenizer(bt.build_tokenizer(tmp_path / "tok", [maze.INSTRUCTION], vocab_size=1024)))
    transcript = Transcript.start(framing, maze.INSTRUCTION, "You are at (0, 0).", "short")
    transcript.add_policy_turn([11, 12], [-0.5, -0.25], first)
    transcript.add_observation("You are at (0, 1).")
    transcript.add_policy_turn([13], [-1.0], second)
    t = transcript.to_trajectory(task_id=0, env="maze", group_id=0, turn_rewards=[0.0, 1.0], status="success")
    policy = [i for i, m in enumerate(t.loss_mask) if m]
    assert [t.experts[i] for i in policy] == ["3,5 1,7", "0,2 6,4", "7,6 5,4"]
    assert len(t.experts) == len(t.token_ids) and not any(e for i, e in enumerate(t.experts) if i not in policy)

    path = tmp_path / "t.jsonl"
    plain = dataclasses.replace(t, token_ids=[7] + t.token_ids[1:], experts=[], group_id=1)  # no experts kept
    write_jsonl(str(path), [t, plain])
    assert json.loads(path.read_text().splitlines()[0])["experts"][policy[0]] == "3,5 1,7"
    assert list(read_jsonl(str(path))) == [t, plain]

    batch = make_token_batch([plain, t, plain], batch_size=4)
    assert batch.experts.shape == (4, batch.shape[1], 2, 2) and batch.experts.dtype == np.int16
    want = np.full(batch.experts.shape[1:], -1)
    want[policy] = np.concatenate([first, second])
    np.testing.assert_array_equal(batch.experts[1], want)
    assert np.all(batch.experts[[0, 2, 3]] == -1)
    assert make_token_batch([plain]).experts is None
    packed = pack_groups(batch.replace(group_ids=np.array([0, 0, 0, 1], np.int32)), 4)
    assert packed.layout is not None  # rows 0 and 2 are one sequence: shared, row 1 a tree of its own
    moved = [np.array_equal(packed.tokens[r], batch.tokens[1]) for r in range(packed.tokens.shape[0])].index(True)
    np.testing.assert_array_equal(packed.experts[moved], want)

    with pytest.raises(ValueError, match="recorded exactly on the loss mask"):
        dataclasses.replace(t, experts=["1,2 3,4"] * len(t.token_ids))
    with pytest.raises(ValueError, match="different shapes"):
        make_token_batch([t, dataclasses.replace(t, experts=[e and e + ",9" for e in t.experts])])
    with pytest.raises(ValueError, match="needs them for each of the 1 policy ids"):
        transcript.add_policy_turn([14], [-1.0])


def test_nothing_is_carried_or_kept_when_off(tmp_path):
    """Off (the default), the sampler's decode loop carries no experts (traced, not compiled), the
    rollout asks for none, the token batch holds none and scoring returns no comparison."""
    config, params = moe(64)
    cache, logits = decoder.init_cache(config, 2, 16), jnp.zeros((2, 64))
    turn = Turn.start(np.ones(2, bool), np.full(2, 4))
    for on in (False, True):
        steps4 = functools.partial(decode, decoder_step(config), SamplingConfig(max_new_tokens=4, return_experts=on),
                                   decoder.unstack_layers, 4, False)
        experts = jax.eval_shape(steps4, params, cache, logits, turn, jax.random.key(0))[3][3]
        assert (experts.shape == (2, 4, config.num_layers, 2)) if on else experts is None
    framing = ChatFraming(load_tokenizer(bt.build_tokenizer(tmp_path / "tok", [maze.INSTRUCTION], vocab_size=1024)))
    assert not RolloutConfig().record_experts and not RolloutConfig().sampling_config(framing).return_experts
    batch = group_rows(groups=1, size=4)
    assert batch.experts is None
    scores = jax.eval_shape(functools.partial(score, forward=Forward(config)), params, batch)
    assert len(scores) == 3  # log-probs, entropies, values: no routing comparison


def routed(config: ModelConfig, params, batch) -> np.ndarray:
    """[rows, seq, layers, k] int16 the experts the decoder routes each loss-masked token of the
    plain rows to (-1 elsewhere): a sampler's record where it routed as the trainer does."""
    _, _, routing = decoder.forward(params, batch.tokens, batch.positions, config=config, return_routing=True)
    experts = np.asarray(routing.experts).transpose(1, 2, 0, 3)
    return np.where(np.asarray(batch.loss_mask)[..., None, None] > 0, experts, -1).astype(np.int16)


def test_routing_mismatch_is_zero_alike_and_a_hand_count_when_the_record_differs():
    """Records equal to the trainer's own routing give 0; altered ones give the count of (policy
    token, layer) pairs altered over all of them: another expert in a layer (the last token of a
    row, both layers: 2; one token of a row that another row repeats, packed as one token: 1 for
    that row only), the same experts in another order (0), a record on a token off the loss
    mask (0). The same for plain and packed rows, from `prepare`'s policy scoring pass (GRPO with
    a KL term over two epochs; micro-batches cut to length buckets) and from the loss's forward
    pass (one update: the reference's scoring pass alone, or none)."""
    config, params = moe(64)
    batch = group_rows(groups=2, size=4)
    clean = batch.replace(experts=routed(config, params, batch))
    altered = clean.experts.copy()
    other = lambda chosen: [e for e in range(8) if e not in chosen][:2]  # noqa: E731  (another expert set)
    last = int(np.flatnonzero(batch.loss_mask[0]).max())
    altered[0, last] = [other(chosen) for chosen in altered[0, last]]
    assert np.array_equal(batch.tokens[2], batch.tokens[3])  # one sequence twice (group_rows): packed once
    shared = int(np.flatnonzero((batch.loss_mask[2] > 0) & (batch.loss_mask[3] > 0))[0])
    altered[3, shared, 0, 0] = other(altered[3, shared, 0])[0]
    token = int(np.flatnonzero(batch.loss_mask[4])[1])
    altered[4, token, 1] = altered[4, token, 1, ::-1]  # another order: the same set
    off = int(np.flatnonzero((batch.loss_mask[5] == 0) & (batch.positions[5] >= 0))[0])
    altered[5, off] = [[0, 1], [2, 3]]
    differing = np.sum(np.any(np.sort(altered, -1) != np.sort(clean.experts, -1), -1) & (batch.loss_mask[..., None] > 0))
    assert differing == 3
    expected = 3 / (config.num_layers * np.sum(batch.loss_mask > 0))

    scoring = update(config, kl_coef=0.1, ppo_epochs=2, num_microbatches=2, length_buckets=2)
    reference_only = update(config, kl_coef=0.1)  # one update: the policy's pass is the update's own
    forward_only = update(config)
    assert scoring.scores_policy and not reference_only.scores_policy and not forward_only.scores_policy
    rl_loss = jax.jit(steps.rl_loss, static_argnames="config")  # what each micro-batch of the update runs
    for cfg in (scoring, reference_only, forward_only):
        fns = steps.make_step_fns(cfg)
        for layout in ("plain", "packed"):
            for experts, want in ((clean.experts, 0.0), (altered, expected)):
                rows = batch.replace(experts=experts)
                rows = pack_groups(rows, 4) if layout == "packed" else rows
                assert (rows.layout is not None) == (layout == "packed")
                rl_batch, metrics = fns.prepare(params, params, rows)
                assert ("routing_mismatch" in metrics) == cfg.scores_policy
                assert (rl_batch.experts is None) == cfg.scores_policy  # compared once
                if not cfg.scores_policy:
                    metrics = rl_loss(params, rl_batch, config=cfg)[1]
                np.testing.assert_allclose(float(metrics["routing_mismatch"]), want, rtol=1e-6,
                                           err_msg=f"{layout}, scoring pass: {cfg.scores_policy}")


@pytest.fixture(scope="module")
def maze_url():
    with start_server("maze") as url:
        yield url


def test_both_engines_record_the_experts_the_sampler_chose(tmp_path, maze_url):
    """Two-turn episodes (2 tasks x 2 samples, temperature 1) against a real Maze server: each
    policy token's record in the trajectory is what the sampler returned for it; the slot engine
    (2 slots, decode chunks of 3 steps: turns span chunks) records the same episodes alike; the
    trainer's float32 pass over the trajectories routes every policy token as recorded
    (`routing_mismatch` 0)."""
    framing = ChatFraming(load_tokenizer(bt.build_tokenizer(tmp_path / "tok", [maze.INSTRUCTION], vocab_size=1024)))
    config, params = moe(len(framing.tokenizer))
    rollout = RolloutConfig(group_size=2, max_tokens_per_turn=MAX_NEW, straggler_wait_s=0.0, record_experts=True)
    sampler = Sampler.for_decoder(config, rollout.sampling_config(framing), max_cache_len=512, batch_buckets=(4,),
                                  chunk_buckets=(128, 256), cache_buckets=(512,))
    recorder = RecordingSampler(sampler)
    runs = {}
    for name, engine_sampler, engine_rollout in (("turns", recorder, rollout),
                                                 ("slots", sampler, dataclasses.replace(rollout, num_slots=2, decode_chunk=3))):
        with RolloutEngine(engine_sampler, framing, EnvPool(maze_url), maze.MazeEnv.task_info(), engine_rollout) as engine:
            runs[name] = engine.run(params, [2, 5], 2, jax.random.key(3), policy_version=0)
    for row, t in enumerate(runs["turns"]):
        sampled = [turn.experts[row, : turn.count[row]] for live, turn in recorder.turns if live[row]]
        assert len(sampled) == t.num_turns == 2
        for (start, end), experts in zip(t.turn_spans, sampled):
            np.testing.assert_array_equal(expert_array(t.experts[start:end]), experts)
    for a, b in zip(runs["turns"], runs["slots"]):
        assert a.token_ids == b.token_ids and a.experts == b.experts

    batch = make_token_batch(runs["turns"] + runs["slots"])
    assert np.sum(batch.experts[..., 0, 0] >= 0) == np.sum(batch.loss_mask) > 0
    fns = steps.make_step_fns(update(config, kl_coef=0.1, ppo_epochs=2))  # two updates: the policy's scoring pass runs
    assert float(fns.prepare(params, params, batch)[1]["routing_mismatch"]) == 0.0


def test_the_config_key_is_refused_where_nothing_records_experts():
    config = quickstart.get_config()
    config.rollout.record_experts = True
    assert settings.rl_rollout(config, moe(64)[0]).record_experts
    assert not settings.rl_rollout(quickstart.get_config(), moe(64)[0]).record_experts
    with pytest.raises(ConfigError, match="rollout.record_experts needs a mixture of experts; qwen3 has none"):
        settings.rl_rollout(config, ModelConfig.small("qwen3"))
    config.env.agent = "tests.agent_programs:play"
    with pytest.raises(ConfigError, match=r"not supported for an agent program's episodes \(env.agent\)"):
        settings.rl_rollout(config, moe(64)[0])
