"""The families beyond Llama 3.1 / Qwen2 / Qwen3, end to end on tiny random models that transformers
builds and saves (no download): each loads from `hf:<org>/<name>` in a Hugging Face cache layout,
exports back bit for bit, and plays greedy two-turn episodes against a real server through the KV
cache exactly as transformers generates them, which then train one GRPO step; the experts of the MoE families route like transformers on every token and
their load-balancing loss is transformers'. Published config.json files parse as transformers
parses them. Logits against transformers, per kernel: `test_model_parity.py`.
"""

from __future__ import annotations

import dataclasses
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import tiny_hf
import torch
import transformers
from safetensors import safe_open

from agentgym_jax.envs.pool import EnvPool
from agentgym_jax.models import build_tokenizer as bt
from agentgym_jax.models import fetch
from agentgym_jax.models.chat import ChatFraming
from agentgym_jax.models.config import ModelConfig, load_config
from agentgym_jax.models.decoder import forward, init_params
from agentgym_jax.models.hf_checkpoint import SINGLE_FILE, load_pretrained, save_pretrained
from agentgym_jax.models.kernels import AttentionKernels
from agentgym_jax.models.moe import load_balancing_loss, routing_mismatch
from agentgym_jax.models.tokenizer import load_tokenizer
from agentgym_jax.models.tuning import Tuning, combine, merge, split
from agentgym_jax.rollout.batch import TokenBatch, make_token_batch
from agentgym_jax.rollout.engine import RolloutConfig, RolloutEngine
from agentgym_jax.sampling.config import SamplingConfig
from agentgym_jax.sampling.sampler import Sampler
from agentgym_jax.train import steps
from agentgym_jax.train.state import TrainState
from environments.maze import env as maze
from tests.servers import start_server
from tests.updates import update

FAMILIES = ["gemma2", "gemma3", "llama3.2", "mistral", "qwen2_moe", "qwen3_moe"]
MOE = ["qwen2_moe", "qwen3_moe"]
TEMPLATE = {"gemma2": "gemma", "gemma3": "gemma", "llama3.2": "llama3"}  # the rest: ChatML
TURN = 6  # tokens per turn


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """A Hugging Face cache (`HF_HUB_CACHE`) holding `Tiny/<family>` for every family, as the hub
    client lays it out (`models--Tiny--<family>/snapshots/<revision>/`, `refs/main`): a model of
    the vocabulary of a tokenizer with the family's chat markup, built here on the Maze text."""
    root = tmp_path_factory.mktemp("hub")
    tokenizers = {template: bt.build_tokenizer(root / template, [maze.INSTRUCTION], vocab_size=1024, template=template)
                  for template in {*TEMPLATE.values(), "chatml"}}
    models = {}
    for family in FAMILIES:
        repo = root / f"models--Tiny--{family}"
        snapshot = repo / "snapshots" / "0123abcd"
        shutil.copytree(tokenizers[TEMPLATE.get(family, "chatml")], snapshot)
        models[family] = tiny_hf.save(family, snapshot, overrides=dict(vocab_size=len(load_tokenizer(snapshot))))
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text("0123abcd\n")
    return root, models


@pytest.fixture
def loaded(hub, monkeypatch, request):
    """(transformers model, folder, our config, our params) of `Tiny/<family>` via `hf:`."""
    root, models = hub
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    folder = fetch.resolve(f"hf:Tiny/{request.param}")
    config, params = load_pretrained(folder)
    return models[request.param], folder, config, params


def padded_batch(vocab: int, lengths=(20, 11, 4)) -> tuple[np.ndarray, np.ndarray]:
    """Right-padded random rows and their positions (-1 on padding)."""
    lengths = np.asarray(lengths)
    seq = lengths.max()
    tokens = np.random.default_rng(0).integers(3, vocab, (len(lengths), seq)).astype(np.int32)
    real = np.arange(seq)[None] < lengths[:, None]
    return np.where(real, tokens, 0), np.where(real, np.arange(seq)[None], -1).astype(np.int32)


