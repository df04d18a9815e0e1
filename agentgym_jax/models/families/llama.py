"""Llama (2, 3, 3.1, 3.2) and Mistral: the plain pre-norm SwiGLU block.

Llama 3.1 stretches RoPE to 128k positions with the `llama3` scaling; Llama 3.2's small models tie
the head to the embedding; Mistral attends through a sliding window on every layer.
"""

from __future__ import annotations

from typing import Any

from agentgym_jax.models.config import ModelConfig, rope_of
from agentgym_jax.models.families.base import HF, Family, layer_types, refuse_activation, refuse_dense_options, rope_keys


def _read_llama(hf: HF) -> dict[str, Any]:
    refuse_activation(hf, "hidden_act", "silu")
    refuse_dense_options(hf)
    if any(t != "full_attention" for t in hf.get("layer_types") or ()):
        raise ValueError(f"unsupported layer_types {sorted(set(hf['layer_types']))} for llama: only full attention")
    bias = bool(hf.get("attention_bias", False))
    return dict(rope=rope_of(hf), qkv_bias=bias, o_bias=bias)


def _write_llama(config: ModelConfig) -> dict[str, Any]:
    if config.qkv_bias != config.o_bias:
        raise ValueError("llama has one attention_bias flag for q, k, v and o together")
    return {"hidden_act": "silu", "attention_bias": config.o_bias, "mlp_bias": False, **rope_keys(config.rope)}


def _read_mistral(hf: HF) -> dict[str, Any]:
    refuse_activation(hf, "hidden_act", "silu")
    refuse_dense_options(hf)
    window = hf.get("sliding_window")
    return dict(rope=rope_of(hf), **layer_types(("sliding_attention",) * hf["num_hidden_layers"], window))


def _write_mistral(config: ModelConfig) -> dict[str, Any]:
    if config.layer_types and set(config.layer_types) != {"sliding_attention"}:
        raise ValueError("mistral slides every layer or none (its config.json has one sliding_window)")
    return {"hidden_act": "silu", "sliding_window": config.sliding_window, **rope_keys(config.rope)}


LLAMA = Family(
    model_type="llama", architecture="LlamaForCausalLM", read=_read_llama, write=_write_llama,
    small=lambda layers: {}, fields=frozenset({"rope", "qkv_bias", "o_bias"}),
)
MISTRAL = Family(
    model_type="mistral", architecture="MistralForCausalLM", read=_read_mistral, write=_write_mistral,
    small=lambda layers: dict(sliding_window=8, layer_types=("sliding_attention",) * layers),
    fields=frozenset({"rope", "sliding_window", "layer_types"}),
)
