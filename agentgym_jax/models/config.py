"""`ModelConfig`: the decoder's shape and options, read from (and written to) a Hugging Face config.json.

One flat, hashable description covers every family the decoder implements (`models/families/`:
Llama and Mistral, Qwen2, Qwen3 and their mixture-of-experts siblings, Gemma 2 and 3). Each
family reads its own config.json keys into these fields and writes them back; what this module
parses is what they share: the shape, RoPE (`rope_theta` + `rope_scaling` in the transformers-4
form, `rope_parameters` in the 5 form), dtype and special tokens. Anything the decoder does not
implement is refused with a `ValueError` that names it, rather than loaded into a model that
silently computes something else.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any

ROPE_TYPES = ("default", "linear", "llama3")
DTYPES = ("float32", "bfloat16", "float16")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")  # the MLP's gate: SwiGLU (Llama, Qwen) or GeGLU (Gemma)
LAYER_TYPES = ("full_attention", "sliding_attention")


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

    family: str  # a key of models.families.FAMILIES (the config.json `model_type`)
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
    qk_norm: bool = False  # Qwen3, Gemma 3: RMSNorm over each head of q and k before RoPE
    dtype: str = "float32"  # storage dtype of the checkpoint (config.json `dtype`)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Gemma 2 / 3 (docs/models.md has what each one is)
    hidden_act: str = "silu"  # one of ACTIVATIONS
    norm_plus_one: bool = False  # RMSNorm weights are stored as w and scale by (1 + w)
    sandwich_norms: bool = False  # norms after attention and before and after the MLP too
    scale_embeddings: bool = False  # embeddings times sqrt(hidden_size), in the compute dtype
    query_pre_attn_scalar: int | None = None  # scores scaled by its -0.5 power (None: head_dim's)
    attn_softcap: float | None = None  # scores -> cap * tanh(scores / cap) before the mask
    final_softcap: float | None = None  # the same on the logits
    # Sliding-window attention: layer i sees the keys at positions p - window < k <= p if
    # layer_types[i] is "sliding_attention" (Mistral: every layer; Gemma: alternating with global)
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()  # one of LAYER_TYPES per layer; (): every layer full attention
    local_rope: RopeConfig | None = None  # RoPE of the sliding layers (Gemma 3); None: `rope`
    # Mixture of experts (Qwen3-MoE, Qwen2-MoE): every layer's MLP is `num_experts` experts of
    # `moe_intermediate_size`, `num_experts_per_tok` of them per token, plus one shared expert
    # of `shared_expert_intermediate_size` (0: none) behind a sigmoid gate
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # the top-k routing weights renormalised to sum to 1
    shared_expert_intermediate_size: int = 0

    def __post_init__(self):
        from agentgym_jax.models.families import FAMILIES  # noqa: PLC0415 (the families import this module)

        if self.family not in FAMILIES:
            raise ValueError(f"unsupported model family {self.family!r}; supported: {sorted(FAMILIES)}")
        for name, value, valid in (("rope_type", self.rope.type, ROPE_TYPES), ("dtype", self.dtype, DTYPES),
                                   ("hidden_act", self.hidden_act, ACTIVATIONS)):
            if value not in valid:
                raise ValueError(f"unsupported {name} {value!r}; supported: {valid}")
        if self.local_rope is not None and self.local_rope.type not in ROPE_TYPES:
            raise ValueError(f"unsupported rope_type {self.local_rope.type!r}; supported: {ROPE_TYPES}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.layer_types:
            if len(self.layer_types) != self.num_layers or set(self.layer_types) - set(LAYER_TYPES):
                raise ValueError(f"layer_types {list(self.layer_types)} must name one of {LAYER_TYPES} for each of "
                                 f"the {self.num_layers} layers")
            if "sliding_attention" in self.layer_types and not self.sliding_window:
                raise ValueError("sliding_attention layers need a sliding_window >= 1")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} must be in 1 .. num_experts={self.num_experts}")

    @property
    def architecture(self) -> str:
        from agentgym_jax.models.families import FAMILIES  # noqa: PLC0415

        return FAMILIES[self.family].architecture

    @property
    def sliding_layers(self) -> tuple[bool, ...]:
        """Per layer: does it attend through the sliding window."""
        return tuple(t == "sliding_attention" for t in self.layer_types) or (False,) * self.num_layers

    @property
    def moe(self) -> bool:
        return self.num_experts > 0

    @classmethod
    def small(cls, family: str = "qwen2", **overrides: Any) -> ModelConfig:
        """A tiny model of `family` (2 layers, hidden 64) for tests and CPU quickstarts."""
        from agentgym_jax.models.families import FAMILIES  # noqa: PLC0415

        if family not in FAMILIES:
            raise ValueError(f"unsupported model family {family!r}; supported: {sorted(FAMILIES)}")
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
            **FAMILIES[family].small(overrides.get("num_layers", 2)),
        )
        return cls(**{**defaults, **overrides})

    @classmethod
    def from_hf_dict(cls, hf: Mapping[str, Any]) -> ModelConfig:
        """Parses a Hugging Face config.json dict (transformers 4 or 5 form)."""
        from agentgym_jax.models.families import read_config  # noqa: PLC0415

        return read_config(hf)

    def to_hf_dict(self) -> dict[str, Any]:
        """The transformers-5 config.json dict (with the 4-form rope keys too, for older readers)."""
        from agentgym_jax.models.families import write_config  # noqa: PLC0415

        return write_config(self)


def load_config(folder: str | os.PathLike) -> ModelConfig:
    """`ModelConfig` from `<folder>/config.json`."""
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no config.json in {os.fspath(folder)!r}")
    with open(path) as f:
        return ModelConfig.from_hf_dict(json.load(f))


def shared_fields(hf: Mapping[str, Any]) -> dict[str, Any]:
    """The `ModelConfig` fields every family's config.json spells the same way."""
    heads = hf["num_attention_heads"]
    eos = hf.get("eos_token_id")
    return dict(
        family=hf["model_type"],
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        max_position_embeddings=hf.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        dtype=hf.get("dtype") or hf.get("torch_dtype") or "float32",
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
    )


