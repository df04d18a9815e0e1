"""`UpdateConfig`s for the trainer's tests from flat keyword fields, each given to the part that
has it: `Forward`, `Batching`, `RLSpec`, or the hyper-parameters the estimator or loss declares."""

from __future__ import annotations

import dataclasses
from typing import Any

from agentgym_jax.models.config import ModelConfig
from agentgym_jax.rl.advantages import ADVANTAGE_ESTIMATORS
from agentgym_jax.rl.losses import POLICY_LOSSES
from agentgym_jax.train.scoring import Forward
from agentgym_jax.train.steps import Batching, RLSpec, UpdateConfig


def update(model: ModelConfig, rl: bool = True, **fields: Any) -> UpdateConfig:
    """`update(MODEL, num_microbatches=2, kl_coef=0.1)`; `rl=False`: behaviour cloning only."""
    parts: dict[type, dict[str, Any]] = {Forward: {}, Batching: {}, RLSpec: {}}
    estimator = ADVANTAGE_ESTIMATORS[fields.get("advantage", "grpo")]
    loss = POLICY_LOSSES[fields.get("policy_loss", "ppo")]
    advantage_hparams, loss_hparams = {}, {}
    for name, value in fields.items():
        owner = next((cls for cls in parts if name in {f.name for f in dataclasses.fields(cls)}), None)
        if owner is not None:
            parts[owner][name] = value
        elif name in estimator.hparams:
            advantage_hparams[name] = value
        elif name in loss.hparams:
            loss_hparams[name] = value
        else:
            raise TypeError(f"no update field or hyper-parameter {name!r}")
    spec = RLSpec(**parts[RLSpec], advantage_hparams=advantage_hparams, loss_hparams=loss_hparams) if rl else None
    return UpdateConfig(Forward(model, **parts[Forward]), Batching(**parts[Batching]), spec)


def replace(config: UpdateConfig, **fields: Any) -> UpdateConfig:
    """`config` with flat fields replaced in whichever part has them."""
    parts = {}
    for part in ("forward", "batching", "rl"):
        value = getattr(config, part)
        names = {f.name for f in dataclasses.fields(value)} if value is not None else set()
        if mine := {k: v for k, v in fields.items() if k in names}:
            parts[part] = dataclasses.replace(value, **mine)
    if unknown := set(fields) - {k for part in parts.values() for k in fields if hasattr(part, k)}:
        raise TypeError(f"no update field {sorted(unknown)}")
    return dataclasses.replace(config, **parts)
