"""The config sections every mode shares, read into typed settings, each in one place: what of
the model trains (`tuning`), which attention kernels run (`attention_kernels`) and how episodes
are sampled (`rollout`). A bad value is a one-line `ConfigError` (architecture rule 6)."""

from __future__ import annotations

import ml_collections

from agentgym_jax.config import ConfigError
from agentgym_jax.models.kernels import AttentionKernels
from agentgym_jax.models.tuning import Tuning
from agentgym_jax.rollout.engine import RolloutConfig


def tuning(config: ml_collections.ConfigDict) -> Tuning:
    """What trains (`config.model.lora_rank`, `lora_alpha`, `lora_targets`, `trainable_layers`)."""
    m = config.model
    targets = m.get("lora_targets", "q,k,v,o,gate,up,down")
    try:
        return Tuning(
            lora_rank=m.get("lora_rank", 0), lora_alpha=m.get("lora_alpha", 16.0),
            lora_targets=tuple(t.strip() for t in targets.split(",") if t.strip()) if isinstance(targets, str) else tuple(targets),
            trainable_layers=m.get("trainable_layers", 0),
        )
    except ValueError as e:
        raise ConfigError(f"config.model: {e}") from e


def require_untuned(config: ml_collections.ConfigDict) -> None:
    """A one-line error for the modes that train every parameter (agentevol, dpo)."""
    if not tuning(config).full:
        raise ConfigError(f"mode={config.mode} trains every parameter: model.lora_rank and model.trainable_layers "
                          "must be 0 (they are supported by mode=rl and mode=sft)")


def attention_kernels(config: ml_collections.ConfigDict) -> AttentionKernels:
    """`config.model.attention_kernel` (training rows), `decode_kernel` and a mixture of experts'
    `moe_dispatch` resolved for this backend."""
    try:
        return AttentionKernels.for_backend(config.model.attention_kernel, config.model.decode_kernel,
                                            moe_dispatch=config.model.get("moe_dispatch", "auto"))
    except ValueError as e:
        raise ConfigError(f"config.model: {e}") from e


def rollout(config: ml_collections.ConfigDict, temperature: float | None = None, group_size: int | None = None) -> RolloutConfig:
    """`config.rollout`, at another `temperature` or `group_size` where given (evaluation: greedy, one sample)."""
    r = config.rollout
    try:
        return RolloutConfig(
            group_size=r.group_size if group_size is None else group_size,
            max_tokens_per_turn=r.max_tokens_per_turn,
            max_response_length=r.max_response_length,
            invalid_action_limit=r.invalid_action_limit or None,
            temperature=r.temperature if temperature is None else temperature,
            top_k=r.top_k,
            top_p=r.top_p,
            straggler_wait_s=None if r.lock_step else r.straggler_wait_s,
            num_slots=r.num_slots,
            decode_chunk=r.decode_chunk,
            fill_tokens=r.fill_tokens,
            tool_calls=r.get("tool_calls", False),
        )
    except ValueError as e:
        raise ConfigError(f"config.rollout: {e}") from e
