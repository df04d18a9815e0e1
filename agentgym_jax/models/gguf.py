"""GGUF (llama.cpp's file format) to a Hugging Face folder that `hf_checkpoint.load_pretrained` reads.

Registry packages ship pretrained models as GGUF (often quantised); the decoder loads Hugging Face
safetensors. `convert(gguf_path, out_dir)` reads the file with the `gguf` package, dequantises every
tensor to float32 (all the types `gguf.quants` decodes: F32, F16, BF16, Q4_0/1, Q5_0/1, Q8_0, the
K-quants Q2_K-Q6_K, the IQ types), undoes the row permutation llama.cpp's converter applies to the
q/k projections of the llama family (its rotary layout is interleaved; Qwen2 and Qwen3 are stored
as they are), and writes config.json, safetensors (sharded above `max_shard_bytes`) and the
tokenizer rebuilt from the file's metadata (`tokenizer.json`, `tokenizer_config.json` with the
chat template and special tokens). Byte-level BPE vocabularies (`tokenizer.ggml.model = gpt2`:
SmolLM2, Qwen2/2.5/3, Llama 3) are rebuilt; SentencePiece ones (`llama`) are refused by name.

    python -m agentgym_jax.models.gguf --gguf=model.gguf --out=/models/smollm2   # or convert(...)
"""

from __future__ import annotations

import json
import os
import pathlib
import re
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, ReaderTensor
from gguf.quants import dequantize
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from agentgym_jax.models.config import ModelConfig, RopeConfig
from agentgym_jax.models.hf_checkpoint import write_tensors

ARCHITECTURES = ("llama", "qwen2", "qwen3")  # GGUF `general.architecture` values, the same names as our families
PERMUTED_QK = ("llama",)  # llama.cpp's converter interleaves the rotary halves of q/k rows for these only

# GGUF tensor name -> Hugging Face name ({layer} per block).
_TENSOR_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{layer}.attn_norm.weight": "model.layers.{layer}.input_layernorm.weight",
    "blk.{layer}.ffn_norm.weight": "model.layers.{layer}.post_attention_layernorm.weight",
    "blk.{layer}.attn_q.weight": "model.layers.{layer}.self_attn.q_proj.weight",
    "blk.{layer}.attn_k.weight": "model.layers.{layer}.self_attn.k_proj.weight",
    "blk.{layer}.attn_v.weight": "model.layers.{layer}.self_attn.v_proj.weight",
    "blk.{layer}.attn_q.bias": "model.layers.{layer}.self_attn.q_proj.bias",
    "blk.{layer}.attn_k.bias": "model.layers.{layer}.self_attn.k_proj.bias",
    "blk.{layer}.attn_v.bias": "model.layers.{layer}.self_attn.v_proj.bias",
    "blk.{layer}.attn_output.weight": "model.layers.{layer}.self_attn.o_proj.weight",
    "blk.{layer}.attn_output.bias": "model.layers.{layer}.self_attn.o_proj.bias",
    "blk.{layer}.attn_q_norm.weight": "model.layers.{layer}.self_attn.q_norm.weight",
    "blk.{layer}.attn_k_norm.weight": "model.layers.{layer}.self_attn.k_norm.weight",
    "blk.{layer}.ffn_gate.weight": "model.layers.{layer}.mlp.gate_proj.weight",
    "blk.{layer}.ffn_up.weight": "model.layers.{layer}.mlp.up_proj.weight",
    "blk.{layer}.ffn_down.weight": "model.layers.{layer}.mlp.down_proj.weight",
}
_BLOCK = re.compile(r"^blk\.(\d+)\.")

# `tokenizer.ggml.pre` -> how text is split before BPE (the Hugging Face tokenizer each names).
_GPT2_SPLIT = None  # ByteLevel's own GPT-2 regex
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZERS = {
    "gpt2": ("bytelevel", _GPT2_SPLIT),
    "default": ("bytelevel", _GPT2_SPLIT),
    "smollm": ("digits", _GPT2_SPLIT),  # SmolLM/SmolLM2: every digit its own piece, then GPT-2's split
    "llama-bpe": ("split", _LLAMA3_SPLIT),  # Llama 3
    "qwen2": ("split", _QWEN2_SPLIT),  # Qwen2, Qwen2.5, Qwen3
}
CONTROL, USER_DEFINED = 3, 4  # `tokenizer.ggml.token_type` values


class GGUFError(ValueError):
    """A GGUF file this converter cannot turn into a model the decoder runs exactly."""


def metadata(reader: GGUFReader) -> dict[str, Any]:
    """Every key-value field of the file as Python values (token lists included)."""
    return {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}


