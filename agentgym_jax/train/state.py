"""The train state pytree and its optimizer.

Everything a jitted update reads or writes is in `TrainState`: parameters, optimizer state, the
step counter, the RNG key and a count of skipped (non-finite) updates. The frozen reference
policy is a separate params pytree passed alongside, never updated (`reference_params`).
With tuned training (`models/tuning.py`: LoRA, top layers only) `params` are the trainable part
and `frozen` the rest, in the compute dtype and outside the optimizer; forward passes run on
`policy_params` (the two merged as dicts), and checkpoints leave `frozen` out.

Precision: the parameters are the master weights (float32 in the large-model configs; bfloat16
storage also trains), the optimizer state keeps the dtypes `tx.init` gave it, gradients arrive in
float32 (`steps.accumulated_update`), and the forward passes cast to the compute dtype.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import ml_collections
import optax

from agentgym_jax.models import tuning


@flax.struct.dataclass
class TrainState:
    params: Any
    opt_state: optax.OptState
    step: jax.Array  # [] int32; optimizer updates applied so far
    rng: jax.Array  # PRNG key data, uint32[2]
    skipped_updates: jax.Array  # [] int32; updates dropped because loss or grads were not finite
    tx: optax.GradientTransformation = flax.struct.field(pytree_node=False)
    frozen: Any = flax.struct.field(default_factory=dict)  # parameters that do not train ({}: none)

    @classmethod
    def create(cls, params: Any, tx: optax.GradientTransformation, rng: jax.Array, frozen: Any = None) -> TrainState:
        return cls(
            params=params,
            opt_state=tx.init(params),
            step=jnp.zeros((), jnp.int32),
            rng=rng,
            skipped_updates=jnp.zeros((), jnp.int32),
            tx=tx,
            frozen=frozen or {},
        )

    @property
    def policy_params(self) -> Any:
        """What forward passes run on: `params`, with `frozen` merged in when tuned."""
        return self.policy_of(self.params)

    def policy_of(self, params: Any) -> Any:
        """The whole policy of trainable `params` like this state's (e.g. the reference's)."""
        return tuning.combine(params, self.frozen) if self.frozen else params

    def apply_gradients(self, grads: Any, loss: jax.Array | None = None, empty: jax.Array | bool = False) -> TrainState:
        """One optimizer update, or none when `grads` (or `loss`) holds a non-finite value (counted
        in `skipped_updates`) or when `empty` (the batch trained no token): a zero gradient would
        still move the parameters along the optimizer's momentum and weight decay."""
        checked = jax.tree.leaves(grads) + ([loss] if loss is not None else [])
        finite = jnp.all(jnp.asarray([jnp.all(jnp.isfinite(x)) for x in checked]))
        applied = finite & ~jnp.asarray(empty)
        updates, opt_state = self.tx.update(grads, self.opt_state, self.params)
        # float32 gradients would promote bfloat16 moments; each state keeps its dtype (and a
        # scanned update its carry type). `apply_updates` casts to the parameters' dtype.
        opt_state = jax.tree.map(lambda new, old: new.astype(old.dtype), opt_state, self.opt_state)
        params = optax.apply_updates(self.params, updates)
        keep = lambda new, old: jnp.where(applied, new, old)  # noqa: E731
        return self.replace(
            params=jax.tree.map(keep, params, self.params),
            opt_state=jax.tree.map(keep, opt_state, self.opt_state),
            step=self.step + applied.astype(jnp.int32),
            skipped_updates=self.skipped_updates + (~finite).astype(jnp.int32),
        )


def reference_params(params: Any, compute_dtype: str | None) -> Any:
    """A frozen copy of `params` for the reference policy, stored in the compute dtype (None: as is).

    It is only ever read by forward passes in that dtype and has no optimizer, so float32 master
    weights would be twice the memory for nothing. A copy even in the same dtype: the train state
    is donated to the update, the reference must not share its buffers.
    """
    dtype = jnp.dtype(compute_dtype) if compute_dtype else None
    return jax.tree.map(lambda x: x.copy() if dtype is None or x.dtype == dtype else x.astype(dtype), params)


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