@pytest.mark.parametrize("loaded", FAMILIES, indirect=True)
def test_loads_from_the_hf_cache_and_exports_bit_identical(loaded, tmp_path):
    hf_model, folder, config, params = loaded
    assert config == load_config(folder) and ModelConfig.from_hf_dict(config.to_hf_dict()) == config
    save_pretrained(params, config, tmp_path, tokenizer_dir=folder)
    _, again = load_pretrained(tmp_path)
    for ours, reread in zip(jax.tree.leaves(params), jax.tree.leaves(again)):
        np.testing.assert_array_equal(np.asarray(ours).view(np.uint32), np.asarray(reread).view(np.uint32))
    with safe_open(f"{folder}/{SINGLE_FILE}", "np") as source, safe_open(tmp_path / SINGLE_FILE, "np") as export:
        assert sorted(export.keys()) == sorted(source.keys())  # per-expert tensors, no lm_head when tied
        for name in source.keys():
            np.testing.assert_array_equal(export.get_tensor(name).view(np.uint32), source.get_tensor(name).view(np.uint32))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, attn_implementation="eager").eval()
    tokens, positions = padded_batch(config.vocab_size)
    lengths = np.sum(positions >= 0, axis=1)
    np.testing.assert_array_equal(tiny_hf.logits(reloaded, tokens, lengths), tiny_hf.logits(hf_model, tokens, lengths))


@pytest.mark.parametrize("loaded", MOE, indirect=True)
def test_router_top_k_and_load_balancing_loss_match_transformers(loaded):
    """On a padded batch, both dispatches: transformers' logits (1e-4), its router's top k on every
    real token of every layer, its load-balancing loss (1e-5); and the experts the sampler records
    for each token it samples are those the training pass routes it to."""
    hf_model, _, config, params = loaded
    tokens, positions = padded_batch(config.vocab_size)
    real = positions >= 0
    with torch.no_grad():
        out = hf_model(input_ids=torch.tensor(tokens, dtype=torch.long), attention_mask=torch.tensor(real, dtype=torch.long),
                       output_router_logits=True)
    probs = torch.softmax(torch.stack(out.router_logits).float(), dim=-1)  # [layers, batch * seq, experts]
    want = torch.topk(probs, config.num_experts_per_tok, dim=-1).indices.numpy().reshape(config.num_layers, *tokens.shape, -1)
    run = jax.jit(forward, static_argnames=("config", "kernels", "return_routing"))
    for dispatch in ("dense", "ragged"):
        logits, _, routing = run(params, tokens, positions, config=config,
                                 kernels=AttentionKernels(moe_dispatch=dispatch), return_routing=True)
        hf_logits = out.logits.numpy()[real]
        assert np.max(np.abs(np.asarray(logits)[real] - hf_logits)) <= 1e-4 * np.max(np.abs(hf_logits))
        np.testing.assert_array_equal(np.asarray(routing.experts)[:, real], want[:, real])
        assert abs(float(load_balancing_loss(routing, config.num_experts)) - float(out.aux_loss)) <= 1e-5

    # The sampler records the experts each sampled token went to (as it went into the cache, one
    # token a step): the training pass over the same tokens routes them alike.
    sampler = Sampler.for_decoder(config, SamplingConfig(max_new_tokens=TURN, temperature=1.0, return_experts=True), max_cache_len=32,
                                  batch_buckets=(3,), chunk_buckets=(32,), cache_buckets=(32,))
    prompts = [row[: int(n)].tolist() for row, n in zip(tokens, real.sum(axis=1))]
    _, turn = sampler.generate(params, sampler.prefill(params, prompts), jax.random.key(0))
    assert turn.experts.shape == (3, TURN, config.num_layers, config.num_experts_per_tok)
    rows = [prompt + turn.tokens[b, : turn.count[b]].tolist() for b, prompt in enumerate(prompts)]
    width = max(map(len, rows))
    full = np.zeros((3, width), np.int32)
    for b, row in enumerate(rows):
        full[b, : len(row)] = row
    lengths = np.array(list(map(len, rows)))
    positions = np.where(np.arange(width)[None] < lengths[:, None], np.arange(width)[None], -1).astype(np.int32)
    _, _, trained = run(params, full, positions, config=config, return_routing=True)
    sampled = np.zeros((3, width), bool)
    for b, prompt in enumerate(prompts):
        sampled[b, len(prompt) : lengths[b]] = True
    recorded = np.full(np.asarray(trained.experts).shape, -1, np.int32)  # [layers, batch, seq, k]
    for b, prompt in enumerate(prompts):
        recorded[:, b, len(prompt) : lengths[b]] = turn.experts[b, : turn.count[b]].transpose(1, 0, 2)
    assert sampled.sum() == turn.count.sum() > 0
    assert float(routing_mismatch(jnp.asarray(recorded), trained.experts, sampled)) == 0.0


