"""`ModelConfig`: the decoder's shape and options, read from (and written to) a Hugging Face config.json.

Accepts both the transformers-4 form (`rope_theta`, `rope_scaling`, `torch_dtype`) and the
transformers-5 form (`rope_parameters`, `dtype`) of Llama, Qwen2 and Qwen3 configs. Anything the
decoder does not implement (another architecture, yarn RoPE, a sliding window that is actually
used, mixture of experts, biased MLPs) is refused with a `ValueError` that names it, rather than
loaded into a model that silently computes something else.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any

# model_type -> the transformers class that a config.json of that family names.
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
ROPE_TYPES = ("default", "linear", "llama3")
DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding: base frequency and optional context-extension scaling."""

    theta: float = 10000.0
    type: str = "default"  # one of ROPE_TYPES
    factor: float = 1.0  # linear and llama3
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int = 8192  # llama3


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Hashable (usable as a static jit argument) description of one decoder."""

    family: str  # "llama" | "qwen2" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = RopeConfig()
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2 always; Llama/Qwen3 with attention_bias
    o_bias: bool = False  # Llama/Qwen3 with attention_bias
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before RoPE
    dtype: str = "float32"  # storage dtype of the checkpoint (config.json `dtype`)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if self.family not in ARCHITECTURES:
            raise ValueError(f"unsupported model family {self.family!r}; supported: {sorted(ARCHITECTURES)}")
        if self.rope.type not in ROPE_TYPES:
            raise ValueError(f"unsupported rope_type {self.rope.type!r}; supported: {ROPE_TYPES}")
        if self.dtype not in DTYPES:
            raise ValueError(f"unsupported dtype {self.dtype!r}; supported: {DTYPES}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )

    @property
    def architecture(self) -> str:
        return ARCHITECTURES[self.family]

    @classmethod
    def small(cls, family: str = "qwen2", **overrides: Any) -> ModelConfig:
        """A tiny model of `family` (2 layers, hidden 64) for tests and CPU quickstarts."""
        defaults = dict(
            family=family,
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            head_dim=16,
            max_position_embeddings=2048,
            qkv_bias=family == "qwen2",
            qk_norm=family == "qwen3",
            tie_word_embeddings=family == "qwen3",
        )
        return cls(**{**defaults, **overrides})

    @classmethod
    def from_hf_dict(cls, hf: Mapping[str, Any]) -> ModelConfig:
        """Parses a Hugging Face config.json dict (transformers 4 or 5 form)."""
        family = hf.get("model_type")
        if family not in ARCHITECTURES:
            raise ValueError(
                f"unsupported model_type {family!r} (architectures={hf.get('architectures')}); "
                f"supported: {sorted(ARCHITECTURES)}"
            )
        for arch in hf.get("architectures") or []:
            if arch != ARCHITECTURES[family]:
                raise ValueError(f"unsupported architecture {arch!r}; expected {ARCHITECTURES[family]!r}")
        _refuse_unsupported(hf)
        heads = hf["num_attention_heads"]
        attention_bias = bool(hf.get("attention_bias", False))
        eos = hf.get("eos_token_id")
        return cls(
            family=family,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope=_parse_rope(hf),
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=family == "qwen2" or attention_bias,
            o_bias=family != "qwen2" and attention_bias,
            qk_norm=family == "qwen3",
            dtype=hf.get("dtype") or hf.get("torch_dtype") or "float32",
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """The transformers-5 config.json dict (with the 4-form rope keys too, for older readers)."""
        if self.family == "qwen2" and (not self.qkv_bias or self.o_bias):
            raise ValueError("a qwen2 config.json always means q/k/v biases and no o_proj bias")
        if self.family != "qwen2" and self.qkv_bias != self.o_bias:
            raise ValueError(f"{self.family} has one attention_bias flag for q, k, v and o together")
        if self.qk_norm != (self.family == "qwen3"):
            raise ValueError("q/k RMSNorm exists exactly in the qwen3 family")
        rope = {"rope_type": self.rope.type, "rope_theta": self.rope.theta}
        if self.rope.type in ("linear", "llama3"):
            rope["factor"] = self.rope.factor
        if self.rope.type == "llama3":
            rope.update(
                low_freq_factor=self.rope.low_freq_factor,
                high_freq_factor=self.rope.high_freq_factor,
                original_max_position_embeddings=self.rope.original_max_position_embeddings,
            )
        eos = list(self.eos_token_ids)
        hf = {
            "architectures": [self.architecture],
            "model_type": self.family,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "rope_parameters": rope,
            "rope_theta": self.rope.theta,
            "rope_scaling": None if self.rope.type == "default" else rope,
            "dtype": self.dtype,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
        }
        if self.family != "qwen2":
            hf["attention_bias"] = self.o_bias
        return hf


def load_config(folder: str | os.PathLike) -> ModelConfig:
    """`ModelConfig` from `<folder>/config.json`."""
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no config.json in {os.fspath(folder)!r}")
    with open(path) as f:
        return ModelConfig.from_hf_dict(json.load(f))


def _parse_rope(hf: Mapping[str, Any]) -> RopeConfig:
    """Reads `rope_parameters` (transformers 5) or `rope_theta` + `rope_scaling` (transformers 4)."""
    params = hf.get("rope_parameters")
    if params and "rope_type" not in params and "full_attention" in params:
        params = params["full_attention"]  # per-layer-type form; only full attention is supported
    params = dict(params or hf.get("rope_scaling") or {})
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {ROPE_TYPES}")
    defaults = RopeConfig()
    return RopeConfig(
        theta=float(theta),
        type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", defaults.low_freq_factor)),
        high_freq_factor=float(params.get("high_freq_factor", defaults.high_freq_factor)),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings", defaults.original_max_position_embeddings)
        ),
    )


def _refuse_unsupported(hf: Mapping[str, Any]) -> None:
    """Raises a `ValueError` naming the first option the decoder does not implement."""
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported hidden_act {hf['hidden_act']!r}; only 'silu' (SwiGLU) is implemented")
    if hf.get("mlp_bias"):
        raise ValueError("unsupported option mlp_bias=True")
    if hf.get("num_experts") or hf.get("num_local_experts"):
        raise ValueError("unsupported option: mixture of experts (num_experts)")
    layer_types = hf.get("layer_types") or []
    sliding = [t for t in layer_types if t != "full_attention"]
    if sliding:
        raise ValueError(f"unsupported layer_types {sorted(set(sliding))}: only full attention is implemented")
    if (
        not layer_types
        and hf.get("use_sliding_window")
        and hf.get("sliding_window")
        and hf.get("max_window_layers", 0) < hf["num_hidden_layers"]
    ):
        raise ValueError("unsupported option: sliding window attention (use_sliding_window=True)")
