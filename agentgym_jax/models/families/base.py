"""What a model family is to the rest of the code: how its config.json reads into `ModelConfig` and
back, and what it refuses. Helpers the families share live here too."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from agentgym_jax.models.config import ModelConfig, RopeConfig, rope_dict

HF = Mapping[str, Any]  # a config.json dict


@dataclasses.dataclass(frozen=True)
class Family:
    """One `model_type`: its transformers class, the `ModelConfig` fields its config.json sets
    beyond the shared shape (`read`), the keys it writes for them (`write`), and the settings of
    `ModelConfig.small(model_type)` for a model of `num_layers` layers (`small`). `fields` names
    the family-specific fields `write` can express; a config that sets another one cannot be
    written as this family (`check_expressible`)."""

    model_type: str
    architecture: str
    read: Callable[[HF], dict[str, Any]]
    write: Callable[[ModelConfig], dict[str, Any]]
    small: Callable[[int], dict[str, Any]]
    fields: frozenset[str]


# Fields every family writes through `config.shared_keys`; all others are family-specific.
SHARED_FIELDS = frozenset({
    "family", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
    "head_dim", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings", "dtype", "bos_token_id",
    "eos_token_ids",
})


def check_expressible(config: ModelConfig, family: Family) -> None:
    """Refuses a config with a family-specific field set that `family`'s config.json cannot say."""
    for field in dataclasses.fields(ModelConfig):
        if field.name in SHARED_FIELDS | family.fields:
            continue
        value = getattr(config, field.name)
        if value != field.default:
            raise ValueError(f"a {family.model_type} config.json cannot express {field.name}={value!r}")


def refuse_activation(hf: HF, key: str, expected: str) -> str:
    act = hf.get(key, expected)
    if act != expected:
        raise ValueError(f"unsupported {key} {act!r}; only {expected!r} is implemented for {hf['model_type']}")
    return act


def refuse_dense_options(hf: HF) -> None:
    """Options no dense family here implements."""
    if hf.get("mlp_bias"):
        raise ValueError("unsupported option mlp_bias=True")
    if hf.get("num_experts") or hf.get("num_local_experts"):
        raise ValueError(f"unsupported option for {hf['model_type']}: mixture of experts (num_experts); "
                         "the MoE families are qwen3_moe and qwen2_moe")


def layer_types(types: Sequence[str] | None, window: int | None) -> dict[str, Any]:
    """`sliding_window` and `layer_types` fields: () and None where no layer slides (a layer type
    without a window is full attention, as in transformers)."""
    types = tuple(types or ())
    if not window or "sliding_attention" not in types:
        return dict(sliding_window=None, layer_types=())
    return dict(sliding_window=int(window), layer_types=types)


def written_layer_types(config: ModelConfig) -> list[str]:
    return list(config.layer_types or ("full_attention",) * config.num_layers)


def rope_keys(rope: RopeConfig) -> dict[str, Any]:
    """The RoPE keys of config.json: the transformers-5 `rope_parameters` and the 4-form pair."""
    params = rope_dict(rope)
    return {"rope_parameters": params, "rope_theta": rope.theta, "rope_scaling": None if rope.type == "default" else params}
