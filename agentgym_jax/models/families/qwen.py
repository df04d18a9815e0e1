"""Qwen2 (q/k/v biases), Qwen3 (q/k RMSNorm), and their mixture-of-experts siblings: Qwen3-MoE
(128 experts, 8 per token, renormalised top-k weights) and Qwen2-MoE (60 experts, 4 per token,
plus a shared expert behind a sigmoid gate).

A Qwen config.json may slide the layers from `max_window_layers` up when `use_sliding_window` is
set (transformers 5 writes `layer_types` too); Qwen2.5 ships an unused window (`false`).
"""

from __future__ import annotations

from typing import Any

from agentgym_jax.models.config import ModelConfig, rope_of
from agentgym_jax.models.families.base import HF, Family, layer_types, refuse_activation, refuse_dense_options, rope_keys

_SLIDING = frozenset({"sliding_window", "layer_types"})
_MOE = frozenset({"num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob"})


def _sliding(hf: HF) -> dict[str, Any]:
    window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
    start = hf.get("max_window_layers", 28)
    types = hf.get("layer_types") or [
        "sliding_attention" if i >= start else "full_attention" for i in range(hf["num_hidden_layers"])
    ]
    return layer_types(types, window)


def _write_sliding(config: ModelConfig) -> dict[str, Any]:
    if not config.layer_types:
        return {"use_sliding_window": False, "sliding_window": None}
    first = config.layer_types.index("sliding_attention")
    return {"use_sliding_window": True, "sliding_window": config.sliding_window, "max_window_layers": first,
            "layer_types": list(config.layer_types)}


def _read_qwen2(hf: HF) -> dict[str, Any]:
    refuse_activation(hf, "hidden_act", "silu")
    refuse_dense_options(hf)
    return dict(rope=rope_of(hf), qkv_bias=True, **_sliding(hf))


def _write_qwen2(config: ModelConfig) -> dict[str, Any]:
    if not config.qkv_bias or config.o_bias:
        raise ValueError("a qwen2 config.json always means q/k/v biases and no o_proj bias")
    return {"hidden_act": "silu", **rope_keys(config.rope), **_write_sliding(config)}


def _read_qwen3(hf: HF) -> dict[str, Any]:
    refuse_activation(hf, "hidden_act", "silu")
    refuse_dense_options(hf)
    bias = bool(hf.get("attention_bias", False))
    return dict(rope=rope_of(hf), qkv_bias=bias, o_bias=bias, qk_norm=True, **_sliding(hf))


def _write_qwen3(config: ModelConfig) -> dict[str, Any]:
    if config.qkv_bias != config.o_bias:
        raise ValueError("qwen3 has one attention_bias flag for q, k, v and o together")
    if not config.qk_norm:
        raise ValueError("q/k RMSNorm is part of every qwen3 model")
    return {"hidden_act": "silu", "attention_bias": config.o_bias, **rope_keys(config.rope), **_write_sliding(config)}


def _experts(hf: HF) -> dict[str, Any]:
    """The MoE fields; layers without experts (`mlp_only_layers`, `decoder_sparse_step` > 1) are refused."""
    if hf.get("mlp_only_layers") or hf.get("decoder_sparse_step", 1) != 1:
        raise ValueError(f"unsupported option for {hf['model_type']}: dense MLP layers among the expert layers "
                         f"(mlp_only_layers={hf.get('mlp_only_layers')}, decoder_sparse_step={hf.get('decoder_sparse_step')})")
    if hf.get("mlp_bias"):
        raise ValueError("unsupported option mlp_bias=True")
    return dict(
        num_experts=hf.get("num_experts") or hf["num_local_experts"], num_experts_per_tok=hf["num_experts_per_tok"],
        moe_intermediate_size=hf["moe_intermediate_size"], norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
    )


def _write_experts(config: ModelConfig) -> dict[str, Any]:
    return {"num_experts": config.num_experts, "num_experts_per_tok": config.num_experts_per_tok,
            "moe_intermediate_size": config.moe_intermediate_size, "norm_topk_prob": config.norm_topk_prob,
            "decoder_sparse_step": 1, "mlp_only_layers": []}


def _read_qwen3_moe(hf: HF) -> dict[str, Any]:
    refuse_activation(hf, "hidden_act", "silu")
    bias = bool(hf.get("attention_bias", False))
    return dict(rope=rope_of(hf), qkv_bias=bias, o_bias=bias, qk_norm=True, **_sliding(hf), **_experts(hf))


def _write_qwen3_moe(config: ModelConfig) -> dict[str, Any]:
    return {**_write_qwen3(config), **_write_experts(config)}


def _read_qwen2_moe(hf: HF) -> dict[str, Any]:
    refuse_activation(hf, "hidden_act", "silu")
    return dict(rope=rope_of(hf), qkv_bias=bool(hf.get("qkv_bias", True)), **_sliding(hf), **_experts(hf),
                shared_expert_intermediate_size=hf.get("shared_expert_intermediate_size", 0))


def _write_qwen2_moe(config: ModelConfig) -> dict[str, Any]:
    if config.o_bias:
        raise ValueError("qwen2_moe has no o_proj bias")
    if not config.shared_expert_intermediate_size:
        raise ValueError("every qwen2_moe layer has a shared expert (shared_expert_intermediate_size > 0)")
    return {"hidden_act": "silu", "qkv_bias": config.qkv_bias, **rope_keys(config.rope), **_write_sliding(config),
            **_write_experts(config), "shared_expert_intermediate_size": config.shared_expert_intermediate_size}


def _small_moe(shared: int) -> dict[str, Any]:
    return dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=shared)


QWEN2 = Family(
    model_type="qwen2", architecture="Qwen2ForCausalLM", read=_read_qwen2, write=_write_qwen2,
    small=lambda layers: dict(qkv_bias=True), fields=frozenset({"rope", "qkv_bias", *_SLIDING}),
)
QWEN3 = Family(
    model_type="qwen3", architecture="Qwen3ForCausalLM", read=_read_qwen3, write=_write_qwen3,
    small=lambda layers: dict(qk_norm=True, tie_word_embeddings=True),
    fields=frozenset({"rope", "qkv_bias", "o_bias", "qk_norm", *_SLIDING}),
)
QWEN3_MOE = Family(
    model_type="qwen3_moe", architecture="Qwen3MoeForCausalLM", read=_read_qwen3_moe, write=_write_qwen3_moe,
    small=lambda layers: dict(qk_norm=True, norm_topk_prob=True, **_small_moe(0)),
    fields=frozenset({"rope", "qkv_bias", "o_bias", "qk_norm", *_SLIDING, *_MOE}),
)
QWEN2_MOE = Family(
    model_type="qwen2_moe", architecture="Qwen2MoeForCausalLM", read=_read_qwen2_moe, write=_write_qwen2_moe,
    small=lambda layers: dict(qkv_bias=True, **_small_moe(48)),
    fields=frozenset({"rope", "qkv_bias", *_SLIDING, *_MOE, "shared_expert_intermediate_size"}),
)
