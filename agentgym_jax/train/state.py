"""The train state pytree and its optimizer.

Everything a jitted update reads or writes is in `TrainState`: parameters, optimizer state, the
step counter, the RNG key and a count of skipped (non-finite) updates. The frozen reference
policy is a separate params pytree passed alongside, never updated.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import ml_collections
import optax


@flax.struct.dataclass
class TrainState:
    params: Any
    opt_state: optax.OptState
    step: jax.Array  # [] int32; optimizer updates applied so far
    rng: jax.Array  # PRNG key data, uint32[2]
    skipped_updates: jax.Array  # [] int32; updates dropped because loss or grads were not finite
    tx: optax.GradientTransformation = flax.struct.field(pytree_node=False)

    @classmethod
    def create(cls, params: Any, tx: optax.GradientTransformation, rng: jax.Array) -> TrainState:
        return cls(
            params=params,
            opt_state=tx.init(params),
            step=jnp.zeros((), jnp.int32),
            rng=rng,
            skipped_updates=jnp.zeros((), jnp.int32),
            tx=tx,
        )

    def apply_gradients(self, grads: Any, loss: jax.Array | None = None) -> TrainState:
        """One optimizer update, or none when `grads` (or `loss`) holds a non-finite value."""
        checked = jax.tree.leaves(grads) + ([loss] if loss is not None else [])
        finite = jnp.all(jnp.asarray([jnp.all(jnp.isfinite(x)) for x in checked]))
        updates, opt_state = self.tx.update(grads, self.opt_state, self.params)
        params = optax.apply_updates(self.params, updates)
        keep = lambda new, old: jnp.where(finite, new, old)  # noqa: E731
        return self.replace(
            params=jax.tree.map(keep, params, self.params),
            opt_state=jax.tree.map(keep, opt_state, self.opt_state),
            step=self.step + finite.astype(jnp.int32),
            skipped_updates=self.skipped_updates + (~finite).astype(jnp.int32),
        )


def make_optimizer(config: ml_collections.ConfigDict) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW on a linear warm-up + cosine/constant schedule.

    Reads `lr`, `warmup_steps`, `total_updates`, `lr_schedule` ("cosine" | "constant"),
    `weight_decay`, `grad_clip`, `b1`, `b2`.
    """
    if config.lr_schedule == "cosine":
        decay = optax.cosine_decay_schedule(config.lr, max(config.total_updates - config.warmup_steps, 1))
    elif config.lr_schedule == "constant":
        decay = optax.constant_schedule(config.lr)
    else:
        raise ValueError(f"unknown lr_schedule {config.lr_schedule!r}; valid: cosine, constant")
    schedule = decay
    if config.warmup_steps > 0:
        warmup = optax.linear_schedule(config.lr / config.warmup_steps, config.lr, config.warmup_steps - 1)
        schedule = optax.join_schedules([warmup, decay], [config.warmup_steps])
    return optax.chain(
        optax.clip_by_global_norm(config.grad_clip),
        optax.adamw(schedule, b1=config.b1, b2=config.b2, weight_decay=config.weight_decay),
    )