@pytest.mark.parametrize("dispatch", ["dense", "ragged"])
def test_lora_on_the_experts_is_a_config_choice(dispatch):
    """Adapters on every expert's projections (each expert its own pair) compute what their merge
    into the expert kernels computes, through either dispatch; attention-only LoRA leaves every
    expert frozen; a dense-MLP target on an MoE model is refused by name."""
    config = ModelConfig.small("qwen3_moe")
    params = init_params(config, jax.random.key(0))
    tuning = Tuning(lora_rank=2, lora_targets=("q", "v", "expert_gate", "expert_up", "expert_down"))
    trainable, frozen = split(params, tuning, jax.random.key(1))
    assert trainable["layers"]["moe"]["expert_up_lora"]["a"].shape == (2, config.num_experts, config.hidden_size, 2)
    assert trainable["layers"]["moe"]["expert_down_lora"]["b"].shape == (2, config.num_experts, 2, config.hidden_size)
    rng = np.random.default_rng(0)  # adapters that change the model: b away from its zero start
    trainable = jax.tree.map(lambda x: x + 0.05 * rng.standard_normal(x.shape).astype(x.dtype), trainable)
    tokens, positions = padded_batch(config.vocab_size)
    kernels = AttentionKernels(moe_dispatch=dispatch)
    got, _ = forward(combine(trainable, frozen), tokens, positions, config=config, kernels=kernels,
                     lora_scale=tuning.lora_scale)
    want, _ = forward(merge(trainable, frozen, tuning.lora_scale), tokens, positions, config=config, kernels=kernels)
    real = positions >= 0
    assert np.max(np.abs(np.asarray(got)[real] - np.asarray(want)[real])) <= 1e-5 * np.max(np.abs(np.asarray(want)[real]))
    attention_only, _ = split(params, Tuning(lora_rank=2, lora_targets=("q", "k", "v", "o")), jax.random.key(1))
    assert set(attention_only["layers"]) == {"attn"}
    with pytest.raises(ValueError, match="lora target 'gate' names a mlp layer this model has not; its targets: q, k, v, o, "
                                         "expert_gate, expert_up, expert_down"):
        split(params, Tuning(lora_rank=2), jax.random.key(1))


def test_the_load_balancing_loss_is_in_the_losses_only_when_asked():
    """`router_aux_coef` adds the routers' load-balancing loss (the forward's own routing) to the
    SFT and RL losses and to their gradient; 0, the default, leaves it out; a dense model refuses it."""
    config = ModelConfig.small("qwen3_moe")
    params = init_params(config, jax.random.key(0))
    tokens, positions = padded_batch(config.vocab_size)
    batch = TokenBatch(tokens=tokens, positions=positions, loss_mask=(positions > 0).astype(np.float32),
                       old_logprobs=np.zeros(tokens.shape, np.float32), token_rewards=np.zeros(tokens.shape, np.float32),
                       group_ids=np.zeros(3, np.int32), scores=np.zeros(3, np.float32))
    _, _, routing = forward(params, tokens, positions, config=config, return_routing=True)
    aux = float(load_balancing_loss(routing, config.num_experts))
    loss_and_grad = jax.jit(jax.value_and_grad(steps.sft_loss, has_aux=True), static_argnames="config")
    losses = {coef: loss_and_grad(params, batch, config=update(config, rl=False, router_aux_coef=coef)) for coef in (0.0, 0.5)}
    (off, off_metrics), off_grad = losses[0.0]
    (on, on_metrics), on_grad = losses[0.5]
    assert "router_aux_loss" not in off_metrics and abs(float(on_metrics["router_aux_loss"]) - aux) <= 1e-6
    assert abs(float(on) - float(off) - 0.5 * aux) <= 1e-6
    router = lambda g: np.asarray(g["layers"]["moe"]["router"]["kernel"])  # noqa: E731
    assert not np.allclose(router(on_grad), router(off_grad))
    with pytest.raises(ValueError, match="router_aux_coef=0.5 needs a mixture of experts; qwen2 has none"):
        update(ModelConfig.small("qwen2"), rl=False, router_aux_coef=0.5)


