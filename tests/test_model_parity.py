"""The Flax decoder against transformers (PyTorch) on tiny random models of every family
(`tiny_hf.FAMILIES`: Llama 3.1 and 3.2, Mistral, Qwen2, Qwen3, Qwen3-MoE, Qwen2-MoE, Gemma 2, Gemma 3)."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
import tiny_hf

from agentgym_jax.models.config import ModelConfig, RopeConfig, load_config
from agentgym_jax.models.decoder import forward, init_cache, unstack_layers
from agentgym_jax.models.kernels import AttentionKernels
from agentgym_jax.models.hf_checkpoint import load_pretrained

FAMILIES = sorted(tiny_hf.FAMILIES)
SEQ = 20  # every full pass is [3, SEQ] and every cached chunk [3, CHUNK]: one compile each per family
CHUNK = 8
jit_forward = jax.jit(forward, static_argnames=("config", "dtype", "kernels"))
# The default tile holds every test sequence in one block; 4 cuts them into several (flash attention's
# online softmax across blocks, and queries and keys padded up to whole tiles).
BLOCKS = [AttentionKernels(), AttentionKernels(block=4)]
# ... and TPU splash attention for rows without a cache, its kernel interpreted on this CPU.
SPLASH = AttentionKernels(training="splash", interpret=True)
TRAINING = [*BLOCKS, SPLASH]
# Llama-3, Qwen2 and Qwen3 run every kernel and tile size; the later families, whose blocks reuse
# those paths, run the multi-tile one (a sliding window across tiles), and the Pallas kernels
# where their window or soft cap changes what the kernel is asked. Their decoding through the
# cache is checked against transformers' greedy generation (test_model_families.py).
CLASSIC = ("llama3", "qwen2", "qwen3")
WINDOWED = ("gemma2", "gemma3", "mistral")
TRITON = AttentionKernels(decode="triton", interpret=True)


def cases(kernels: list, later: list, windowed: list = (), windowed_families=WINDOWED) -> list:
    """(family, kernels) pairs: the classic families with each of `kernels`, the later ones with
    each of `later`, the sliding-window ones also with each of `windowed`."""
    return [pytest.param(family, k, id=f"{family}-{k.training}-{k.decode}-block{k.block}")
            for family in FAMILIES
            for k in (kernels if family in CLASSIC else [*later, *(windowed if family in windowed_families else ())])]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """family -> (HF model, our config, our params loaded from its save_pretrained folder)."""
    out = {}
    for family in FAMILIES:
        folder = tmp_path_factory.mktemp(family)
        hf_model = tiny_hf.save(family, folder)
        config, params = load_pretrained(folder)
        out[family] = (hf_model, config, params)
    return out


def rel_error(got: np.ndarray, want: np.ndarray) -> float:
    """max |got - want| relative to the largest |want| (logits near 0 make element-wise ratios meaningless)."""
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def right_padded(tokens: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """positions [batch, seq]: 0 .. length-1, then -1 on padding."""
    positions = np.broadcast_to(np.arange(tokens.shape[1]), tokens.shape)
    return np.where(positions < lengths[:, None], positions, -1).astype(np.int32)


@pytest.mark.parametrize("family, kernels", cases(TRAINING, [BLOCKS[1]], [SPLASH]))
def test_padded_batch_logits_match_transformers(models, family, kernels):
    hf_model, config, params = models[family]
    rng = np.random.default_rng(0)
    lengths = np.array([SEQ, 11, 4])
    tokens = rng.integers(3, config.vocab_size, (3, SEQ)).astype(np.int32)
    tokens[np.arange(SEQ)[None] >= lengths[:, None]] = 0
    want = tiny_hf.logits(hf_model, tokens, lengths)
    got, cache = jit_forward(params, tokens, right_padded(tokens, lengths), config=config, kernels=kernels)
    assert cache is None
    got = np.asarray(got)
    assert got.dtype == np.float32 and np.isfinite(got).all()  # padded queries too
    valid = np.arange(SEQ)[None] < lengths[:, None]
    assert rel_error(got[valid], want[valid]) <= 1e-4


@pytest.mark.parametrize("family, kernels", cases(BLOCKS, [BLOCKS[1]]))
def test_three_turn_cache_continuation_matches_full_pass(models, family, kernels):
    """Chunks of different lengths per row (right-padded) through the cache == one pass over all tokens."""
    hf_model, config, params = models[family]
    turn_lengths = np.array([[5, 3, 4], [2, 6, 1], [7, 1, 3]])  # [row, turn]
    totals = turn_lengths.sum(1)
    rng = np.random.default_rng(1)
    tokens = rng.integers(3, config.vocab_size, (3, SEQ)).astype(np.int32)

    cache = init_cache(config, batch=3, max_len=3 * CHUNK)
    got = np.zeros((3, SEQ, config.vocab_size), np.float32)
    offsets = np.zeros(3, int)
    for turn in range(3):
        chunk = np.zeros((3, CHUNK), np.int32)
        positions = np.full((3, CHUNK), -1, np.int32)
        for row, n in enumerate(turn_lengths[:, turn]):
            chunk[row, :n] = tokens[row, offsets[row] : offsets[row] + n]
            positions[row, :n] = np.arange(offsets[row], offsets[row] + n)
        logits, cache = jit_forward(params, chunk, positions, cache, config=config, kernels=kernels)
        for row, n in enumerate(turn_lengths[:, turn]):
            got[row, offsets[row] : offsets[row] + n] = np.asarray(logits[row, :n])
        offsets += turn_lengths[:, turn]

    np.testing.assert_array_equal(np.asarray(cache.index), totals)  # each row's own real tokens
    np.testing.assert_array_equal(np.asarray(cache.next_positions()), totals)
    valid = np.arange(SEQ)[None] < totals[:, None]
    full, _ = jit_forward(params, tokens, right_padded(tokens, totals), config=config)
    assert rel_error(got[valid], np.asarray(full)[valid]) <= 1e-5
    want = tiny_hf.logits(hf_model, np.where(valid, tokens, 0), totals)
    assert rel_error(got[valid], want[valid]) <= 1e-4


@pytest.mark.parametrize("family, kernels", cases([AttentionKernels(), TRITON], [], [TRITON], ("gemma3", "mistral")))
def test_layers_as_a_loop_match_the_scan(models, family, kernels):
    """`unstack_layers` params (the sampler's decode loop) give the scan's logits and cache.

    The two forms take different attention paths (the loop writes a decode step's key into the
    stacked cache first; the scan attends to cache and new key as two blocks), so this checks the
    cache layout and write positions of both, for a padded chunk and three single-token steps.
    The loop's decode steps also run the GPU ragged decode kernel (interpreted here; from the
    window's first slot on a sliding layer).
    """
    _, config, params = models[family]
    unstacked = unstack_layers(params)
    assert "layers" not in unstacked and f"layers_{config.num_layers - 1}" in unstacked
    layer0, stacked = jax.tree.leaves(unstacked["layers_0"]), jax.tree.leaves(params["layers"])
    assert [x.shape for x in layer0] == [x.shape[1:] for x in stacked]
    rng = np.random.default_rng(2)
    lengths = np.array([CHUNK, 3, 5])
    chunk = rng.integers(3, config.vocab_size, (3, CHUNK)).astype(np.int32)
    steps = [(chunk, right_padded(chunk, lengths))] + [
        (rng.integers(3, config.vocab_size, (3, 1)).astype(np.int32), (lengths + t)[:, None].astype(np.int32))
        for t in range(3)
    ]
    caches = [init_cache(config, batch=3, max_len=2 * CHUNK)] * 2
    for tokens, positions in steps:
        (want, caches[0]), (got, caches[1]) = (
            jit_forward(p, tokens, positions, c, config=config, kernels=k)
            for p, c, k in zip((params, unstacked), caches, (AttentionKernels(), kernels))
        )
        real = positions >= 0
        assert rel_error(np.asarray(got)[real], np.asarray(want)[real]) <= 1e-5
    for c in caches:  # each row's pointer: its real tokens
        np.testing.assert_array_equal(np.asarray(c.index), lengths + 3)
    for name in ("k", "v"):
        assert rel_error(np.asarray(getattr(caches[1], name)), np.asarray(getattr(caches[0], name))) <= 1e-5
    np.testing.assert_array_equal(np.asarray(caches[1].positions), np.asarray(caches[0].positions))


@pytest.mark.parametrize("param_dtype, compute_dtype", [("bfloat16", None), ("float32", "bfloat16")])
def test_bfloat16_policy_stays_close_and_keeps_float32_logits(models, param_dtype, compute_dtype):
    """bfloat16 storage (compute follows it) and float32 storage with bfloat16 compute."""
    hf_model, config, params = models["qwen2"]
    params = jax.tree.map(lambda x: x.astype(param_dtype), params)
    tokens = np.random.default_rng(2).integers(3, config.vocab_size, (3, SEQ)).astype(np.int32)
    lengths = np.full(3, SEQ)
    got, _ = jit_forward(params, tokens, right_padded(tokens, lengths), config=config, dtype=compute_dtype)
    assert got.dtype == np.float32
    error = rel_error(np.asarray(got), tiny_hf.logits(hf_model, tokens, lengths))
    assert 1e-5 < error <= 3e-2  # really computed in bfloat16 (8 mantissa bits), and still the same model


def test_transformers4_and_5_config_forms_agree(models, tmp_path):
    """The same Llama-3 config in both forms parses to one ModelConfig with the llama3 scaling."""
    hf_model, config, _ = models["llama3"]
    v5 = hf_model.config.to_dict()
    assert "rope_parameters" in v5
    v4 = {k: v for k, v in v5.items() if k not in ("rope_parameters", "dtype")}
    v4.update(
        rope_theta=10000.0,
        rope_scaling={"factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 16, "rope_type": "llama3"},
        torch_dtype="float32",
    )
    (tmp_path / "config.json").write_text(json.dumps(v4))
    assert load_config(tmp_path) == ModelConfig.from_hf_dict(v5) == config
    assert config.rope == RopeConfig(10000.0, "llama3", 4.0, 1.0, 4.0, 16)
    assert (config.family, config.num_kv_heads, config.tie_word_embeddings) == ("llama", 2, False)
    assert models["qwen3"][1].head_dim == 32 and models["qwen3"][1].qk_norm
    assert models["qwen2"][1].qkv_bias and not models["qwen2"][1].o_bias


def test_published_llama31_config_parses():
    """The Llama-3.1-8B config.json (transformers-4 form, typed from the public model card)."""
    hf = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
        "intermediate_size": 14336, "num_attention_heads": 32, "num_hidden_layers": 32,
        "num_key_value_heads": 8, "vocab_size": 128256, "rms_norm_eps": 1e-05, "hidden_act": "silu",
        "max_position_embeddings": 131072, "rope_theta": 500000.0, "tie_word_embeddings": False,
        "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "torch_dtype": "bfloat16", "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
        "attention_bias": False, "mlp_bias": False, "pretraining_tp": 1,
    }
    c = ModelConfig.from_hf_dict(hf)
    assert (c.head_dim, c.num_kv_heads, c.dtype, c.eos_token_ids) == (128, 8, "bfloat16", (128001, 128008, 128009))
    assert c.rope == RopeConfig(500000.0, "llama3", 8.0, 1.0, 4.0, 8192)
    assert ModelConfig.from_hf_dict(c.to_hf_dict()) == c


@pytest.mark.parametrize(
    "change, named",
    [
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "yarn"),
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}, "rope_parameters": None}, "dynamic"),
        ({"model_type": "olmoe"}, "olmoe"),
        ({"architectures": ["Qwen2ForSequenceClassification"]}, "Qwen2ForSequenceClassification"),
        ({"num_experts": 8}, "mixture of experts"),
        ({"hidden_act": "gelu"}, "gelu"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        # What is still not covered, each named with what it is
        ({"model_type": "gemma3", "vision_config": {"model_type": "siglip_vision_model"}}, "vision tower"),
        ({"model_type": "gemma3n"}, "Gemma 3n"),
        ({"model_type": "deepseek_v3", "kv_lora_rank": 512}, "multi-head latent attention"),
        ({"model_type": "qwen3_moe", "architectures": None, "num_experts": 8, "num_experts_per_tok": 2,
          "moe_intermediate_size": 32, "mlp_only_layers": [0]}, "mlp_only_layers"),
    ],
)
def test_unsupported_options_are_refused_by_name(models, change, named):
    hf = {**models["qwen2"][0].config.to_dict(), "architectures": ["Qwen2ForCausalLM"], **change}
    with pytest.raises(ValueError, match=named):
        ModelConfig.from_hf_dict(hf)


def test_unused_sliding_window_is_accepted():
    """Qwen2.5 ships use_sliding_window=false with a sliding_window size: that is plain attention."""
    hf = {"model_type": "qwen2", "vocab_size": 96, "hidden_size": 64, "intermediate_size": 128,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "use_sliding_window": False, "sliding_window": 131072, "max_window_layers": 21}
    assert ModelConfig.from_hf_dict(hf).qkv_bias
