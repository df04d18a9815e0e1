"""Hugging Face checkpoints: load -> export -> reload in transformers, sharded folders, clear errors."""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tiny_hf
import torch
import transformers
from safetensors.numpy import load_file, save_file

from agentgym_jax.models.hf_checkpoint import (
    INDEX_FILE,
    SINGLE_FILE,
    CheckpointError,
    load_pretrained,
    save_pretrained,
)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """family -> (HF model, folder with its safetensors and a matching tokenizer)."""
    out = {}
    for family in ("llama3", "qwen3"):
        folder = tmp_path_factory.mktemp(family)
        model = tiny_hf.save(family, folder)
        tiny_hf.save_tokenizer(folder, model.config.vocab_size)
        out[family] = (model, folder)
    return out


def _tokens():
    rng = np.random.default_rng(0)
    tokens = rng.integers(3, 96, (2, 9))
    return tokens, np.array([9, 6])


@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_round_trip_through_transformers_gives_identical_logits(saved, family, tmp_path):
    model, folder = saved[family]
    config, params = load_pretrained(folder)
    save_pretrained(params, config, tmp_path, tokenizer_dir=folder)
    assert (tmp_path / SINGLE_FILE).is_file() and (tmp_path / "tokenizer.json").is_file()
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    assert reloaded.config.tie_word_embeddings == model.config.tie_word_embeddings
    tokens, lengths = _tokens()
    np.testing.assert_array_equal(tiny_hf.logits(reloaded, tokens, lengths), tiny_hf.logits(model, tokens, lengths))
    original = load_file(os.path.join(folder, SINGLE_FILE))
    exported = load_file(os.path.join(tmp_path, SINGLE_FILE))
    assert sorted(exported) == sorted(original)  # tied models store no lm_head.weight, like transformers
    assert transformers.AutoTokenizer.from_pretrained(tmp_path).convert_tokens_to_ids("w7") == 7


def test_sharded_export_writes_an_index_and_reloads(saved, tmp_path):
    model, folder = saved["llama3"]
    config, params = load_pretrained(folder)
    save_pretrained(params, config, tmp_path, dtype="bfloat16", max_shard_bytes=40_000)
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert all(os.path.getsize(tmp_path / f) < 40_000 + 2 * 96 * 64 * 2 for f in files)  # one tensor over at most
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"

    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert reloaded.dtype == torch.bfloat16
    for name, p in model.state_dict().items():
        np.testing.assert_array_equal(
            reloaded.state_dict()[name].float().numpy(), p.to(torch.bfloat16).float().numpy(), err_msg=name
        )
    config_bf16, params_bf16 = load_pretrained(tmp_path, dtype=jnp.bfloat16)
    assert config_bf16 == dataclasses.replace(config, dtype="bfloat16")
    assert params_bf16["layers"]["attn"]["q_proj"]["kernel"].dtype == jnp.bfloat16


def test_transformers_sharded_checkpoint_loads_like_single_file(saved, tmp_path):
    model, folder = saved["qwen3"]
    model.save_pretrained(tmp_path, max_shard_size="60KB")
    assert (tmp_path / INDEX_FILE).is_file() and not (tmp_path / SINGLE_FILE).exists()
    _, single = load_pretrained(folder)
    _, sharded = load_pretrained(tmp_path)
    jax.tree.map(np.testing.assert_array_equal, sharded, single)


def test_value_head_is_left_out_of_the_export(saved, tmp_path):
    from agentgym_jax.models.decoder import init_value_head

    _, folder = saved["qwen3"]
    config, params = load_pretrained(folder)
    params["value_head"] = init_value_head(config, jax.random.key(0))
    save_pretrained(params, config, tmp_path)
    assert not any("value" in name for name in load_file(os.path.join(tmp_path, SINGLE_FILE)))


# --- clear errors -------------------------------------------------------------------------------


def _copy_with(folder, dest, edit):
    """Copies config.json and the weights of `folder` to `dest`, passing the tensors through `edit`."""
    os.makedirs(dest, exist_ok=True)
    (dest / "config.json").write_text((folder / "config.json").read_text())
    save_file(edit(load_file(os.path.join(folder, SINGLE_FILE))), os.path.join(dest, SINGLE_FILE))
    return dest


def test_missing_folder_and_missing_weights(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_pretrained(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(tiny_hf.FAMILIES["qwen2"]().to_dict()))
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_pretrained(tmp_path)


def test_missing_tensor_is_named(saved, tmp_path):
    _, folder = saved["llama3"]
    name = "model.layers.1.self_attn.k_proj.weight"
    dest = _copy_with(folder, tmp_path / "ckpt", lambda t: {k: v for k, v in t.items() if k != name})
    with pytest.raises(CheckpointError, match=f"missing tensor.*{name}"):
        load_pretrained(dest)


def test_wrong_shape_names_tensor_expected_and_got(saved, tmp_path):
    _, folder = saved["llama3"]
    name = "model.layers.0.mlp.up_proj.weight"
    dest = _copy_with(folder, tmp_path / "ckpt", lambda t: {**t, name: np.ascontiguousarray(t[name].T)})
    with pytest.raises(CheckpointError, match=rf"{name}: expected \(128, 64\), got \(64, 128\)"):
        load_pretrained(dest)


def test_tokenizer_larger_than_embedding_is_refused(saved, tmp_path):
    model, folder = saved["qwen3"]
    config, params = load_pretrained(folder)
    big = tmp_path / "big_tokenizer"
    tiny_hf.save_tokenizer(big, model.config.vocab_size + 5)
    with pytest.raises(CheckpointError, match="101 token ids.*only 96 rows"):
        save_pretrained(params, config, tmp_path / "out", tokenizer_dir=big)
    assert not (tmp_path / "out").exists()
    dest = _copy_with(folder, tmp_path / "ckpt", lambda t: t)
    tiny_hf.save_tokenizer(dest, model.config.vocab_size + 5)
    with pytest.raises(CheckpointError, match="101 token ids"):
        load_pretrained(dest)


def test_params_that_do_not_fit_the_config_are_refused(saved, tmp_path):
    _, folder = saved["qwen3"]
    config, params = load_pretrained(folder)
    untied = dataclasses.replace(config, tie_word_embeddings=False)
    with pytest.raises(CheckpointError, match=r"do not match the config: lm_head: expected \(64, 96\), got None"):
        save_pretrained(params, untied, tmp_path)
