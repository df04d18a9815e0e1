"""The model families the decoder implements, keyed by their config.json `model_type`.

Each family is one file here: how its config.json reads into `ModelConfig` (`Family.read`) and
is written back (`Family.write`), and what it refuses by name. The decoder and the checkpoint
code read only `ModelConfig`'s fields, never the family's name, so the next family is a file
with its `Family` and an entry in FAMILIES (plus a `ModelConfig` field and its module in the
decoder where it brings something new); docs/models.md walks through it.
"""

from __future__ import annotations

from typing import Any

from agentgym_jax.models.config import ModelConfig, shared_fields, shared_keys
from agentgym_jax.models.families import gemma, llama, qwen
from agentgym_jax.models.families.base import HF, Family, check_expressible

FAMILIES: dict[str, Family] = {
    family.model_type: family
    for family in (llama.LLAMA, llama.MISTRAL, qwen.QWEN2, qwen.QWEN3, qwen.QWEN3_MOE, qwen.QWEN2_MOE,
                   gemma.GEMMA2, gemma.GEMMA3)
}

# Known model types the decoder does not implement, each refused with what is missing.
NOT_COVERED = {
    "gemma3": "Gemma 3 with a vision tower (Gemma3ForConditionalGeneration, vision_config) is not implemented; "
              "use a text-only Gemma 3 (model_type gemma3_text, e.g. google/gemma-3-1b-it)",
    "gemma3n": "Gemma 3n (per-layer embeddings, AltUp, LAuReL, audio and vision towers) is not implemented",
    "deepseek_v2": "DeepSeek multi-head latent attention (kv_lora_rank) is not implemented",
    "deepseek_v3": "DeepSeek multi-head latent attention (kv_lora_rank) is not implemented",
}


def read_config(hf: HF) -> ModelConfig:
    """The `ModelConfig` of a config.json dict, or a `ValueError` naming what is not implemented."""
    model_type = hf.get("model_type")
    if model_type in NOT_COVERED:
        raise ValueError(f"unsupported model_type {model_type!r}: {NOT_COVERED[model_type]}")
    if model_type not in FAMILIES:
        raise ValueError(
            f"unsupported model_type {model_type!r} (architectures={hf.get('architectures')}); "
            f"supported: {sorted(FAMILIES)}"
        )
    if hf.get("vision_config") or hf.get("kv_lora_rank"):
        raise ValueError(f"unsupported option for {model_type}: "
                         f"{'a vision tower (vision_config)' if hf.get('vision_config') else 'latent attention (kv_lora_rank)'}")
    family = FAMILIES[model_type]
    for arch in hf.get("architectures") or []:
        if arch != family.architecture:
            raise ValueError(f"unsupported architecture {arch!r}; expected {family.architecture!r}")
    return ModelConfig(**{**shared_fields(hf), **family.read(hf)})


def write_config(config: ModelConfig) -> dict[str, Any]:
    """The config.json dict of `config` (what `read_config` reads back to the same config)."""
    family = FAMILIES[config.family]
    check_expressible(config, family)
    return {**shared_keys(config), **family.write(config)}
