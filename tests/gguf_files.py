"""Tiny GGUF files written with the `gguf` package's writer, as llama.cpp's converter lays them out.

Every tensor type the converter must read appears in each model (F32, F16, BF16, Q8_0, Q4_0, Q4_1,
Q4_K, Q5_K, Q6_K); llama q/k rows are stored permuted as llama.cpp stores them. The K-quants have
no writer in `gguf.quants`, so their blocks are random bytes with small, finite scales: any bit
pattern is a valid block, and transformers decodes the same bytes with its own dequantiser.
"""

from __future__ import annotations

import pathlib

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

HIDDEN, FFN, HEADS, KV_HEADS, LAYERS = 256, 256, 4, 2, 2  # 256: a K-quant block is one row of 256
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("c", "r"), ("cr", "a"), ("f", "t"), ("cra", "ft"), ("Ġ", "cra"),
          ("Ġcra", "ft"), ("o", "a"), ("oa", "k"), ("Ġ", "oak"), ("1", "2")]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# tensor kind -> storage type: all nine types the issue names appear in every model.
TYPES = {
    "token_embd": Q.Q8_0, "output": Q.Q4_0, "attn_q": Q.Q4_K, "attn_k": Q.Q5_K, "attn_v": Q.Q6_K,
    "attn_output": Q.Q4_0, "ffn_gate": Q.Q4_1, "ffn_up": Q.F16, "ffn_down": Q.BF16,
}
# K-quant block layouts: offsets of the float16 super-block scales (the rest of a block is any bytes).
K_SCALES = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}
K_SCALE_VALUES = {Q.Q4_K: (2e-4, 1e-4), Q.Q5_K: (1e-4, 5e-5), Q.Q6_K: (2e-5,)}


def byte_level_alphabet() -> list[str]:
    """GPT-2's byte -> printable character table (the alphabet of byte-level BPE vocabularies)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def vocabulary() -> tuple[list[str], list[int]]:
    tokens = list(SPECIALS) + byte_level_alphabet() + ["".join(m) for m in MERGES] + ["<think>"]
    types = [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS) - 1) + [4]  # control, normal, user-defined
    return tokens, types


def permute_qk(rows: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's q/k row order (the inverse of what the importer undoes)."""
    half = rows.shape[0] // heads // 2
    return rows.reshape(heads, 2, half, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def _add(writer: gguf.GGUFWriter, name: str, values: np.ndarray, qtype: Q, rng: np.random.Generator) -> None:
    if qtype == Q.F32:
        writer.add_tensor(name, values.astype(np.float32))
    elif qtype == Q.F16:
        writer.add_tensor(name, values.astype(np.float16))
    elif qtype in K_SCALES:
        block_size, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        rows, cols = values.shape
        blocks = rng.integers(0, 256, (rows, cols // block_size, block_bytes), dtype=np.uint8)
        for offset, scale in zip(K_SCALES[qtype], K_SCALE_VALUES[qtype]):
            half = (scale * (0.5 + rng.random((rows, cols // block_size)))).astype(np.float16)
            blocks[..., offset : offset + 2] = half.view(np.uint8).reshape(rows, cols // block_size, 2)
        writer.add_tensor(name, blocks.reshape(rows, -1), raw_dtype=qtype)
    else:
        writer.add_tensor(name, gguf.quants.quantize(values.astype(np.float32), qtype), raw_dtype=qtype)


def write(path: pathlib.Path, arch: str, *, pre: str = "smollm", seed: int = 0, tied: bool = False) -> pathlib.Path:
    """A 2-layer `arch` model (llama, qwen2, qwen3) with random weights and a byte-level BPE vocabulary."""
    rng = np.random.default_rng(seed)
    tokens, types = vocabulary()
    head_dim = 128 if arch == "qwen3" else HIDDEN // HEADS  # qwen3: head_dim != hidden / heads (128, as in Qwen3-0.6B;
    # transformers takes Qwen3's default 128 rather than reading `key_length`)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(LAYERS)
    writer.add_context_length(512)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(len(tokens))
    if arch == "qwen3":
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges([" ".join(m) for m in MERGES])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)

    def dense(*shape: int) -> np.ndarray:
        return (0.08 * rng.standard_normal(shape)).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.2 * rng.standard_normal(n)).astype(np.float32)

    _add(writer, "token_embd.weight", dense(len(tokens), HIDDEN), TYPES["token_embd"], rng)
    for i in range(LAYERS):
        b = f"blk.{i}."
        _add(writer, b + "attn_norm.weight", norm(HIDDEN), Q.F32, rng)
        _add(writer, b + "ffn_norm.weight", norm(HIDDEN), Q.F32, rng)
        for proj, heads in (("attn_q", HEADS), ("attn_k", KV_HEADS), ("attn_v", KV_HEADS)):
            _add(writer, b + proj + ".weight", dense(heads * head_dim, HIDDEN), TYPES[proj], rng)
            if arch == "qwen2":
                _add(writer, b + proj + ".bias", dense(heads * head_dim), Q.F32, rng)
        if arch == "qwen3":
            _add(writer, b + "attn_q_norm.weight", norm(head_dim), Q.F32, rng)
            _add(writer, b + "attn_k_norm.weight", norm(head_dim), Q.F32, rng)
        _add(writer, b + "attn_output.weight", dense(HIDDEN, HEADS * head_dim), TYPES["attn_output"], rng)
        _add(writer, b + "ffn_gate.weight", dense(FFN, HIDDEN), TYPES["ffn_gate"], rng)
        _add(writer, b + "ffn_up.weight", dense(FFN, HIDDEN), TYPES["ffn_up"], rng)
        _add(writer, b + "ffn_down.weight", dense(HIDDEN, FFN), TYPES["ffn_down"], rng)
    _add(writer, "output_norm.weight", norm(HIDDEN), Q.F32, rng)
    if not tied:
        _add(writer, "output.weight", dense(len(tokens), HIDDEN), TYPES["output"], rng)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
