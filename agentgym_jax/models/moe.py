"""The mixture-of-experts MLP (Qwen3-MoE, Qwen2-MoE): top-k routing, expert dispatch, the
router's load-balancing loss and how often two runs route alike.

Routing follows the family: a linear router gives each token a softmax over the experts (in
float32), the `num_experts_per_tok` largest probabilities pick its experts and, with
`norm_topk_prob`, are renormalised to sum to 1; the token's output is the weighted sum of its
experts' SwiGLU MLPs. (Qwen2-MoE's shared expert, gated by a sigmoid, is the decoder's `MLP`
beside this layer: `decoder.Block`.)

Two dispatches compute the same sum (`kernels.MOE_DISPATCH`, chosen per backend by
`kernels.AttentionKernels.for_backend`):
- "dense": every expert runs on every token and the routing weights (zero off the top k) mix
  them: einsums over groups of experts, no data movement; `num_experts / num_experts_per_tok`
  times the expert FLOPs, so it is for the CPU, the tests and tiny models;
- "ragged": the (token, expert) pairs are sorted by expert and each expert's contiguous rows go
  through `jax.lax.ragged_dot`, a grouped matmul (native on TPU, XLA's ragged dot on GPU; on the
  CPU it lowers to a masked dense product): the FLOPs of the chosen experts only, exact, no
  capacity and no dropped tokens.

Parameters (under `layers/moe/`, a leading [layers] axis): `router/kernel [hidden, experts]`,
`{gate,up}_proj/kernel [experts, hidden, moe]`, `down_proj/kernel [experts, moe, hidden]`. LoRA
adapters on the experts (`expert_{gate,up,down}_lora/{a [experts, in, rank], b [experts, rank,
out]}`, `models/tuning.py`) give each expert its own low-rank update.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from agentgym_jax.models.config import ModelConfig
from agentgym_jax.models.kernels import MOE_DISPATCH

EXPERT_PROJECTIONS = ("gate", "up", "down")
_INIT = nn.initializers.normal(0.02)


class Routing(NamedTuple):
    """What the routers did on a batch, per layer (a leading [layers] axis from the decoder).

    `experts` are each token's chosen experts, most probable first; `load` counts the (real
    token, chosen expert) pairs per expert and `importance` sums the router's probabilities per
    expert over real tokens (padding, position -1, counts in neither); `tokens` counts real tokens.
    """

    experts: jax.Array  # [batch, seq, k] int32
    load: jax.Array  # [experts] float32
    importance: jax.Array  # [experts] float32
    tokens: jax.Array  # [] float32


def route(logits: jax.Array, k: int, norm_topk_prob: bool) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(weights [..., k] float32, experts [..., k] int32, probabilities [..., experts] float32)
    of router logits [..., experts]: softmax in float32, the top k, renormalised if asked."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, k)
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32), probs


def load_balancing_loss(routing: Routing, num_experts: int) -> jax.Array:
    """The Switch-Transformer auxiliary loss of the family over all layers and real tokens:
    `num_experts * sum_e f_e * P_e`, where f_e is the share of (token, chosen expert) pairs that
    picked expert e and P_e its mean router probability, both taken over every layer's real
    tokens together (transformers' `load_balancing_loss_func` with an attention mask)."""
    rows = jnp.maximum(jnp.sum(routing.tokens), 1.0)  # tokens x layers
    load = jnp.sum(routing.load, axis=0) / rows
    importance = jnp.sum(routing.importance, axis=0) / rows
    return num_experts * jnp.sum(load * importance)


def routing_mismatch(experts: jax.Array, other: jax.Array, real: jax.Array) -> jax.Array:
    """The share of (real token, layer) pairs whose chosen expert sets differ between two runs
    (the sampler's and the trainer's, say). experts, other [layers, batch, seq, k]; real
    [batch, seq] bool."""
    same = jnp.all(jnp.sort(experts, axis=-1) == jnp.sort(other, axis=-1), axis=-1)  # [layers, batch, seq]
    real = jnp.broadcast_to(real, same.shape)
    return jnp.sum(real & ~same) / jnp.maximum(jnp.sum(real), 1)


class _Kernel(nn.Module):
    """One stacked weight `kernel` of the given shape (all experts' weights of one projection)."""

    shape: tuple[int, ...]
    param_dtype: jnp.dtype

    @nn.compact
    def __call__(self) -> jax.Array:
        return self.param("kernel", _INIT, self.shape, self.param_dtype)


EXPERT_GROUP = 16  # experts per step of the dense dispatch: bounds its [tokens, group, moe] temporaries


def _expert_mlp(x: jax.Array, weights: dict, matmul, scale: jax.Array) -> jax.Array:
    """down(silu(gate(x)) * up(x) * scale) through each row's expert(s), LoRA updates included:
    `weights[p]` holds `kernel` and, for adapted projections, `a` and `b` (scaled already);
    `matmul(h, w)` applies stacked weights w [experts, in, out] to h."""

    def project(name: str, h: jax.Array) -> jax.Array:
        w = weights[name]
        out = matmul(h, w["kernel"])
        return out + matmul(matmul(h, w["a"]), w["b"]) if "a" in w else out

    return project("down", nn.silu(project("gate", x)) * project("up", x) * scale)


def _dense_experts(tokens: jax.Array, mix: jax.Array, weights: dict) -> jax.Array:
    """Every expert on every token, mixed by `mix` [T, experts] (zero off each token's top k):
    a map over groups of EXPERT_GROUP experts, each step rematerialised in the backward pass, so
    no pass holds the [T, experts, moe] activations of all experts at once. Returns [T, hidden]."""
    experts = mix.shape[1]
    group = next(g for g in range(min(EXPERT_GROUP, experts), 0, -1) if experts % g == 0)
    split = lambda w: w.reshape(experts // group, group, *w.shape[1:])  # noqa: E731
    each = lambda h, w: jnp.einsum("ti,eio->teo" if h.ndim == 2 else "tei,eio->teo", h, w)  # noqa: E731

    @functools.partial(jax.checkpoint, prevent_cse=False)
    def step(inputs):
        group_weights, group_mix = inputs  # leaves [group, ...], [T, group]
        return jnp.sum(_expert_mlp(tokens, group_weights, each, group_mix[..., None]), axis=1)

    parts = jax.lax.map(step, (jax.tree.map(split, weights), split(mix.T).swapaxes(1, 2)))
    return jnp.sum(parts, axis=0)


class MoE(nn.Module):
    """The layer's experts on x [batch, seq, hidden] at `positions` [batch, seq] (-1: padding):
    returns (output [batch, seq, hidden], `Routing`)."""

    config: ModelConfig
    dtype: jnp.dtype
    param_dtype: jnp.dtype
    dispatch: str = "dense"  # one of MOE_DISPATCH
    lora_targets: tuple[str, ...] = ()  # adapted expert projections ("gate", "up", "down")
    lora_scale: float = 0.0

    @nn.compact
    def __call__(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, Routing]:
        c = self.config
        if self.dispatch not in MOE_DISPATCH:
            raise ValueError(f"moe dispatch {self.dispatch!r} is not one of {', '.join(MOE_DISPATCH)}")
        batch, seq, hidden = x.shape
        experts, moe, k = c.num_experts, c.moe_intermediate_size, c.num_experts_per_tok
        tokens = x.reshape(-1, hidden)  # [T, hidden]
        logits = nn.Dense(experts, use_bias=False, dtype=self.dtype, param_dtype=self.param_dtype, kernel_init=_INIT,
                          name="router")(tokens)
        weights, chosen, probs = route(logits, k, c.norm_topk_prob)  # [T, k], [T, k], [T, experts]
        one_hot = jax.nn.one_hot(chosen, experts, dtype=jnp.float32)  # [T, k, experts]
        shapes = {"gate": (experts, hidden, moe), "up": (experts, hidden, moe), "down": (experts, moe, hidden)}
        weights_of = {p: {"kernel": _Kernel(shapes[p], self.param_dtype, name=f"{p}_proj")()} for p in shapes}
        for p in self.lora_targets:  # each expert's adapters, scaled here once
            lora = self.get_variable("params", f"expert_{p}_lora")
            weights_of[p].update(a=lora["a"], b=lora["b"] * self.lora_scale)
        weights_of = jax.tree.map(lambda w: w.astype(self.dtype), weights_of)  # leaves [experts, ...]
        if self.dispatch == "dense":
            mix = jnp.einsum("tk,tke->te", weights, one_hot)  # the routing weights, 0 off the top k
            out = _dense_experts(tokens, mix.astype(self.dtype), weights_of)
        else:
            flat = chosen.reshape(-1)  # [T * k] pairs, token-major
            order = jnp.argsort(flat, stable=True)
            sizes = jnp.bincount(flat, length=experts).astype(jnp.int32)
            rows = tokens[order // k]  # [T * k, hidden], sorted by expert
            matmul = lambda h, w: jax.lax.ragged_dot(h, w, sizes)  # noqa: E731
            y = _expert_mlp(rows, weights_of, matmul, weights.reshape(-1)[order][:, None].astype(self.dtype))
            out = jnp.sum(y[jnp.argsort(order)].reshape(-1, k, hidden), axis=1)
        real = (positions.reshape(-1) >= 0).astype(jnp.float32)  # [T]
        routing = Routing(
            experts=chosen.reshape(batch, seq, k),
            load=jnp.sum(one_hot * real[:, None, None], axis=(0, 1)),
            importance=jnp.sum(probs * real[:, None], axis=0),
            tokens=jnp.sum(real),
        )
        return out.reshape(batch, seq, hidden).astype(self.dtype), routing
