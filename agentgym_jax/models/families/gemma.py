"""Gemma 2 and Gemma 3 (text): the Llama block with Google's deviations.

Both: a GeGLU MLP (tanh-approximated GELU), RMSNorm weights applied as (1 + w), norms after
attention and around the MLP too (four per layer), embeddings scaled by sqrt(hidden), scores
scaled by `query_pre_attn_scalar` ** -0.5, tied embeddings, and local sliding-window layers among
global ones. Gemma 2 alternates them and soft-caps the attention scores and the final logits;
Gemma 3 has five local layers per global one (`sliding_window_pattern` 6), RMSNorm over each
head of q and k, and its own RoPE per layer type (10k on local layers, 1M with linear scaling
on global ones). Gemma 3 with a vision tower (`model_type` gemma3) is refused (`families`).
"""

from __future__ import annotations

from typing import Any

from agentgym_jax.models.config import ModelConfig, RopeConfig, rope_dict, rope_of
from agentgym_jax.models.families.base import HF, Family, layer_types, refuse_activation, rope_keys, written_layer_types

_GEMMA = frozenset({"hidden_act", "norm_plus_one", "sandwich_norms", "scale_embeddings", "query_pre_attn_scalar",
                    "attn_softcap", "final_softcap", "sliding_window", "layer_types", "rope"})


def _read_gemma(hf: HF, pattern: int) -> dict[str, Any]:
    key = "hidden_activation" if "hidden_activation" in hf else "hidden_act"
    act = refuse_activation(hf, key, "gelu_pytorch_tanh")
    if hf.get("attention_bias"):
        raise ValueError(f"unsupported option for {hf['model_type']}: attention_bias=True")
    if hf.get("use_bidirectional_attention"):
        raise ValueError("unsupported option use_bidirectional_attention=True (an embedding model, not a decoder)")
    layers = hf["num_hidden_layers"]
    types = hf.get("layer_types") or [
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)
    ]
    return dict(
        hidden_act=act, norm_plus_one=True, sandwich_norms=True, scale_embeddings=True,
        query_pre_attn_scalar=int(hf.get("query_pre_attn_scalar", 256)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
        **layer_types(types, hf.get("sliding_window", 4096)),
    )


def _write_gemma(config: ModelConfig) -> dict[str, Any]:
    if not (config.norm_plus_one and config.sandwich_norms and config.scale_embeddings):
        raise ValueError(f"{config.family} always has (1 + w) norms, four norms per layer and scaled embeddings")
    return {
        "hidden_activation": config.hidden_act, "query_pre_attn_scalar": config.query_pre_attn_scalar,
        "sliding_window": config.sliding_window, "layer_types": written_layer_types(config), "attention_bias": False,
        "attn_logit_softcapping": config.attn_softcap, "final_logit_softcapping": config.final_softcap,
    }


def _read_gemma2(hf: HF) -> dict[str, Any]:
    return dict(
        **_read_gemma(hf, pattern=2), rope=rope_of(hf),
        attn_softcap=hf.get("attn_logit_softcapping", 50.0), final_softcap=hf.get("final_logit_softcapping", 30.0),
    )


def _write_gemma2(config: ModelConfig) -> dict[str, Any]:
    return {**_write_gemma(config), **rope_keys(config.rope)}


def _read_gemma3(hf: HF) -> dict[str, Any]:
    local = rope_of(hf, "sliding_attention", default_theta=10000.0)
    if "sliding_attention" not in (hf.get("rope_parameters") or {}):  # the transformers-4 form names its base
        local = RopeConfig(theta=float(hf.get("rope_local_base_freq", 10000.0)))
    return dict(
        **_read_gemma(hf, pattern=hf.get("sliding_window_pattern", 6)), qk_norm=True,
        rope=rope_of(hf, "full_attention", default_theta=1_000_000.0), local_rope=local,
        attn_softcap=hf.get("attn_logit_softcapping"), final_softcap=hf.get("final_logit_softcapping"),
    )


def _write_gemma3(config: ModelConfig) -> dict[str, Any]:
    if not config.qk_norm:
        raise ValueError("q/k RMSNorm is part of every gemma3 model")
    local = config.local_rope or config.rope
    return {
        **_write_gemma(config), **rope_keys(config.rope), "rope_local_base_freq": local.theta,
        "rope_parameters": {"full_attention": rope_dict(config.rope), "sliding_attention": rope_dict(local)},
        "use_bidirectional_attention": False,
    }


def _small(layers: int, pattern: int) -> dict[str, Any]:
    types = tuple("sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers))
    return dict(hidden_act="gelu_pytorch_tanh", norm_plus_one=True, sandwich_norms=True, scale_embeddings=True,
                query_pre_attn_scalar=24, tie_word_embeddings=True, sliding_window=8, layer_types=types)


GEMMA2 = Family(
    model_type="gemma2", architecture="Gemma2ForCausalLM", read=_read_gemma2, write=_write_gemma2,
    small=lambda layers: dict(**_small(layers, 2), attn_softcap=50.0, final_softcap=30.0), fields=_GEMMA,
)
GEMMA3 = Family(
    model_type="gemma3_text", architecture="Gemma3ForCausalLM", read=_read_gemma3, write=_write_gemma3,
    small=lambda layers: dict(**_small(layers, 2), qk_norm=True, rope=RopeConfig(theta=1e6),
                              local_rope=RopeConfig(theta=1e4)),
    fields=_GEMMA | {"qk_norm", "local_rope"},
)