def model_config(meta: Mapping[str, Any], tensor_names: set[str]) -> ModelConfig:
    """The decoder's config from the `<arch>.*` metadata; what it does not implement is refused."""
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(ARCHITECTURES)}")
    if "rope_freqs.weight" in tensor_names:
        raise GGUFError("GGUF with a rope_freqs tensor (Llama 3.1+ frequency scaling) is not supported")
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", "linear"):
        raise GGUFError(f"unsupported GGUF rope scaling {scaling!r}; supported: none, linear")
    hidden, heads = meta[f"{arch}.embedding_length"], meta[f"{arch}.attention.head_count"]
    bias = "blk.0.attn_q.bias" in tensor_names
    eos = meta.get("tokenizer.ggml.eos_token_id")
    return ModelConfig(
        family=arch,
        vocab_size=int(meta.get(f"{arch}.vocab_size") or len(meta["tokenizer.ggml.tokens"])),
        hidden_size=int(hidden),
        intermediate_size=int(meta[f"{arch}.feed_forward_length"]),
        num_layers=int(meta[f"{arch}.block_count"]),
        num_heads=int(heads),
        num_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv") or heads),
        head_dim=int(meta.get(f"{arch}.attention.key_length") or hidden // heads),
        rms_norm_eps=float(meta[f"{arch}.attention.layer_norm_rms_epsilon"]),
        rope=RopeConfig(
            theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
            type="linear" if scaling == "linear" else "default",
            factor=float(meta.get(f"{arch}.rope.scaling.factor", 1.0)),
        ),
        max_position_embeddings=int(meta.get(f"{arch}.context_length", 4096)),
        tie_word_embeddings="output.weight" not in tensor_names,
        qkv_bias=arch == "qwen2" or bias,
        o_bias=arch != "qwen2" and bias,
        qk_norm=arch == "qwen3",
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
    )


def unpermute_qk(rows: np.ndarray, heads: int) -> np.ndarray:
    """Undoes llama.cpp's q/k permutation: per head, its converter stores the rows of the two
    rotary halves interleaved (row 2i from the first half, 2i+1 from the second)."""
    half = rows.shape[0] // heads // 2
    return rows.reshape(heads, half, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def dequantized(tensor: ReaderTensor) -> np.ndarray:
    """The tensor's values as float32, in row-major order with GGUF's innermost dim last (the HF layout)."""
    qtype = GGMLQuantizationType(tensor.tensor_type)
    try:
        values = dequantize(tensor.data, qtype)
    except NotImplementedError as e:
        raise GGUFError(f"tensor {tensor.name}: quantisation type {qtype.name} cannot be dequantised") from e
    shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists dims innermost first
    return np.asarray(values, np.float32).reshape(shape)


def hf_name(gguf_name: str) -> str:
    match = _BLOCK.match(gguf_name)
    key = _BLOCK.sub("blk.{layer}.", gguf_name) if match else gguf_name
    if key not in _TENSOR_NAMES:
        raise GGUFError(f"unknown GGUF tensor {gguf_name!r}")
    return _TENSOR_NAMES[key].format(layer=match.group(1) if match else "")


def hf_tensors(reader: GGUFReader, config: ModelConfig) -> Iterator[tuple[str, int, Any]]:
    """(HF name, float32 bytes, a function making the array) per tensor, in file order."""
    for tensor in reader.tensors:
        def make(tensor: ReaderTensor = tensor) -> np.ndarray:
            values = dequantized(tensor)
            if config.family in PERMUTED_QK and (".attn_q." in tensor.name or ".attn_k." in tensor.name):
                heads = config.num_heads if ".attn_q." in tensor.name else config.num_kv_heads
                values = unpermute_qk(values, heads)
            return values

        yield hf_name(tensor.name), 4 * int(np.prod(tensor.shape)), make


def tokenizer(meta: Mapping[str, Any]) -> tuple[Tokenizer, dict[str, Any]]:
    """The Hugging Face fast tokenizer and `tokenizer_config.json` the metadata describes."""
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise GGUFError(f"GGUF tokenizer model {kind!r} is not supported; supported: gpt2 (byte-level BPE)")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise GGUFError(f"unknown GGUF pre-tokenizer {pre!r}; supported: {', '.join(PRE_TOKENIZERS)}")
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    vocab = {token: i for i, token in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    kind, split = PRE_TOKENIZERS[pre]
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=kind != "split")
    if kind == "split":
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"), byte_level])
    elif kind == "digits":
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    special = [t for t, ty in zip(tokens, types) if ty == CONTROL]
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == USER_DEFINED])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])

    def token(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        return None if i is None or i >= len(tokens) else tokens[i]

    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos"),
        "eos_token": token("eos"),
        "unk_token": token("unknown"),
        "pad_token": token("padding"),
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "model_max_length": int(meta.get(f"{meta['general.architecture']}.context_length", 4096)),
        "clean_up_tokenization_spaces": False,
        "extra_special_tokens": [t for t in special if t not in {token("bos"), token("eos"), token("unknown"), token("padding")}],
    }
    if "tokenizer.chat_template" in meta:
        config["chat_template"] = meta["tokenizer.chat_template"]
    return tok, config


def convert(gguf_path: str | os.PathLike, out_dir: str | os.PathLike, *, max_shard_bytes: int = 4 * 2**30,
            progress: bool = False) -> pathlib.Path:
    """Writes the Hugging Face folder of a GGUF model (float32 weights) to `out_dir` and returns it."""
    reader = GGUFReader(os.fspath(gguf_path))
    meta = metadata(reader)
    config = model_config(meta, {t.name for t in reader.tensors})
    tok, tok_config = tokenizer(meta)
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_tensors(out, list(hf_tensors(reader, config)), max_shard_bytes=max_shard_bytes, progress=progress)
    (out / "config.json").write_text(json.dumps(config.to_hf_dict(), indent=2))
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": config.bos_token_id, "eos_token_id": list(config.eos_token_ids) or None}, indent=2))
    return out


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", required=True, help="the .gguf file")
    parser.add_argument("--out", required=True, help="the Hugging Face folder to write")
    args = parser.parse_args()
    print(convert(args.gguf, args.out, progress=True))