@pytest.fixture(scope="module")
def maze_url():
    with start_server("maze") as url:
        yield url


def hf_greedy(model: transformers.PreTrainedModel, ids: list[int], new: int, eos: int) -> list[int]:
    """transformers' greedy continuation of one row (its own cache), up to and with the eos."""
    with torch.no_grad():
        ids = torch.tensor([ids])  # every id attended: a sampled 0 is not padding
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                             eos_token_id=eos, pad_token_id=eos)
    return out[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("loaded", FAMILIES, indirect=True)
def test_a_greedy_multi_turn_episode_matches_transformers_and_trains_one_grpo_step(loaded, maze_url):
    """Greedy episodes of two turns on two Maze tasks against a real server, framed by the
    family's chat markup: each turn's ids (sampled through the KV cache, the environment's answer
    appended between turns, sliding windows and experts included) are the ids transformers
    generates greedily from the whole context before it. Then one GRPO update on them: the
    trainer's log-probs of the sampled tokens are the sampler's, and the update moves the
    weights. A policy this random earns no reward, so one episode is given 1."""
    hf_model, folder, config, params = loaded
    framing = ChatFraming(load_tokenizer(folder))
    rollout = RolloutConfig(group_size=1, max_tokens_per_turn=TURN, temperature=0.0)
    sampler = Sampler.for_decoder(config, rollout.sampling_config(framing), max_cache_len=448, batch_buckets=(2,),
                                  chunk_buckets=(32, 320), cache_buckets=(448,))
    with RolloutEngine(sampler, framing, EnvPool(maze_url), maze.MazeEnv.task_info(), rollout) as engine:
        episodes = engine.run(params, [0, 1], 2, jax.random.key(0), policy_version=0)
    assert [t.num_turns for t in episodes] == [2, 2]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # torch's spinning thread pool crawls on a loaded 2-core machine
    for episode in episodes:
        for start, stop in episode.turn_spans:
            ids = episode.token_ids
            assert ids[start:stop] == hf_greedy(hf_model, ids[:start], TURN, framing.end_of_turn_ids[0])
    torch.set_num_threads(threads)

    # One group of the two (greedy episodes of one task would be the same sequence twice, whose
    # opposite advantages cancel), the first one rewarded.
    batch = make_token_batch(episodes)
    rewards, scores = batch.token_rewards.copy(), batch.scores.copy()
    rewards[0, np.flatnonzero(batch.loss_mask[0]).max()] = scores[0] = 1.0
    batch = dataclasses.replace(batch, token_rewards=rewards, scores=scores, group_ids=np.zeros_like(batch.group_ids))
    fns = steps.make_step_fns(update(config))
    before = np.asarray(params["layers"]["attn"]["q_proj"]["kernel"])
    state = TrainState.create(params, optax.adam(1e-3), jax.random.key(1))
    state, metrics = fns.rl_update(state, fns.prepare(state.params, state.params, batch)[0])
    assert float(metrics["logprob_gap"]) <= 1e-4  # the trainer's log-probs of the sampled tokens, against the sampler's
    assert np.isfinite(float(metrics["loss"]))
    assert not np.array_equal(np.asarray(state.params["layers"]["attn"]["q_proj"]["kernel"]), before)


@pytest.mark.parametrize(
    "hf, expected",
    [
        # google/gemma-2-2b-it (transformers-4 form, typed from the published config.json)
        (dict(architectures=["Gemma2ForCausalLM"], model_type="gemma2", attn_logit_softcapping=50.0,
              final_logit_softcapping=30.0, head_dim=256, hidden_act="gelu_pytorch_tanh",
              hidden_activation="gelu_pytorch_tanh", hidden_size=2304, intermediate_size=9216,
              max_position_embeddings=8192, num_attention_heads=8, num_hidden_layers=26, num_key_value_heads=4,
              query_pre_attn_scalar=256, rms_norm_eps=1e-6, rope_theta=10000.0, sliding_window=4096,
              vocab_size=256000, bos_token_id=2, eos_token_id=[1, 107], pad_token_id=0, torch_dtype="float32"),
         dict(sliding_window=4096, attn_softcap=50.0, final_softcap=30.0, tie_word_embeddings=True)),
        # google/gemma-3-1b-it
        (dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", head_dim=256,
              hidden_activation="gelu_pytorch_tanh", hidden_size=1152, intermediate_size=6912,
              max_position_embeddings=32768, num_attention_heads=4, num_hidden_layers=26, num_key_value_heads=1,
              query_pre_attn_scalar=256, rms_norm_eps=1e-6, rope_local_base_freq=10000, rope_scaling=None,
              rope_theta=1000000, sliding_window=512, sliding_window_pattern=6, vocab_size=262144,
              attn_logit_softcapping=None, final_logit_softcapping=None, eos_token_id=[1, 106], torch_dtype="bfloat16"),
         dict(sliding_window=512, qk_norm=True, attn_softcap=None)),
        # mistralai/Mistral-7B-v0.1
        (dict(architectures=["MistralForCausalLM"], model_type="mistral", hidden_act="silu", hidden_size=4096,
              intermediate_size=14336, max_position_embeddings=32768, num_attention_heads=32, num_hidden_layers=32,
              num_key_value_heads=8, rms_norm_eps=1e-5, rope_theta=10000.0, sliding_window=4096, vocab_size=32000,
              tie_word_embeddings=False, torch_dtype="bfloat16"),
         dict(sliding_window=4096, head_dim=128)),
        # Qwen/Qwen3-30B-A3B
        (dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", attention_bias=False,
              decoder_sparse_step=1, head_dim=128, hidden_act="silu", hidden_size=2048, intermediate_size=6144,
              max_position_embeddings=40960, max_window_layers=48, mlp_only_layers=[], moe_intermediate_size=768,
              norm_topk_prob=True, num_attention_heads=32, num_experts=128, num_experts_per_tok=8,
              num_hidden_layers=48, num_key_value_heads=4, rms_norm_eps=1e-6, rope_scaling=None, rope_theta=1e6,
              router_aux_loss_coef=0.001, sliding_window=None, tie_word_embeddings=False, use_sliding_window=False,
              vocab_size=151936, torch_dtype="bfloat16"),
         dict(num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True, qk_norm=True)),
    ],
    ids=["gemma-2-2b-it", "gemma-3-1b-it", "mistral-7b-v0.1", "qwen3-30b-a3b"],
)
def test_published_configs_parse_as_transformers_parses_them(hf, expected):
    """Layer types, windows and RoPE bases as transformers' own config class reads them, from the
    published file and from our export of it."""
    config = ModelConfig.from_hf_dict(hf)
    assert {key: getattr(config, key) for key in expected} == expected
    for source in (hf, config.to_hf_dict()):
        theirs = transformers.AutoConfig.for_model(**source)
        types = getattr(theirs, "layer_types", None) or ["full_attention"] * theirs.num_hidden_layers
        if hf["model_type"] == "mistral":  # Mistral's one window is every layer's
            types = ["sliding_attention" if theirs.sliding_window else "full_attention"] * theirs.num_hidden_layers
        assert list(config.layer_types or ("full_attention",) * config.num_layers) == types
        rope = theirs.rope_parameters
        full = rope.get("full_attention", rope)
        assert (config.rope.theta, config.rope.type) == (full["rope_theta"], full["rope_type"])
        if "sliding_attention" in rope:
            local = config.local_rope or config.rope
            assert (local.theta, local.type) == (rope["sliding_attention"]["rope_theta"], "default")
    assert ModelConfig.from_hf_dict(config.to_hf_dict()) == config
