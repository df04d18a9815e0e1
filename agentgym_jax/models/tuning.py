"""Which parameters train: all of them, LoRA adapters, and/or only the top layers.

Training a pretrained model on a small machine is cheaper when most of it is frozen. `Tuning`
splits the decoder's parameters into a trainable and a frozen pytree:

- `trainable_layers=N`: the top N blocks (and the final norm) train; the bottom blocks move to
  `frozen_layers` with the embedding (and an untied head). The decoder runs the frozen blocks as
  their own scan and stops the gradient at their output, so the backward pass ends there.
- `lora_rank=r`: every target projection `W` gains adapters `a` [in, r] and `b` [r, out]
  (`<target>_lora/{a,b}` beside `<proj>`), computing `x @ W + (alpha / r) * (x @ a) @ b`; `b`
  starts at zero, so a fresh adapter leaves the model unchanged. Only adapters train (of the
  trainable layers, with both set); every base weight is frozen. A mixture of experts' projections
  are targets `expert_gate`, `expert_up`, `expert_down`: each expert its own pair ([experts, in,
  r], [experts, r, out]); leaving them out trains attention only and freezes every expert.

The trainer keeps `(trainable, frozen)` apart (frozen in the compute dtype, outside the
optimizer), runs forward passes on `combine(trainable, frozen)` (a dict merge: no copies), and
gives the sampler and the export `merge(trainable, frozen, tuning)`: plain parameters with the
adapters folded in and the layers stacked again, made once per RL step.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

Params = dict[str, Any]
# target -> (sub-module, projection, input dims of its kernel after the [layers] axis and its
# `batch` dims: the experts, each with its own adapters)
LORA_TARGETS = {
    "q": ("attn", "q_proj", 1), "k": ("attn", "k_proj", 1), "v": ("attn", "v_proj", 1), "o": ("attn", "o_proj", 2),
    "gate": ("mlp", "gate_proj", 1), "up": ("mlp", "up_proj", 1), "down": ("mlp", "down_proj", 1),
    "expert_gate": ("moe", "gate_proj", 1), "expert_up": ("moe", "up_proj", 1), "expert_down": ("moe", "down_proj", 1),
}
BATCH_DIMS = {"moe": 1}  # the [experts] axis after [layers]
LORA_SUFFIX = "_lora"


@dataclasses.dataclass(frozen=True)
class Tuning:
    """What trains (hashable: a static argument of the jitted steps). The default trains everything."""

    lora_rank: int = 0  # 0: no adapters
    lora_alpha: float = 16.0  # adapters scaled by alpha / rank
    lora_targets: tuple[str, ...] = ("q", "k", "v", "o", "gate", "up", "down")
    trainable_layers: int = 0  # 0: every layer

    def __post_init__(self):
        if self.lora_rank < 0 or self.trainable_layers < 0:
            raise ValueError(f"lora_rank and trainable_layers must be >= 0, got {self.lora_rank}, {self.trainable_layers}")
        unknown = sorted(set(self.lora_targets) - set(LORA_TARGETS))
        if unknown or not self.lora_targets:
            raise ValueError(f"lora_targets {list(self.lora_targets)}: unknown {unknown}; valid: {', '.join(LORA_TARGETS)}")

    @property
    def full(self) -> bool:
        return self.lora_rank == 0 and self.trainable_layers == 0

    @property
    def lora_scale(self) -> float:
        return self.lora_alpha / self.lora_rank if self.lora_rank else 0.0


def split(params: Params, tuning: Tuning, rng: jax.Array, frozen_dtype: jnp.dtype | None = None) -> tuple[Params, Params]:
    """(trainable, frozen) of the decoder's `params` (stacked layers); frozen leaves cast to
    `frozen_dtype` (None: as they are). A value head always trains."""
    if tuning.full:
        return params, {}
    num_layers = jax.tree.leaves(params["layers"])[0].shape[0]
    if tuning.trainable_layers > num_layers:
        raise ValueError(f"trainable_layers={tuning.trainable_layers} but the model has {num_layers} layers")
    cast = (lambda x: x) if frozen_dtype is None else (lambda x: x.astype(frozen_dtype))  # noqa: E731
    top = tuning.trainable_layers or num_layers
    frozen = {name: p for name, p in params.items() if name not in ("layers", "final_norm", "value_head")}
    layers = params["layers"]
    if top < num_layers:
        frozen["frozen_layers"] = jax.tree.map(lambda x: x[: num_layers - top], layers)
        layers = jax.tree.map(lambda x: x[num_layers - top :], layers)
    trainable = {"layers": layers, "final_norm": params["final_norm"]}
    if tuning.lora_rank:  # adapters train; the top layers' base weights freeze too
        frozen.update(trainable)
        trainable = {"layers": init_adapters(layers, tuning, rng)}
    if "value_head" in params:
        trainable["value_head"] = params["value_head"]
    return trainable, jax.tree.map(cast, frozen)


def init_adapters(layers: Params, tuning: Tuning, rng: jax.Array) -> Params:
    """`{attn: {q_lora: {a, b}, ...}, mlp: {...}}` for stacked `layers`: `a` ~ N(0, 1/fan_in), `b` = 0."""
    adapters: Params = {}
    for i, target in enumerate(tuning.lora_targets):
        module, proj, n_in = LORA_TARGETS[target]
        if module not in layers:
            present = ", ".join(t for t, (m, _, _) in LORA_TARGETS.items() if m in layers)
            raise ValueError(f"lora target {target!r} names a {module} layer this model has not; its targets: {present}")
        kernel = layers[module][proj]["kernel"]  # [L, *batch, *in, *out]
        lead = 1 + BATCH_DIMS.get(module, 0)
        fan_in = math.prod(kernel.shape[lead : lead + n_in])
        a_shape = (*kernel.shape[: lead + n_in], tuning.lora_rank)
        b_shape = (*kernel.shape[:lead], tuning.lora_rank, *kernel.shape[lead + n_in :])
        a = jax.random.normal(jax.random.fold_in(rng, i), a_shape, jnp.float32) * fan_in**-0.5
        adapters.setdefault(module, {})[target + LORA_SUFFIX] = {"a": a.astype(kernel.dtype), "b": jnp.zeros(b_shape, kernel.dtype)}
    return adapters


def combine(trainable: Params, frozen: Params) -> Params:
    """The parameter tree the training forward runs on: `frozen` with `trainable` merged in
    (nested dicts merged key by key; nothing is copied)."""
    out = dict(frozen)
    for name, value in trainable.items():
        out[name] = combine(value, frozen[name]) if isinstance(value, dict) and isinstance(frozen.get(name), dict) else value
    return out


def merge(trainable: Params, frozen: Params, lora_scale: float, dtype: jnp.dtype | None = None) -> Params:
    """Plain decoder parameters (what the sampler, evaluation and export read): adapters folded
    into their kernels, frozen and trainable layers stacked again; floating leaves in `dtype`
    (None: the kernels' own). Jit it: it makes one new copy of the model."""
    params = combine(trainable, frozen)
    layers = params["layers"]
    for module in ("attn", "mlp", "moe"):
        for name in [n for n in layers.get(module, {}) if n.endswith(LORA_SUFFIX)]:
            lora = layers[module][name]
            proj = LORA_TARGETS[name.removesuffix(LORA_SUFFIX)][1]
            kernel = layers[module][proj]["kernel"]
            a, b = lora["a"].astype(jnp.float32), lora["b"].astype(jnp.float32)
            lead, rank = 1 + BATCH_DIMS.get(module, 0), a.shape[-1]
            # [L * batch, in, rank] @ [L * batch, rank, out] per layer (and expert)
            delta = jnp.einsum("nir,nro->nio", a.reshape(-1, math.prod(a.shape[lead:-1]), rank),
                               b.reshape(-1, rank, math.prod(b.shape[lead + 1:])))
            merged = kernel.astype(jnp.float32) + lora_scale * delta.reshape(kernel.shape)
            layers = {**layers, module: {**{k: v for k, v in layers[module].items() if k != name},
                                         proj: {**layers[module][proj], "kernel": merged.astype(kernel.dtype)}}}
    if "frozen_layers" in params:
        layers = jax.tree.map(lambda low, high: jnp.concatenate([low.astype(high.dtype), high]), params.pop("frozen_layers"), layers)
    params["layers"] = layers
    if dtype is not None:
        params = jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, params)
    return params