def shared_keys(config: ModelConfig) -> dict[str, Any]:
    """The config.json keys every family writes the same way (the inverse of `shared_fields`)."""
    eos = list(config.eos_token_ids)
    return {
        "architectures": [config.architecture],
        "model_type": config.family,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings,
        "dtype": config.dtype,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
    }


def parse_rope(params: Mapping[str, Any] | None, default_theta: float = 10000.0) -> RopeConfig:
    """A `RopeConfig` from one rope dict (`rope_parameters`, or `rope_scaling` plus `rope_theta`)."""
    params = dict(params or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {ROPE_TYPES}")
    defaults = RopeConfig()
    return RopeConfig(
        theta=float(params.get("rope_theta", default_theta)),
        type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", defaults.low_freq_factor)),
        high_freq_factor=float(params.get("high_freq_factor", defaults.high_freq_factor)),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings", defaults.original_max_position_embeddings)
        ),
    )


def rope_of(hf: Mapping[str, Any], layer_type: str = "full_attention", default_theta: float = 10000.0) -> RopeConfig:
    """The RoPE of `layer_type` layers: `rope_parameters` (transformers 5; per layer type where a
    family has one per type) or `rope_theta` + `rope_scaling` (transformers 4)."""
    params = hf.get("rope_parameters")
    if params and "rope_type" not in params and layer_type in params:
        params = params[layer_type]
    return parse_rope(params or hf.get("rope_scaling"), hf.get("rope_theta", default_theta))


def rope_dict(rope: RopeConfig) -> dict[str, Any]:
    """The transformers-5 `rope_parameters` dict of `rope`."""
    out: dict[str, Any] = {"rope_type": rope.type, "rope_theta": rope.theta}
    if rope.type in ("linear", "llama3"):
        out["factor"] = rope.factor
    if rope.type == "llama3":
        out.update(
            low_freq_factor=rope.low_freq_factor,
            high_freq_factor=rope.high_freq_factor,
            original_max_position_embeddings=rope.original_max_position_embeddings,
        )
    return out
